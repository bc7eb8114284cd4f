"""A nats-server secured as operators run one, for tests: a config file of the test's own
(TLS with client certificates, users with passwords, tokens, nkeys, or an operator with JWTs),
and the files a client needs, all made at test time: a CA and certificates (``cryptography``),
nkeys and signed JWTs (``nkeys``). Nothing is fetched; nothing outlives the test."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from worker.commands.localservers import (
    NatsServer,
    find_nats_server,
    free_port,
    stop_process,
    wait_port,
)

LOOPBACK = "127.0.0.1"


class ConfiguredNats(NatsServer):
    """nats-server run with ``config`` (the body of a config file; listen address, port and
    JetStream's store are added), ``env`` for its ``$VARIABLES``."""

    def __init__(self, directory: Path, config: str, env: dict[str, str] | None = None) -> None:
        super().__init__(str(directory / "store"), free_port())
        self._own_dir = True
        self._conf = directory / "nats-server.conf"
        self._conf.write_text(
            f'host: "{LOOPBACK}"\nport: {self.port}\n'
            f'jetstream {{ store_dir: "{self.store_dir}" }}\n{config}\n'
        )
        self._env = env or {}

    def start(self) -> ConfiguredNats:
        Path(self.store_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(self.store_dir) / "nats-server.log"
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(self._conf), "-l", str(log_path)],
            env={**os.environ, **self._env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_port(self.port, self.proc, "nats-server")
        except RuntimeError as error:
            self.stop(remove=False)
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            raise RuntimeError(f"{error}; its log ends:\n{tail}") from None
        return self

    def log(self) -> str:
        path = Path(self.store_dir) / "nats-server.log"
        return path.read_text(errors="replace") if path.exists() else ""


def stop(server: NatsServer) -> None:
    if server.proc is not None:
        stop_process(server.proc)
        server.proc = None


# --- TLS -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate the server's CA did not sign
    stranger_key: Path


def make_pki(directory: Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1, a client certificate it signed, and one
    signed by another CA."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("test CA")
    other_key, other_cert = _ca("another CA")
    files = {"ca": _pem_cert(directory / "ca.pem", ca_cert)}
    for name, issuer_key, issuer, server in (
        ("server", ca_key, ca_cert, True),
        ("client", ca_key, ca_cert, False),
        ("stranger", other_key, other_cert, False),
    ):
        key, cert = _leaf(name, issuer_key, issuer, server)
        files[f"{name}_cert"] = _pem_cert(directory / f"{name}.pem", cert)
        files[f"{name}_key"] = _pem_key(directory / f"{name}-key.pem", key)
    return Pki(**files)


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _builder(subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey):
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common, _name(common), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(common: str, issuer_key, issuer: x509.Certificate, server: bool):
    import ipaddress

    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(common, issuer.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    )
    if server:
        names = [x509.IPAddress(ipaddress.ip_address(LOOPBACK)), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def _pem_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _pem_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path


# --- nkeys and JWTs --------------------------------------------------------------------------


def new_nkey(prefix: int) -> nkeys.KeyPair:
    """A fresh key pair: ``nkeys.PREFIX_BYTE_USER``, ``_ACCOUNT`` or ``_OPERATOR``."""
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def public(key: nkeys.KeyPair) -> str:
    return key.public_key.decode()


def seed(key: nkeys.KeyPair) -> str:
    return key.seed.decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def jwt(issuer: nkeys.KeyPair, subject: str, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT (v2, ``ed25519-nkey``) for ``subject``, signed by ``issuer``."""
    claims: dict[str, object] = {
        "iat": int(time.time()) - 60,
        "iss": public(issuer),
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    body = json.dumps(claims, separators=(",", ":")).encode()
    claims["jti"] = base64.b32encode(hashlib.sha512(body).digest()[:32]).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = issuer.sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(signature)}"


@dataclass(frozen=True)
class Operator:
    config: str  # the server's config block: operator, resolver, preloaded account
    creds: Path  # a user's creds file (user JWT + its nkey seed)
    stranger_creds: Path  # a user signed by an account the server does not know
    user_seed: str


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}
_ACCOUNT_LIMITS = {
    **_UNLIMITED,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
}


def make_operator(directory: Path) -> Operator:
    """Decentralised auth as Synadia's and ``nsc``-run servers have it: an operator JWT, an
    account JWT with JetStream, preloaded into a memory resolver, and a user's creds file."""
    directory.mkdir(parents=True, exist_ok=True)
    operator = new_nkey(nkeys.PREFIX_BYTE_OPERATOR)
    system, account = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT), new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    op_jwt = jwt(operator, public(operator), "test-operator", {"type": "operator"})
    sys_jwt = jwt(operator, public(system), "SYS", {"type": "account", "limits": _UNLIMITED})
    account_jwt = jwt(
        operator, public(account), "workers", {"type": "account", "limits": _ACCOUNT_LIMITS}
    )
    user = new_nkey(nkeys.PREFIX_BYTE_USER)
    user_jwt = jwt(account, public(user), "worker", {"type": "user", **_UNLIMITED})
    creds = _creds(directory / "worker.creds", user_jwt, seed(user))
    outsider_account = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    stranger = new_nkey(nkeys.PREFIX_BYTE_USER)
    stranger_jwt = jwt(outsider_account, public(stranger), "stranger", {"type": "user"})
    stranger_creds = _creds(directory / "stranger.creds", stranger_jwt, seed(stranger))
    config = (
        f"operator: {op_jwt}\n"
        f"system_account: {public(system)}\n"
        "resolver: MEMORY\n"
        f"resolver_preload: {{\n  {public(system)}: {sys_jwt}\n"
        f"  {public(account)}: {account_jwt}\n}}\n"
    )
    return Operator(config, creds, stranger_creds, seed(user))


def _creds(path: Path, user_jwt: str, user_seed: str) -> Path:
    path.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user_seed}\n"
        "------END USER NKEY SEED------\n"
    )
    path.chmod(0o600)
    return path

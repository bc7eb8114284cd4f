"""http(s):// image reads under the source policy.

- Addresses: a host is resolved once per hop and every address it resolves to is checked;
  loopback, private, link-local, multicast, reserved and unspecified addresses (also when
  embedded in an IPv6 address) are refused unless the host is allowed by name. The
  connection goes to the checked address, so a second resolution cannot swap it.
- Redirects: followed up to a bound, each one checked like the first; never to another scheme.
- Size: ``max_bytes`` enforced while reading, whatever Content-Length says.
- Time: one deadline for the whole object (connect, TLS, headers, body), see ``Cutoff``.
- Connections: with ``keep_alive`` > 0, kept alive per origin and process
  (``datasets.keepalive``) once an answer was read whole; a connection that failed, was cut
  at the deadline, or carried a redirect or an error answer is closed. A kept one the server
  closed before answering is given up and the GET made once more on a new connection.

Errors name the URL redacted (scheme, host, path): never a query string or credentials.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

from config.errors import ErrorKind, PermanentError, RetryableRead, TransientError
from config.names import env_name
from config.redact import redact_url
from datasets import keepalive
from datasets.budget import Admit, admit_all
from datasets.deadline import Cutoff, Watch
from datasets.keepalive import Origin

_REDIRECTS = {301, 302, 303, 307, 308}
_CHUNK_BYTES = 256 * 1024
_USER_AGENT = "inference-worker"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # well-known prefix: IPv4 in the low 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")


@dataclass(frozen=True)
class HttpPolicy:
    allowed: frozenset[tuple[str, int | None]] = frozenset()  # (host, port or None = any)
    max_bytes: int = 64 * 1024 * 1024
    deadline_s: float = 30.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 20.0  # one read; the deadline bounds them all
    max_redirects: int = 5
    keep_alive: int = 0  # idle connections kept per origin (datasets.keepalive); 0: none


def refused_address(ip: IPAddress) -> bool:
    """True for every address an image URL from a stranger must not reach."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return True
        if ip in _NAT64:  # the IPv4 address it translates to is what it reaches
            return refused_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        embedded = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        if any(inner is not None and refused_address(inner) for inner in embedded):
            return True
    return (
        not ip.is_global
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def allowed_entry(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as (host, port or None)."""
    entry = entry.strip().lower()
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
    elif entry.count(":") == 1:
        host, _, port = entry.partition(":")
    else:
        host, port = entry, ""
    if port and not port.isdigit():
        return host.rstrip("."), -1  # a malformed port allows nothing (settings refuse it)
    return host.rstrip("."), int(port) if port else None


def host_allowed(host: str, port: int, allowed: frozenset[tuple[str, int | None]]) -> bool:
    name = host.lower().rstrip(".")
    return (name, None) in allowed or (name, port) in allowed


Address = tuple[int, tuple[Any, ...]]  # (family, sockaddr)


def _resolve(url: str, host: str, port: int, policy: HttpPolicy, cutoff: Cutoff) -> list[Address]:
    try:
        infos = _getaddrinfo_by(host, port, cutoff)
    except socket.gaierror as error:
        if error.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5)):
            raise PermanentError(
                f"{redact_url(url)}: host not found", kind="object_missing"
            ) from None
        raise TransientError(
            f"{redact_url(url)}: cannot resolve the host ({error})", kind="http_unavailable"
        ) from None
    addresses: list[Address] = [(int(family), sockaddr) for family, _t, _p, _c, sockaddr in infos]
    if not host_allowed(host, port, policy.allowed):
        for _family, sockaddr in addresses:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if refused_address(ip):
                raise PermanentError(
                    f"{redact_url(url)}: refused, the host resolves to a loopback, private, "
                    "link-local, multicast or reserved address (allow it with "
                    f"{env_name('sources', 'allowed_hosts')})",
                    kind="address_refused",
                )
    return addresses


def _getaddrinfo_by(host: str, port: int, cutoff: Cutoff) -> list[Any]:
    """getaddrinfo, given up at the deadline (the resolver has no timeout of ours)."""
    answer: list[Any] = []

    def resolve() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as error:
            answer.append(error)

    thread = threading.Thread(target=resolve, name="resolve", daemon=True)
    thread.start()
    thread.join(cutoff.remaining_s())
    if not answer:
        raise TransientError(
            "the host did not resolve before the object deadline", kind="deadline_exceeded"
        )
    if isinstance(answer[0], OSError):
        raise answer[0]
    return list(answer[0])


def _connect(addresses: list[Address], policy: HttpPolicy, cutoff: Cutoff) -> socket.socket:
    last: OSError | None = None
    for family, sockaddr in addresses:
        if cutoff.expired():
            break
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(min(policy.connect_timeout_s, cutoff.remaining_s()))
        try:
            sock.connect(sockaddr)
            return sock
        except OSError as error:
            sock.close()
            last = error
    raise last or OSError("no address to connect to")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def read_http(
    url: str, policy: HttpPolicy, admit: Admit = admit_all, cutoff: Cutoff | None = None
) -> bytes:
    """The object's bytes, or PermanentError / TransientError saying why not (RetryableRead
    when another attempt may do: no byte for ``read_timeout_s``, 429/5xx, a broken
    connection). ``admit`` is asked for room once the body's size is known (``max_bytes``
    when it is not declared). ``cutoff``: the object's deadline, when the caller keeps it
    across attempts; otherwise ``policy.deadline_s`` from now."""
    if cutoff is None:
        with Cutoff(policy.deadline_s) as own:
            return read_http(url, policy, admit, own)
    for _hop in range(policy.max_redirects + 1):
        status, location, body = _get_once(url, policy, cutoff, admit)
        if status not in _REDIRECTS:
            return _body_or_error(url, status, body)
        if not location:
            raise PermanentError(
                f"{redact_url(url)}: redirect without a Location", kind="redirect_refused"
            )
        target = urljoin(url, location)
        if urlsplit(target).scheme != urlsplit(url).scheme:
            raise PermanentError(
                f"{redact_url(url)}: refused a redirect to another scheme ({redact_url(target)})",
                kind="redirect_refused",
            )
        url = target
    raise PermanentError(
        f"{redact_url(url)}: more than {policy.max_redirects} redirects", kind="redirect_refused"
    )


def _body_or_error(url: str, status: int, body: bytes) -> bytes:
    if 200 <= status < 300:
        return body
    if status >= 500 or status == 429:
        reason = "throttled" if status in (429, 503) else "unavailable"
        raise RetryableRead(
            f"HTTP {status} for {redact_url(url)}", kind="http_unavailable", reason=reason
        )
    kind: ErrorKind = "object_missing" if status in (404, 410) else "http_error"
    raise PermanentError(f"HTTP {status} for {redact_url(url)}", kind=kind)


def _get_once(url: str, policy: HttpPolicy, cutoff: Cutoff, admit: Admit) -> tuple[int, str, bytes]:
    """One GET: (status, Location, body). Bodies of redirects and errors are not kept."""
    parts = urlsplit(url)
    host, scheme = parts.hostname or "", parts.scheme
    if scheme not in ("http", "https") or not host:
        raise PermanentError(f"{redact_url(url)} is not an http(s) URL", kind="invalid_uri")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise PermanentError(f"{redact_url(url)}: invalid port", kind="invalid_uri") from None
    origin = Origin(scheme, host.lower().rstrip("."), port, policy.allowed)
    try:
        kept = keepalive.pool().take(origin) if policy.keep_alive > 0 else None
        if kept is not None:
            try:
                return _on(kept, cutoff.watch(kept.sock), True, url, origin, policy, cutoff, admit)
            except _Stale:
                pass  # the server closed it as we asked: once more, on a connection of our own
        addresses = _resolve(url, host, port, policy, cutoff)
        connection, watch = _open(addresses, host, port, scheme, policy, cutoff)
        return _on(connection, watch, False, url, origin, policy, cutoff, admit)
    except ssl.SSLCertVerificationError as error:
        raise PermanentError(
            f"{redact_url(url)}: TLS certificate refused ({error.verify_message})",
            kind="tls_error",
        ) from None
    except (http.client.InvalidURL, UnicodeError, ValueError) as error:
        # The error's own text may quote the request target, query string and all.
        raise PermanentError(
            f"{redact_url(url)}: invalid URL ({type(error).__name__})", kind="invalid_uri"
        ) from None
    except (OSError, http.client.HTTPException) as error:
        if cutoff.expired():
            raise TransientError(
                f"{redact_url(url)}: no whole object within {policy.deadline_s:g}s",
                kind="deadline_exceeded",
            ) from None
        raise RetryableRead(
            f"cannot read {redact_url(url)}: {type(error).__name__}",
            kind="http_unavailable",
            reason="stalled" if isinstance(error, TimeoutError) else "unavailable",
        ) from None


class _Stale(Exception):
    """A kept-alive connection the server had closed: no answer began on it."""


def _open(
    addresses: list[Address], host: str, port: int, scheme: str, policy: HttpPolicy, cutoff: Cutoff
) -> tuple[http.client.HTTPConnection, Watch]:
    """A new connection to a checked address (TLS handshake made), watched by ``cutoff``."""
    sock = _connect(addresses, policy, cutoff)
    try:
        sock.settimeout(min(policy.read_timeout_s, cutoff.remaining_s()))
        if scheme == "https":
            sock = _tls_context().wrap_socket(
                sock, server_hostname=host, do_handshake_on_connect=False
            )
            watch = cutoff.watch(sock)
            try:
                sock.do_handshake()  # under the deadline too
            except BaseException:
                watch.release()
                raise
        else:
            watch = cutoff.watch(sock)
    except BaseException:
        sock.close()
        raise
    connection = http.client.HTTPConnection(host, port, timeout=cutoff.remaining_s())
    connection.sock = sock
    connection.auto_open = 0  # never a connection of its own, to an address nobody checked
    return connection, watch


def _on(
    connection: http.client.HTTPConnection,
    watch: Watch,
    reused: bool,
    url: str,
    origin: Origin,
    policy: HttpPolicy,
    cutoff: Cutoff,
    admit: Admit,
) -> tuple[int, str, bytes]:
    """One exchange on ``connection``; kept for the next read when its answer was read whole
    and the server keeps it open, closed otherwise."""
    keep = False
    try:
        if connection.sock is not None:
            connection.sock.settimeout(min(policy.read_timeout_s, cutoff.remaining_s()))
        response = _ask(url, connection, policy, reused)
        status, location, body = _answer(url, response, policy, cutoff, admit)
        whole = response.isclosed() or response.length == 0  # read1 leaves it open at 0
        ok = 200 <= status < 300  # a redirect or an error answer: closed, as the docs say
        keep = policy.keep_alive > 0 and not response.will_close and whole and ok
        if keep:
            response.close()  # its file only: the connection's socket stays, for the next GET
        return status, location, body
    finally:
        cut_already = not watch.release()
        if keep and not cut_already and not cutoff.expired():
            keepalive.pool().give(origin, connection, policy.keep_alive)
        else:
            connection.close()


def _ask(
    url: str, connection: http.client.HTTPConnection, policy: HttpPolicy, reused: bool
) -> http.client.HTTPResponse:
    split = urlsplit(url)
    target = (split.path or "/") + (f"?{split.query}" if split.query else "")
    netloc = split.netloc.rpartition("@")[2]  # never send userinfo anywhere
    try:
        connection.putrequest("GET", target, skip_host=True, skip_accept_encoding=True)
        connection.putheader("Host", netloc)
        connection.putheader("User-Agent", _USER_AGENT)
        connection.putheader("Accept-Encoding", "identity")
        if policy.keep_alive <= 0:
            connection.putheader("Connection", "close")
        connection.endheaders()
        return connection.getresponse()
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        if reused:
            raise _Stale from None
        raise


def _answer(
    url: str,
    response: http.client.HTTPResponse,
    policy: HttpPolicy,
    cutoff: Cutoff,
    admit: Admit,
) -> tuple[int, str, bytes]:
    status = response.status
    if status in _REDIRECTS or not 200 <= status < 300:
        return status, response.getheader("Location") or "", b""
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > policy.max_bytes:
        raise PermanentError(
            f"{redact_url(url)} is {declared} bytes, over {policy.max_bytes}", kind="too_large"
        )
    size = int(declared) if declared and declared.isdigit() else policy.max_bytes
    admit(size, cutoff.remaining_s())
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = response.read1(_CHUNK_BYTES)  # at most one read of the socket
        if not chunk:
            break
        total += len(chunk)
        if total > policy.max_bytes:
            raise PermanentError(
                f"{redact_url(url)} is over {policy.max_bytes} bytes", kind="too_large"
            )
        chunks.append(chunk)
    if cutoff.expired():
        raise OSError("cut off at the deadline")
    if response.length:  # the server closed before the Content-Length it declared
        raise http.client.IncompleteRead(b"".join(chunks), response.length)
    return status, "", b"".join(chunks)

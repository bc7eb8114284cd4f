"""http(s):// image reads under the source policy.

- Addresses: a host is resolved once per hop and every address it resolves to is checked;
  loopback, private, link-local, multicast, reserved and unspecified addresses (also when
  embedded in an IPv6 address) are refused unless the host is allowed by name. The
  connection goes to the checked address, so a second resolution cannot swap it.
- Redirects: followed up to a bound, each one checked like the first; never to another scheme.
- Size: ``max_bytes`` enforced while reading, whatever Content-Length says.
- Time: one deadline for the whole object (connect, TLS, headers, body), see ``Cutoff``.
- Connections: with ``keep_alive`` > 0, kept alive per origin and process
  (``datasets.http_transport.pool``) once an answer was read whole; a connection that failed,
  was cut at the deadline, or carried a redirect or an error answer is closed. A kept one the
  server closed before answering is given up and the GET made once more on a new connection.

Each GET is one exchange of ``datasets.http_transport`` (its deadline the object's, its body
capped at ``max_bytes``); this module decides where it may go and what its answer means.

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

from config.errors import ErrorKind, PermanentError, RetryableRead, TooLarge, TransientError
from config.names import env_name
from config.redact import redact_url
from datasets import http_transport
from datasets.budget import Admit, admit_all
from datasets.deadline import Cutoff
from datasets.http_transport import Exchange, Origin, Request, fetch

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
    keep_alive: int = 0  # idle connections kept per origin (datasets.http_transport); 0: none


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


def _connect(addresses: list[Address], policy: HttpPolicy, exchange: Exchange) -> socket.socket:
    last: OSError | None = None
    for family, sockaddr in addresses:
        if exchange.was_cut or exchange.remaining_s() <= 0:
            break
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(min(policy.connect_timeout_s, exchange.remaining_s()))
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
    hop = _Hop(url, host, port, policy, cutoff, admit)
    try:
        answer = fetch(Exchange(cutoff.deadline, cut_at_deadline=True), _request(url, policy), hop)
        return answer.status, answer.location, answer.body
    except TooLarge as error:
        if error.declared is not None:
            too_large = f"{redact_url(url)} is {error.declared} bytes, over {policy.max_bytes}"
        else:
            too_large = f"{redact_url(url)} is over {policy.max_bytes} bytes"
        raise PermanentError(too_large, kind="too_large") from None
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


def _request(url: str, policy: HttpPolicy) -> Request:
    split = urlsplit(url)
    target = (split.path or "/") + (f"?{split.query}" if split.query else "")
    headers = {
        "Host": split.netloc.rpartition("@")[2],  # never send userinfo anywhere
        "User-Agent": _USER_AGENT,
        "Accept-Encoding": "identity",
    }
    if policy.keep_alive <= 0:
        headers["Connection"] = "close"
    return Request(
        "GET",
        target,
        headers,
        max_bytes=policy.max_bytes,
        read_timeout_s=policy.read_timeout_s,
        chunk_bytes=_CHUNK_BYTES,
    )


class _Hop:
    """One hop's way to its origin (a ``Route``): a kept connection under the same policy, or
    a new one to a checked address; only a whole 2xx answer's connection is kept."""

    def __init__(
        self, url: str, host: str, port: int, policy: HttpPolicy, cutoff: Cutoff, admit: Admit
    ) -> None:
        self._url, self._host, self._port = url, host, port
        self._scheme = urlsplit(url).scheme
        self._policy, self._cutoff, self._admit = policy, cutoff, admit
        self._origin = Origin(self._scheme, host.lower().rstrip("."), port, policy.allowed)

    def take(self) -> http.client.HTTPConnection | None:
        return http_transport.pool().take(self._origin) if self._policy.keep_alive > 0 else None

    def dial(self, exchange: Exchange) -> http.client.HTTPConnection:
        addresses = _resolve(self._url, self._host, self._port, self._policy, self._cutoff)
        return _open(addresses, self._host, self._port, self._scheme, self._policy, exchange)

    def wants_body(self, status: int) -> bool:
        return 200 <= status < 300  # a redirect or an error answer: closed, as the docs say

    def admit(self, size_bytes: int) -> None:
        self._admit(size_bytes, self._cutoff.remaining_s())

    def keeps(self, status: int) -> bool:
        return self._policy.keep_alive > 0 and 200 <= status < 300

    def give(self, conn: http.client.HTTPConnection) -> None:
        http_transport.pool().give(self._origin, conn, self._policy.keep_alive)


def _open(
    addresses: list[Address],
    host: str,
    port: int,
    scheme: str,
    policy: HttpPolicy,
    exchange: Exchange,
) -> http.client.HTTPConnection:
    """A new connection to a checked address (TLS handshake made under the deadline)."""
    connection = http.client.HTTPConnection(host, port, timeout=exchange.remaining_s())
    connection.auto_open = 0  # never a connection of its own, to an address nobody checked
    sock = _connect(addresses, policy, exchange)
    try:
        sock.settimeout(exchange.timeout_s(policy.read_timeout_s))
        connection.sock = sock
        exchange.hold(connection)
        if scheme == "https":
            sock = _tls_context().wrap_socket(
                sock, server_hostname=host, do_handshake_on_connect=False
            )
            connection.sock = sock
            exchange.hold(connection)  # raises when the plain socket was cut meanwhile
            sock.do_handshake()  # under the deadline too
    except BaseException:
        sock.close()
        raise
    return connection

"""How this process proves who it is to NATS: TLS (a CA, a client certificate), and one of a
creds file (user JWT + nkey), an nkey seed, a user with a password file, or a token file.

Secrets are read from files at connect time and handed to nats-py, never kept in settings,
written to a log line or put into an error: what may be shown is the setting's name. Knows
nothing of JetStream or torch.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from config.errors import ConfigError
from config.names import env_name
from config.settings import NatsSettings

_AUTHORIZATION = "authorization violation"


def connect_options(settings: NatsSettings) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect``: TLS and the credential the settings name."""
    try:
        return _options(settings)
    except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
        what = getattr(error, "strerror", None) or getattr(error, "reason", None) or error
        raise ConfigError(f"NATS credentials or TLS files cannot be used: {what}") from None


def _options(settings: NatsSettings) -> dict[str, Any]:
    options: dict[str, Any] = {}
    context = tls_context(settings)
    if context is not None:
        options["tls"] = context
    if settings.creds_file:
        options["user_credentials"] = settings.creds_file
    elif settings.nkey_seed_file:
        options["nkeys_seed"] = settings.nkey_seed_file
    elif settings.password_file:
        options["user"] = settings.user
        options["password"] = _secret(settings.password_file)
    elif settings.token_file:
        options["token"] = _secret(settings.token_file)
    return options


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    """A client context when a CA or a client certificate is set; None leaves nats-py's own
    (the system's CAs, SSL_CERT_FILE where set) for ``tls://`` servers."""
    if not (settings.tls_ca_file or settings.tls_cert_file):
        return None
    context = ssl.create_default_context(cafile=settings.tls_ca_file or None)
    if settings.tls_cert_file:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return context


def credential_setting(settings: NatsSettings) -> str:
    """The setting naming the credential this process offers (for messages), or ''."""
    for field in ("creds_file", "nkey_seed_file", "password_file", "token_file", "tls_cert_file"):
        if getattr(settings, field):
            return env_name("nats", field)
    if any(_has_userinfo(url) for url in settings.url.split(",")):
        return env_name("nats", "url")
    return ""


def _has_userinfo(url: str) -> bool:
    try:
        return bool(urlsplit(url.strip()).username)
    except ValueError:
        return False


def refusal(settings: NatsSettings, error: BaseException) -> str | None:
    """One line naming what the server refused (the credential's setting, or that none was
    given), or None when ``error`` is no refusal. Never the credential itself."""
    if isinstance(error, ssl.SSLError) and "alert" in str(error).lower():
        # The server's TLS alert: it would not take (or was not given) a client certificate.
        why = getattr(error, "reason", None) or "TLS alert"
        if settings.tls_cert_file:
            return (
                f"NATS refused the client certificate from {env_name('nats', 'tls_cert_file')} "
                f"({why})"
            )
        cert = env_name("nats", "tls_cert_file")
        return f"NATS asks for a client certificate ({why}); set {cert}"
    if _AUTHORIZATION not in str(error).lower() and type(error).__name__ != "AuthorizationError":
        return None
    setting = credential_setting(settings)
    if setting:
        return f"NATS refused the credentials from {setting} ({_AUTHORIZATION})"
    return (
        f"NATS asks for credentials and none were given ({_AUTHORIZATION}); set "
        f"{env_name('nats', 'creds_file')}, {env_name('nats', 'nkey_seed_file')}, "
        f"{env_name('nats', 'user')} with {env_name('nats', 'password_file')}, or "
        f"{env_name('nats', 'token_file')}"
    )


def _secret(path: str) -> str:
    """A password or token file's content, without the newline an editor leaves."""
    return Path(path).read_text(encoding="utf-8").strip()

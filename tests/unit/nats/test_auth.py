"""NATS credentials from files: one way at a time, pairs whole, files readable, secrets in no
message; the options handed to nats-py; what a refusal says."""

from __future__ import annotations

import ssl

import pytest

from config.errors import ConfigError
from config.settings import load_settings
from worker.nats.auth import connect_options, refusal


def nats_settings(**nats: str):
    return load_settings(for_worker=False, nats=nats).nats


def test_a_password_or_token_is_read_from_its_file_without_the_newline(tmp_path):
    (tmp_path / "pw").write_text("hunter2-pw\n")
    (tmp_path / "tok").write_text("tok-abc\n")
    options = connect_options(nats_settings(user="worker", password_file=str(tmp_path / "pw")))
    assert (options["user"], options["password"]) == ("worker", "hunter2-pw")
    assert connect_options(nats_settings(token_file=str(tmp_path / "tok")))["token"] == "tok-abc"
    assert connect_options(nats_settings()) == {}  # nothing set: nats-py's defaults


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"tls_cert_file": "F"}, "WORKER_NATS__TLS_CERT_FILE and WORKER_NATS__TLS_KEY_FILE go"),
        ({"user": "worker"}, "WORKER_NATS__USER and WORKER_NATS__PASSWORD_FILE go together"),
        (
            {"creds_file": "F", "token_file": "F"},
            "WORKER_NATS__CREDS_FILE and WORKER_NATS__TOKEN_FILE are set together",
        ),
        ({"nkey_seed_file": "/nonexistent/seed"}, "WORKER_NATS__NKEY_SEED_FILE='/nonexistent"),
    ],
)
def test_credential_settings_that_cannot_work_are_refused_naming_them(tmp_path, fields, said):
    secret = tmp_path / "secret"
    secret.write_text("SUAMYSECRETSEED\n")
    values = {k: str(secret) if v == "F" else v for k, v in fields.items()}
    with pytest.raises(ConfigError) as refused:
        nats_settings(**values)
    assert said in str(refused.value)
    assert "SUAMYSECRETSEED" not in str(refused.value)


def test_a_refusal_names_the_setting_never_the_secret(tmp_path):
    (tmp_path / "tok").write_text("tok-abc\n")
    settings = nats_settings(token_file=str(tmp_path / "tok"))
    said = refusal(settings, Exception("nats: 'Authorization Violation'"))
    assert (
        said
        == "NATS refused the credentials from WORKER_NATS__TOKEN_FILE (authorization violation)"
    )
    assert refusal(settings, OSError("connection refused")) is None
    in_url = nats_settings(url="nats://worker:pw-in-url@127.0.0.1:4222")
    said = refusal(in_url, Exception("nats: 'Authorization Violation'")) or ""
    assert "WORKER_NATS__URL" in said and "pw-in-url" not in said
    alert = ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca")
    assert "WORKER_NATS__TLS_CERT_FILE" in (refusal(nats_settings(), alert) or "")


def test_a_certificate_that_cannot_be_loaded_is_a_config_error_naming_no_content(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nSECRETKEYBYTES\n")
    settings = nats_settings(tls_cert_file=str(cert), tls_key_file=str(key))
    with pytest.raises(ConfigError) as refused:
        connect_options(settings)
    assert "SECRETKEYBYTES" not in str(refused.value)

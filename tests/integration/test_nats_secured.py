"""A NATS secured as operators run it (issue 32): mutual TLS, a creds file (operator, account
and user JWTs), an nkey seed, a user with a password file, a token file. Each against a real
nats-server configured for it: the commands and the worker work with the right credential;
`check` names a refused one in one line; no secret reaches any output."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import nkeys
import pytest

from tests.helpers import cli, upload_images, worker_env
from tests.nats_secured import ConfiguredNats, make_operator, make_pki, new_nkey, public, seed

pytestmark = pytest.mark.integration


@dataclass
class Secured:
    config: str  # the server's config block
    good: dict[str, str]  # the client's WORKER_NATS__* for the right credential
    bad: dict[str, str]  # for one the server refuses
    refusal: str  # what `check` says of the bad one
    secrets: list[str] = field(default_factory=list)  # must appear in no output


def _file(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def mutual_tls(d: Path) -> Secured:
    pki = make_pki(d / "pki")
    config = (
        f'tls {{ cert_file: "{pki.server_cert}", key_file: "{pki.server_key}", '
        f'ca_file: "{pki.ca}", verify: true }}'
    )
    client = {"WORKER_NATS__TLS_CA_FILE": str(pki.ca)}
    return Secured(
        config,
        {
            **client,
            "WORKER_NATS__TLS_CERT_FILE": str(pki.client_cert),
            "WORKER_NATS__TLS_KEY_FILE": str(pki.client_key),
        },
        {
            **client,
            "WORKER_NATS__TLS_CERT_FILE": str(pki.stranger_cert),
            "WORKER_NATS__TLS_KEY_FILE": str(pki.stranger_key),
        },
        "not ready: NATS refused the client certificate from WORKER_NATS__TLS_CERT_FILE",
        [pki.client_key.read_text().splitlines()[1], pki.stranger_key.read_text().splitlines()[1]],
    )


def creds_file(d: Path) -> Secured:
    operator = make_operator(d / "op")
    return Secured(
        operator.config,
        {"WORKER_NATS__CREDS_FILE": str(operator.creds)},
        {"WORKER_NATS__CREDS_FILE": str(operator.stranger_creds)},
        "not ready: NATS refused the credentials from WORKER_NATS__CREDS_FILE "
        "(authorization violation)",
        [operator.user_seed],
    )


def nkey_seed(d: Path) -> Secured:
    user, stranger = new_nkey(nkeys.PREFIX_BYTE_USER), new_nkey(nkeys.PREFIX_BYTE_USER)
    return Secured(
        f'authorization {{ users = [ {{ nkey: "{public(user)}" }} ] }}',
        {"WORKER_NATS__NKEY_SEED_FILE": _file(d / "user.nk", seed(user))},
        {"WORKER_NATS__NKEY_SEED_FILE": _file(d / "stranger.nk", seed(stranger))},
        "not ready: NATS refused the credentials from WORKER_NATS__NKEY_SEED_FILE "
        "(authorization violation)",
        [seed(user), seed(stranger)],
    )


def password_file(d: Path) -> Secured:
    return Secured(
        'authorization { users = [ { user: worker, password: "Correct-Horse-31" } ] }',
        {
            "WORKER_NATS__USER": "worker",
            "WORKER_NATS__PASSWORD_FILE": _file(d / "password", "Correct-Horse-31"),
        },
        {
            "WORKER_NATS__USER": "worker",
            "WORKER_NATS__PASSWORD_FILE": _file(d / "wrong", "Battery-Staple-77"),
        },
        "not ready: NATS refused the credentials from WORKER_NATS__PASSWORD_FILE "
        "(authorization violation)",
        ["Correct-Horse-31", "Battery-Staple-77"],
    )


def token_file(d: Path) -> Secured:
    return Secured(
        'authorization { token: "tok-9f2c6a1e" }',
        {"WORKER_NATS__TOKEN_FILE": _file(d / "token", "tok-9f2c6a1e")},
        {"WORKER_NATS__TOKEN_FILE": _file(d / "wrong", "tok-00000000")},
        "not ready: NATS refused the credentials from WORKER_NATS__TOKEN_FILE "
        "(authorization violation)",
        ["tok-9f2c6a1e", "tok-00000000"],
    )


KINDS = {
    "mutual_tls": mutual_tls,
    "creds_file": creds_file,
    "nkey_seed": nkey_seed,
    "password_file": password_file,
    "token_file": token_file,
}
SERVED_END_TO_END = {"mutual_tls", "creds_file"}  # the remote GPU host's usual two


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_secured_nats_works_with_its_credential_and_check_names_a_refused_one(
    kind, tmp_path, settings_for, s3_server, bucket
):
    secured = KINDS[kind](tmp_path)
    with ConfiguredNats(tmp_path, secured.config) as server:
        settings = settings_for(server.url)
        env = {**worker_env(settings), **secured.good}
        outputs = []
        # Given the right credential: provision, submit, then (for two kinds) a worker serves
        for args in (("provision",), ("submit", "--job", "job-sec", *_images(s3_server, bucket))):
            done = cli(*args, env=env)
            outputs.append(done.stdout + done.stderr)
            assert done.returncode == 0, f"{args}: {done.stderr[-2000:]}\n{server.log()[-2000:]}"
        if kind in SERVED_END_TO_END:
            served = cli("run", "--until-idle", env=env, timeout=120)
            outputs.append(served.stdout + served.stderr)
            assert served.returncode == 0, served.stderr[-3000:]
            shown = cli("results", "--job", "job-sec", env=env)
            outputs.append(shown.stdout + shown.stderr)
            assert "ok=2 error=0 missing=0" in shown.stderr, shown.stderr
        # When the server refuses the credential: `check` says which one, in one line
        refused = cli("check", env={**worker_env(settings), **secured.bad})
        outputs.append(refused.stdout + refused.stderr)
        assert refused.returncode == 1
        lines = [line for line in refused.stderr.splitlines() if "NATS" in line]
        assert len(lines) == 1 and lines[0].startswith(secured.refusal), refused.stderr
        assert "Traceback" not in refused.stderr
        # and a command that runs once says the same, at once, exit 1
        submit = cli("submit", "--job", "job-bad", "s3://b/k.jpg", env={**env, **secured.bad})
        outputs.append(submit.stdout + submit.stderr)
        assert submit.returncode == 1
        assert secured.refusal.removeprefix("not ready: ") in submit.stderr, submit.stderr
    # Then no secret appears in any output
    for secret in secured.secrets:
        assert all(secret not in out for out in outputs), f"{kind}: a secret was written"


def _images(s3_server, bucket: str) -> list[str]:
    return upload_images(s3_server.client(), bucket, 2, prefix="secured")


OPERATING = Path(__file__).parents[2] / "docs" / "operating.md"
DEFAULT_NAMES = {  # the names the docs' block is written for
    "WORKER_NATS__TASKS_STREAM": "INFERENCE_TASKS",
    "WORKER_NATS__RESULTS_STREAM": "INFERENCE_RESULTS",
    "WORKER_NATS__DEAD_LETTER_STREAM": "INFERENCE_DEAD_LETTER",
    "WORKER_NATS__ADVISORY_STREAM": "INFERENCE_ADVISORIES",
    "WORKER_NATS__CONSUMER": "inference-worker",
    "WORKER_NATS__RESULT_OBJECTS": "INFERENCE_RESULT_OBJECTS",
    "WORKER_NATS__ALGORITHMS": "INFERENCE_ALGORITHMS",
}


def docs_permissions(pipeline: str) -> str:
    """docs/operating.md's "NATS permissions" block, exactly, its ``P`` made ``pipeline``."""
    text = OPERATING.read_text()
    section = text[text.index("### NATS permissions") :]
    block = section[section.index("```\n") + 4 :]
    block = block[: block.index("```")]
    assert "authorization {" in block and '"tasks.P.*"' in block
    return block.replace('"tasks.P.*"', f'"tasks.{pipeline}.*"').replace(
        '"tasks.P"', f'"tasks.{pipeline}"'
    )


async def test_the_docs_permission_lists_let_worker_and_submitter_do_their_jobs(
    tmp_path, settings_for, s3_server, bucket
):
    settings = settings_for("nats://127.0.0.1:1")
    passwords = {"NATS_WORKER_PASSWORD": "w-5ecret-pw", "NATS_SUBMITTER_PASSWORD": "s-5ecret-pw"}
    worker_pw, submitter_pw = passwords.values()
    block = docs_permissions(settings.model.pipeline)
    with ConfiguredNats(tmp_path, block, env=passwords) as server:
        base = {**worker_env(settings), **DEFAULT_NAMES, "WORKER_NATS__URL": server.url}
        worker = {
            **base,
            "WORKER_NATS__USER": "worker",
            "WORKER_NATS__PASSWORD_FILE": _file(tmp_path / "w", worker_pw),
        }
        submitter = {
            **base,
            "WORKER_NATS__USER": "submitter",
            "WORKER_NATS__PASSWORD_FILE": _file(tmp_path / "s", submitter_pw),
        }
        uris = upload_images(s3_server.client(), bucket, 3, prefix="permitted")
        steps = [
            ("worker", worker, ("provision",)),
            ("submitter", submitter, ("submit", "--job", "job-perm", *uris)),
            ("worker", worker, ("run", "--until-idle")),
            ("submitter", submitter, ("results", "--job", "job-perm")),
            ("submitter", submitter, ("watch", "--job", "job-perm", "--timeout-s", "20")),
            ("worker", worker, ("check",)),
        ]
        said_by = {}
        for who, env, args in steps:
            done = cli(*args, env=env, timeout=120)
            said = said_by[args[0]] = done.stdout + done.stderr
            assert done.returncode == 0, f"{who} {args}: {said[-3000:]}\n{server.log()[-3000:]}"
        # Then every step was allowed all it needed, and the job was served
        assert "ok=3 error=0 missing=0" in said_by["results"], said_by["results"]
        assert "Violation" not in server.log(), server.log()[-3000:]  # nothing was refused
        # And the submitter may not forge a result: the server refuses the publish
        assert await _publish_refused(server.url, submitter_pw)
        assert 'Publish Violation - Subject "results.job-perm.x"' in server.log()
    assert all(pw not in out for pw in passwords.values() for out in said_by.values())


async def _publish_refused(url: str, password: str) -> bool:
    import asyncio

    import nats

    errors: list[Exception] = []

    async def on_error(error: Exception) -> None:
        errors.append(error)

    nc = await nats.connect(url, user="submitter", password=password, error_cb=on_error)
    try:
        await nc.publish("results.job-perm.x", b'{"status": "ok"}')
        await nc.flush()
        for _ in range(50):
            if errors:
                break
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
    return any("permissions violation" in str(e).lower() for e in errors)

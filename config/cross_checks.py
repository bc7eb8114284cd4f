"""The rules that span settings, each a small named function returning one line per broken
rule, naming the settings involved (by ``names.env_name``, the one place names are made).

``settings_problems`` runs them all at validation; ``memory_problems`` and ``worker_problems``
need what only a worker knows (the pipeline's largest image, weights on disk).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from config.derived import healthz_port, metrics_port
from config.model_cache import cache_root, own_problem
from config.names import env_name as n
from config.redact import redact_url

if TYPE_CHECKING:
    from config.settings import Settings

_HOST_ENTRY = re.compile(r"\[[0-9a-fA-F:.]+\](:\d{1,5})?|[^\s:\[\]/]+(:\d{1,5})?|[0-9a-fA-F:]+")
Rule = Callable[["Settings"], list[str]]

# Settings that only make sense above zero: (group, field).
_POSITIVE = (
    ("loader", "num_workers"),
    ("loader", "batch_size"),
    ("loader", "timeout_s"),
    ("loader", "prefetch_batches"),
    ("loader", "reads_per_worker"),
    ("loader", "read_bytes_per_worker"),
    ("nats", "ack_wait_s"),
    ("nats", "max_deliver"),
    ("nats", "fetch_timeout_s"),
    ("nats", "command_connect_timeout_s"),
    ("health", "stall_timeout_s"),
    ("model", "top_k"),
    ("s3", "max_attempts"),
    ("loader", "max_consecutive_failures"),
    ("sources", "max_bytes"),
    ("health", "disconnected_timeout_s"),
)


def positive_values(s: Settings) -> list[str]:
    problems = []
    for group, field in _POSITIVE:
        value = getattr(getattr(s, group), field)
        if value <= 0:
            problems.append(f"{n(group, field)}={value} must be greater than 0")
    return problems


def _shorter(s: Settings, a: tuple[str, str], b: tuple[str, str], why: str = "") -> list[str]:
    """``a`` must be shorter than ``b``; the line names both, with their values."""
    va, vb = getattr(getattr(s, a[0]), a[1]), getattr(getattr(s, b[0]), b[1])
    if va < vb:
        return []
    return [f"{n(*a)} ({va}) must be shorter than {n(*b)} ({vb}){why}"]


def loader_recovers_before_stall(s: Settings) -> list[str]:
    why = ", so a hung loader is recovered before the worker counts as stalled"
    return _shorter(s, ("loader", "timeout_s"), ("health", "stall_timeout_s"), why)


def stall_before_redelivery(s: Settings) -> list[str]:
    why = ", so a wedged worker is restarted before its tasks are redelivered"
    return _shorter(s, ("health", "stall_timeout_s"), ("nats", "ack_wait_s"), why)


def s3_retries_within_loader_timeout(s: Settings) -> list[str]:
    s3_worst_s = (s.s3.connect_timeout_s + s.s3.read_timeout_s) * s.s3.max_attempts
    if s3_worst_s < s.loader.timeout_s:
        return []
    return [
        f"{n('s3', 'connect_timeout_s')} + {n('s3', 'read_timeout_s')} times "
        f"{n('s3', 'max_attempts')} ({s3_worst_s:g}s) must be shorter than "
        f"{n('loader', 'timeout_s')} ({s.loader.timeout_s}), or a slow object looks like a hang"
    ]


def object_deadline_within_loader_timeout(s: Settings) -> list[str]:
    if s.sources.object_deadline_s < 0:
        return [f"{n('sources', 'object_deadline_s')} must be 0 (derived) or more"]
    why = ", or a slow object looks like a hung loader"
    return _shorter(s, ("sources", "object_deadline_s"), ("loader", "timeout_s"), why)


def sources_well_formed(s: Settings) -> list[str]:
    problems = []
    if s.sources.max_redirects < 0:
        problems.append(f"{n('sources', 'max_redirects')}={s.sources.max_redirects} must be >= 0")
    for entry in s.sources.hosts():
        if not _HOST_ENTRY.fullmatch(entry):
            problems.append(
                f"{n('sources', 'allowed_hosts')}: {entry!r} is not host, host:port or [v6]:port"
            )
    for root in s.sources.roots():
        if not root.startswith("/"):
            problems.append(f"{n('sources', 'file_roots')}: {root!r} is not an absolute path")
    return problems


def fetch_within_stall(s: Settings) -> list[str]:
    """The serving source's empty fetch ends within the stall timeout (Antenna's wait is its
    own setting: the NATS one tunes NATS only)."""
    fetch = ("antenna", "fetch_wait_s") if s.source == "antenna" else ("nats", "fetch_timeout_s")
    return _shorter(s, fetch, ("health", "stall_timeout_s"))


def watchdog_between_stall_and_redelivery(s: Settings) -> list[str]:
    watchdog_s = s.health.watchdog_timeout_s
    if not watchdog_s or s.health.stall_timeout_s < watchdog_s < s.nats.ack_wait_s:
        return []
    return [
        f"{n('health', 'watchdog_timeout_s')} ({watchdog_s}) must lie between "
        f"{n('health', 'stall_timeout_s')} ({s.health.stall_timeout_s}) and "
        f"{n('nats', 'ack_wait_s')} ({s.nats.ack_wait_s}), or 0 to turn it off"
    ]


# The longest of a drain's bounded waits past its timeout, each begun with a fresh watchdog
# window (worker/core/drain.py ``Drain.run``): the cancelled run's end (the settles'
# give-backs, ``CANCELLED_SETTLES_WAIT_S`` 6 s, and a second more); a give-back is 5 s
# (``GIVE_BACK_WAIT_S``). tests/unit/config/test_settings.py holds it to the code.
DRAIN_LONGEST_WAIT_S = 7.0


def drain_before_watchdog(s: Settings) -> list[str]:
    """A drain ends before the watchdog's window, which starts over at the stop and again as
    each bounded wait past the drain's timeout begins: a drain that is working, or waiting out
    a hung give-back, is never ended by the watchdog's thread dump and exit 1."""
    watchdog_s = s.health.watchdog_timeout_s
    if not watchdog_s:
        return []
    why = ", so a drain ends before the watchdog would end the process"
    problems = _shorter(s, ("health", "drain_timeout_s"), ("health", "watchdog_timeout_s"), why)
    if watchdog_s <= DRAIN_LONGEST_WAIT_S:
        problems.append(
            f"{n('health', 'watchdog_timeout_s')} ({watchdog_s}) must be longer than a drain's "
            f"longest bounded wait past its timeout ({DRAIN_LONGEST_WAIT_S:g}s: the cancelled "
            "run's give-backs, CANCELLED_SETTLES_WAIT_S, and a second), or 0 to turn it off"
        )
    return problems


def store_retry_within_ack_wait(s: Settings) -> list[str]:
    return _shorter(s, ("nats", "store_retry_s"), ("nats", "ack_wait_s"))


def drain_within_ack_wait(s: Settings) -> list[str]:
    return _shorter(s, ("health", "drain_timeout_s"), ("nats", "ack_wait_s"))


def metrics_port_is_a_port(s: Settings) -> list[str]:
    if 0 <= s.metrics.port <= 65535 and not (s.metrics.port and metrics_port(s) > 65535):
        return []
    return [
        f"{n('metrics', 'port')}={s.metrics.port} + {n('process_index')}={s.process_index} "
        "must be 0 (off) or a TCP port"
    ]


_ANTENNA_POSITIVE = (
    "poll_interval_s",
    "fetch_wait_s",
    "ttr_s",
    "max_post_bytes",
    "request_timeout_s",
    "post_timeout_s",
)


def antenna_source_usable(s: Settings) -> list[str]:
    """With ``WORKER_SOURCE=antenna``: a base URL, positive durations, full score vectors (a
    top-k vector does not index the category map, and Antenna drops such a result), and a
    drain and a reservation budget shorter than the reservation time."""
    if s.source != "antenna":
        return []
    a = s.antenna
    problems = [
        f"{n('antenna', name)}={getattr(a, name)} must be greater than 0"
        for name in _ANTENNA_POSITIVE
        if getattr(a, name) <= 0
    ]
    if not a.base_url.startswith(("http://", "https://")):
        problems.append(
            f"{n('source')}=antenna needs {n('antenna', 'base_url')} (or "
            "AMI_ANTENNA_API_BASE_URL): an http(s):// URL of Antenna's API, e.g. "
            "https://antenna.insectai.org/api/v2"
        )
    bad_ids = [p for p in a.project_ids.split(",") if p.strip() and not p.strip().isdigit()]
    if bad_ids:
        problems.append(
            f"{n('antenna', 'project_ids')}={a.project_ids!r}: {bad_ids[0].strip()!r} is not a "
            "project id (comma-separated integers)"
        )
    if s.model.scores != "all":
        problems.append(
            f"{n('source')}=antenna needs {n('model', 'scores')}=all: Antenna saves a "
            "classification only when its scores index the whole category map"
        )
    if problems:
        return problems
    problems += _shorter(s, ("health", "drain_timeout_s"), ("antenna", "ttr_s"))
    if a.finish_within_s:
        problems += _shorter(s, ("antenna", "finish_within_s"), ("antenna", "ttr_s"))
    return problems


def healthz_port_is_a_port(s: Settings) -> list[str]:
    if s.metrics.healthz_port >= 0 and healthz_port(s) <= 65535:
        return []
    return [
        f"{n('metrics', 'healthz_port')}={s.metrics.healthz_port} (0: {n('metrics', 'port')} + "
        f"1000) + {n('process_index')}={s.process_index} must be a TCP port"
    ]


def one_decode_path(s: Settings) -> list[str]:
    if s.loader.fast_decode and s.loader.exact_decode:
        return [
            f"{n('loader', 'fast_decode')} and {n('loader', 'exact_decode')} are both true; "
            "choose one (neither: the default, reduced-scale decode and torchvision's resize)"
        ]
    return []


_NATS_SECRETS = ("creds_file", "nkey_seed_file", "password_file", "token_file")
_NATS_FILES = ("tls_ca_file", "tls_cert_file", "tls_key_file", *_NATS_SECRETS)


def nats_credentials_usable(s: Settings) -> list[str]:
    """One way to authenticate, each half of a pair with its other half, every file readable.
    Names the settings, never what the files hold."""
    nats, problems = s.nats, []
    for a, b in (("tls_cert_file", "tls_key_file"), ("user", "password_file")):
        if bool(getattr(nats, a)) != bool(getattr(nats, b)):
            problems.append(f"{n('nats', a)} and {n('nats', b)} go together: set both or neither")
    chosen = [n("nats", name) for name in _NATS_SECRETS if getattr(nats, name)]
    if len(chosen) > 1:
        problems.append(f"{' and '.join(chosen)} are set together; give the server one credential")
    for name in _NATS_FILES:
        path = getattr(nats, name)
        if path and not _readable_file(path):
            problems.append(f"{n('nats', name)}={path!r} is not a file this process can read")
    return problems


def _readable_file(path: str) -> bool:
    try:
        with open(path, "rb"):
            return Path(path).is_file()
    except OSError:
        return False


RULES: tuple[Rule, ...] = (
    antenna_source_usable,
    one_decode_path,
    loader_recovers_before_stall,
    stall_before_redelivery,
    s3_retries_within_loader_timeout,
    object_deadline_within_loader_timeout,
    sources_well_formed,
    fetch_within_stall,
    watchdog_between_stall_and_redelivery,
    drain_before_watchdog,
    store_retry_within_ack_wait,
    drain_within_ack_wait,
    metrics_port_is_a_port,
    healthz_port_is_a_port,
    nats_credentials_usable,
)


def settings_problems(s: Settings) -> list[str]:
    """Every rule that spans fields, each broken rule as one line naming the fields. Values
    that must be positive are checked first: the other rules compare them."""
    problems = positive_values(s)
    if problems:
        return problems
    return [line for rule in RULES for line in rule(s)]


def memory_problems(s: Settings, image_bytes: int) -> list[str]:
    """The bytes cap must hold one batch of the largest images the pipeline can load."""
    one_batch = s.loader.batch_size * image_bytes
    if s.loader.max_inflight_bytes and s.loader.max_inflight_bytes < one_batch:
        return [
            f"{n('loader', 'max_inflight_bytes')} ({s.loader.max_inflight_bytes}) must hold at "
            f"least one batch: {n('loader', 'batch_size')} ({s.loader.batch_size}) x "
            f"{image_bytes} bytes = {one_batch}"
        ]
    return []


def worker_problems(s: Settings) -> list[str]:
    """What a worker process needs beyond a sound combination: weights it can load, when
    WORKER_MODEL__WEIGHTS is given (which pipelines need it is the pipeline registry's call),
    model-file hosts it may download from, and a model-file cache of its own."""
    problems = weights_problems(s.model.weights, n("model", "weights")) if s.model.weights else []
    problems += model_hosts_problems(s)
    refused = own_problem(cache_root(s.model.cache_dir, os.environ), os.geteuid())
    return problems + ([refused] if refused else [])


def model_hosts_problems(s: Settings) -> list[str]:
    """AMI's file hosts: one way to name them (a mirror, or the hosts in turn), and none at
    plain http:// off this host unless every file's sha256 is required (the one rule `run`,
    `check` and `models fetch` keep; a file's own URL is held to it as it is read)."""
    mirror, hosts = s.model.files_mirror, s.model.files_hosts
    problems = []
    if mirror and hosts:
        problems.append(
            f"{n('model', 'files_mirror')} and {n('model', 'files_hosts')} are both set: the "
            "mirror is used instead of the hosts; set one (a mirror tried first: put it first "
            f"in {n('model', 'files_hosts')})"
        )
    named = [("files_mirror", mirror)] if mirror else []
    named += [("files_hosts", host) for host in hosts]
    for field, url in named:
        if urlsplit(url).scheme == "http" and not loopback_url(url) and not s.model.require_digests:
            problems.append(
                f"{n('model', field)}={redact_url(url)!r}: plain http:// only to this host "
                "(anyone on the way could change the files, whose sha256s are not declared); "
                f"use https://, or set {n('model', 'require_digests')}=true with each file's "
                f"sha256 in {n('model', 'file_digests')}"
            )
    return problems


def loopback_url(uri: str) -> bool:
    """Whether ``uri``'s host is this host (``localhost`` or a loopback address)."""
    host = (urlsplit(uri).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def weights_problems(weights: str, where: str) -> list[str]:
    """Why ``weights`` (named ``where`` in the message) cannot be read; empty when it can.
    The value is written redacted: a presigned URL's signature is a credential."""
    shown = redact_url(weights)
    if not weights:
        return [f"{where} is not set; give a state_dict path, an https:// or s3:// URI"]
    if weights.startswith("s3://"):
        bucket, _, key = weights[len("s3://") :].partition("/")
        if not bucket or not key:
            return [f"{where}={shown!r} must be s3://bucket/key"]
        return []
    if weights.startswith(("https://", "http://")):
        return [] if urlsplit(weights).hostname else [f"{where}={shown!r} names no host"]
    if "://" in weights and not weights.startswith("file://"):
        return [f"{where}={shown!r}: only a local path, https:// or s3:// URI is allowed"]
    path = Path(weights.removeprefix("file://"))
    if not path.is_file():
        return [f"{where}={shown!r}: no such file"]
    return []

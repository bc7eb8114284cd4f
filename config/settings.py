"""The worker's settings: one pydantic-settings model, read from ``WORKER_*`` env vars.

Nothing here reads the environment at import; ``load_settings()`` is called once at start
and the resulting object is passed down to every layer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from config.cross_checks import settings_problems, worker_problems
from config.errors import ConfigError
from config.names import NESTED_DELIMITER, PREFIX, env_name
from config.redact import redact_url
from config.unknown import unknown_settings


class NatsSettings(BaseModel):
    url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated")
    # Credentials come from files (mounted secrets), never the environment or a log line.
    tls_ca_file: str = Field(
        "",
        description="PEM CA bundle the server's certificate is checked against; empty = the "
        "system's (SSL_CERT_FILE where set)",
    )
    tls_cert_file: str = Field(
        "", description="PEM client certificate for mutual TLS (with WORKER_NATS__TLS_KEY_FILE)"
    )
    tls_key_file: str = Field("", description="PEM private key of WORKER_NATS__TLS_CERT_FILE")
    creds_file: str = Field(
        "", description="NATS credentials file (user JWT + nkey seed), as decentralised auth has"
    )
    nkey_seed_file: str = Field("", description="file holding the user's nkey seed (`SU...`)")
    user: str = Field("", description="user name, with WORKER_NATS__PASSWORD_FILE")
    password_file: str = Field("", description="file holding the password of WORKER_NATS__USER")
    token_file: str = Field("", description="file holding the server's authorization token")
    tasks_stream: str = Field("INFERENCE_TASKS", description="stream holding tasks.>")
    results_stream: str = Field("INFERENCE_RESULTS", description="stream holding results.>")
    dead_letter_stream: str = Field(
        "INFERENCE_DEAD_LETTER", description="stream keeping dead letters"
    )
    dead_letter_subject: str = Field("dead.tasks", description="subject for unparseable tasks")
    advisory_stream: str = Field(
        "INFERENCE_ADVISORIES", description="keeps the consumer's max-deliveries advisories"
    )
    consumer: str = Field("inference-worker", description="durable pull consumer shared by workers")
    result_objects: str = Field(
        "INFERENCE_RESULT_OBJECTS",
        description="JetStream object store for responses too large for one message (kept as "
        "long as results)",
    )
    algorithms: str = Field(
        "INFERENCE_ALGORITHMS",
        description="JetStream object store, no expiry, for each algorithm's category map "
        "(docs/nats.md, Result)",
    )
    ack_wait_s: float = Field(300.0, description="JetStream ack wait of the consumer")
    max_deliver: int = Field(5, description="deliveries per task before it gives up")
    fetch_timeout_s: float = Field(1.0, description="expiry of one pull request")
    publish_timeout_s: float = Field(5.0, description="wait for the results stream's PubAck")
    command_connect_timeout_s: float = Field(
        15.0,
        description="submit, watch, results and provision give up (exit 1) when NATS cannot be "
        "reached within this; `run` keeps trying until stopped",
    )
    ping_interval_s: float = Field(
        5.0,
        description="the client pings its server this often, to find a connection that stopped "
        "answering with its socket still open (a hung server, a paused VM, a half-open path "
        "behind a NAT); costs one PING and PONG per interval per connection",
        gt=0,
    )
    max_outstanding_pings: int = Field(
        3,
        description="pings left unanswered before the connection counts as stale: it is "
        "dropped and the other servers the client knows (configured, or learned from the "
        "cluster) are tried; noticed within PING_INTERVAL_S x (MAX_OUTSTANDING_PINGS + 1)",
        ge=1,
    )
    store_retry_s: float = Field(
        30.0,
        description="keep retrying a result the results stream did not confirm for this long "
        "before giving the task back with nak",
    )
    nak_backoff_base_s: float = Field(2.0, description="first nak delay for transient failures")
    nak_backoff_max_s: float = Field(60.0, description="largest nak delay")
    tasks_max_age_s: float = Field(7 * 24 * 3600.0, description="how long task messages are kept")
    results_max_age_s: float = Field(30 * 24 * 3600.0, description="how long results are kept")
    replicas: int = Field(1, description="stream replicas (3 on a JetStream cluster)")
    fair_jobs: bool = Field(
        True,
        description="a durable consumer per job subject (tasks.<pipeline>.<job>), fetched in "
        "rotation, so a small job is not served after a big one (docs/nats.md, Fair share); false: "
        "one consumer for every served subject, in stream order",
    )
    job_discovery_s: float = Field(
        1.0,
        description="how often new jobs are looked for on the tasks stream's subjects (a job "
        "whose first task is heard of as it is published is looked for at once; docs/nats.md, Fair "
        "share across jobs)",
        gt=0,
    )
    job_discovery_idle_s: float = Field(
        10.0,
        description="the longest interval between an idle process's job discoveries: each "
        "discovery after which it is idle (no task fetched since the last, no new-jobs message in "
        "hand, its new-job hints subscribed) doubles the interval from JOB_DISCOVERY_S up to this; "
        "a task fetched brings it back at once; a new job is still served when its first task is "
        "heard of (docs/nats.md, Fair share across jobs)",
        gt=0,
    )
    job_consumer_inactive_s: float = Field(
        0.0,
        description="a backstop: the server deletes a job's consumer after no worker pulled "
        "from it for this long; 0 = WORKER_NATS__TASKS_MAX_AGE_S (the workers delete a "
        "finished job's consumer themselves: WORKER_NATS__JOB_CONSUMER_LINGER_S)",
        ge=0,
    )
    job_consumer_linger_s: float = Field(
        2.0,
        description="a job's consumer is deleted once it has had nothing pending and nothing "
        "awaiting an ack for this long (docs/nats.md, Fair share across jobs)",
        gt=0,
    )
    max_job_consumers: int = Field(
        256,
        description="job consumers that exist at once on the tasks stream, and at most half "
        "the server's per-stream consumer limit (the stream's or account's max_consumers, "
        "else 1,000); new jobs wait for room",
        ge=1,
    )
    # JetStream reserves a stream's max_bytes on its server's disk when the stream is made,
    # and refuses the stream when the reservations would not fit: the defaults stay small.
    tasks_max_bytes: int = Field(
        1024**3,
        ge=-1,
        description="most bytes the tasks stream keeps; when full, new tasks are refused "
        "(submit fails, nothing queued is dropped); -1 = no limit",
    )
    tasks_max_msgs: int = Field(
        -1, ge=-1, description="most tasks the tasks stream keeps, refused past it; -1 = no limit"
    )
    results_max_bytes: int = Field(
        -1,
        ge=-1,
        description="most bytes the results stream keeps; when full, new results are refused "
        "(the worker retries them, then gives the task back); -1 = no limit",
    )
    results_max_msgs: int = Field(
        -1, ge=-1, description="most results the results stream keeps; -1 = no limit"
    )
    dead_letter_max_bytes: int = Field(
        256 * 1024**2,
        ge=-1,
        description="most bytes the dead-letter stream keeps (the oldest letters go first); "
        "-1 = no limit",
    )
    advisory_max_bytes: int = Field(
        256 * 1024**2,
        ge=-1,
        description="most bytes the advisory stream keeps (the oldest go first); -1 = no limit",
    )

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, value: str) -> str:
        for url in value.split(","):
            if not url.strip().startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"expected nats://host:port, got {redact_url(url)!r}")
        return value


class S3Settings(BaseModel):
    endpoint_url: str | None = Field(None, description="S3 endpoint; unset means AWS")
    region: str = Field("us-east-1", description="region name for the S3 client")
    connect_timeout_s: float = Field(2.0, description="S3 connect timeout")
    read_timeout_s: float = Field(
        5.0,
        description="S3 stall time: a read that gets no byte for this long (first byte or body) "
        "is abandoned and made again at once on a new connection, within the object deadline "
        "and MAX_ATTEMPTS",
    )
    max_attempts: int = Field(
        3,
        description="attempts per object, S3 and http(s), retries included (stalls retry at "
        "once; throttling (429, 503 SlowDown) and server errors back off with jitter first)",
    )
    http_timeout_s: float = Field(
        5.0,
        description="http(s):// image URLs: stall time: a read that gets no byte for this long "
        "is abandoned and made again on a new connection (as for S3); also the connect timeout "
        "when shorter than CONNECT_TIMEOUT_S",
    )


class SourceSettings(BaseModel):
    """The source policy for task URIs: safe by default (docs/data-loading.md, "Source policy")."""

    file_roots: str = Field(
        "",
        description="comma-separated directories a file:// URI must resolve under (symlinks "
        "resolved, regular files only); empty refuses file://",
    )
    allowed_hosts: str = Field(
        "",
        description="comma-separated http(s) hosts (host, host:port, [v6]:port) allowed to "
        "resolve to loopback, private or link-local addresses; the host and port of "
        "WORKER_S3__ENDPOINT_URL always are",
    )
    max_bytes: int = Field(
        64 * 1024 * 1024, description="largest object read, enforced while reading, every scheme"
    )
    object_deadline_s: float = Field(
        0.0,
        description="one deadline for reading a whole object (connect, headers, body); "
        "0 = three quarters of WORKER_LOADER__TIMEOUT_S",
    )
    max_redirects: int = Field(5, description="http(s) redirects followed, each one re-checked")

    def roots(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.file_roots.split(",") if part.strip())

    def hosts(self) -> frozenset[str]:
        return frozenset(part.strip() for part in self.allowed_hosts.split(",") if part.strip())


class LoaderSettings(BaseModel):
    num_workers: int = Field(2, description="DataLoader worker processes (persist for the process)")
    batch_size: int = Field(16, description="most tasks per fetch and per forward pass")
    timeout_s: float = Field(60.0, description="DataLoader timeout: longest wait for one image")
    mp_context: Literal["forkserver", "spawn", "fork"] = Field(
        "forkserver", description="multiprocessing start method of the loader workers"
    )
    prefetch_batches: int = Field(
        2,
        description="batches of tasks held to load and run at once (a batch being settled takes "
        "no room: up to two batches are settled at once, so at most two batches more are held; "
        "up to the cap more when a pipeline's models cannot be loaded and all its waiting tasks "
        "get their error results at once)",
    )
    reads_per_worker: int = Field(
        8,
        description="object reads each loader child keeps in flight (reading, or read and "
        "waiting to be decoded), so S3's latency is hidden behind decoding",
    )
    read_bytes_per_worker: int = Field(
        128 * 1024 * 1024,
        description="encoded bytes each loader child holds for its reads in flight (a read "
        "waits for room once its size is known; one read always goes ahead)",
    )
    max_inflight_bytes: int = Field(
        0,
        description="cap on loaded image bytes held at once (tasks held x the largest image "
        "the pipeline's decode plan can make); 0 = batch_size x prefetch_batches",
    )
    max_side: int = Field(
        4096,
        description="pipelines with a detector, but those detecting at full size (AMI's): "
        "longest side of the image handed over (a larger source is decoded at a reduced scale; "
        "boxes are still reported in source pixels)",
        ge=64,
        le=16384,
    )
    max_pixels: int = Field(
        64_000_000,
        description="pipelines detecting at full size (AMI's): the largest image taken, in "
        "pixels (width x height), decoded whole as AMI's worker reads it; a larger one gets a "
        "too_large error result. The memory bound counts each image held at 3 bytes a pixel",
        ge=1_000_000,
        le=64_000_000,
    )
    device_decode: bool = Field(
        False,
        description="pipelines with a detector: loader children hand JPEGs over encoded and the "
        "engine decodes them on the GPU (nvJPEG); the CPU decodes them without CUDA, or when the "
        "device cannot",
    )
    fast_decode: bool = Field(
        False,
        description="classifier-only pipelines: JPEG decoded at a reduced scale down to about the "
        "input size, then PIL's resize (docs/data-loading.md, Preprocessing)",
    )
    exact_decode: bool = Field(
        False,
        description="classifier-only pipelines: the reference preprocessing, full decode then "
        "torchvision's resize; by default a JPEG is decoded at a reduced scale that leaves twice "
        "the input size, then resized by torchvision (docs/data-loading.md, Preprocessing)",
    )
    max_consecutive_failures: int = Field(
        3, description="loader timeouts/deaths in a row before the process exits (code 3)"
    )


class ModelSettings(BaseModel):
    pipeline: str = Field(
        "resnet18-classifier",
        description="a built-in pipeline name, a .toml file declaring one, module:attribute, or "
        "a name from an installed package's inference_worker.pipelines entry points",
    )
    pipelines: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="several pipelines served by one process, comma-separated (or a JSON list), "
        "each entry as WORKER_MODEL__PIPELINE takes it; when set, WORKER_MODEL__PIPELINE is "
        "not used",
    )
    weights: str = Field(
        "",
        description="built-in single-stage pipelines: state_dict (or .pt2) path, https:// or "
        "s3:// URI; labels.txt lies beside it",
    )
    cache_dir: str = Field(
        "",
        description="where downloaded model files (https://, s3://) are kept, shared by the "
        "host's processes, with the sha256 each is pinned to; empty: "
        "$XDG_CACHE_HOME/inference-worker/models, or ~/.cache/inference-worker/models",
    )
    file_max_bytes: int = Field(
        4 * 1024**3,
        description="largest model file downloaded (weights, labels); a bigger one is refused "
        "while it is read",
        ge=1,
    )
    download_deadline_s: float = Field(
        600.0,
        description="a model file's whole download, every attempt included (each attempt's "
        "connect and stall timeouts are WORKER_S3__CONNECT_TIMEOUT_S and "
        "WORKER_S3__HTTP_TIMEOUT_S, WORKER_S3__READ_TIMEOUT_S for s3://)",
        gt=0,
    )
    files_mirror: str = Field(
        "",
        description="AMI's pipelines (quebec_vermont_moths_2023 ...): a base URI (a path, "
        "file://, https://, s3://, or http:// to this host only: plain http:// elsewhere is "
        "refused at start) of the host's own copy of AMI's files, used instead of "
        "WORKER_MODEL__FILES_HOSTS; the files keep AMI's relative paths under it",
    )
    files_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="AMI's pipelines: the base URLs AMI's files are downloaded from, tried in "
        "order (comma-separated; a host answering 403, 404, 410 or not at all: the next); "
        "empty: AMI's current host "
        "https://object-arbutus.alliancecan.ca/swift/v1/AUTH_3c987b8fc90743469d42899b1fdb48eb/"
        "ami-models/, then the old https://object-arbutus.cloud.computecanada.ca/ami-models/; "
        "not with WORKER_MODEL__FILES_MIRROR",
    )
    published_digests: bool = Field(
        True,
        description="AMI's pipelines: the seven weights files whose size AMI's model cards "
        "publish are checked against it (a download or a cached file of another size is "
        "refused); false: no size is checked (test weights under AMI's names; see "
        "docs/model-files.md, Mirrors)",
    )
    file_digests: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="sha256s of model files the operator verified, as name=sha256 pairs, "
        "comma-separated (name: the file name, the last part of its URL, or its whole URL); a "
        "file named here is pinned as verified: a download or cached file with another sha256 "
        "is refused",
    )
    require_digests: bool = Field(
        False,
        description="strict: every downloaded model file (https://, s3://) needs its sha256 in "
        "WORKER_MODEL__FILE_DIGESTS (or declared in full by its pipeline); one without is "
        "refused before any download, a recorded first download is not enough",
    )
    memory_budget_bytes: int = Field(
        0,
        description="models kept loaded at once, in bytes of their weights (device memory on "
        "CUDA, host memory on the CPU); the least recently used idle pipeline is unloaded to "
        "make room; 0 = half the device's memory on CUDA, a quarter of the host's on the CPU",
        ge=0,
    )
    load_at_start: bool | None = Field(
        None,
        description="load every pipeline's models at start (as many as the budget holds; a "
        "failed load is then a config error) instead of on each pipeline's first task; unset = "
        "at start when one pipeline is served, on demand when several are",
    )
    idle_unload_s: float = Field(
        0.0,
        description="unload a pipeline's models after this many seconds without a batch; "
        "0 = only when another pipeline needs the room",
        ge=0,
    )
    load_retry_s: float = Field(
        30.0,
        description="a pipeline whose models cannot be loaded (its file host refuses, the cache "
        "cannot be written, over the memory budget, a broken file) is unavailable: its tasks are "
        "given back and none more taken, and its load is tried again in the background after "
        "this many seconds, then twice as long each time",
        gt=0,
    )
    load_retry_max_s: float = Field(
        600.0,
        description="the longest wait between two background loads of an unavailable pipeline",
        gt=0,
    )
    load_deadline_s: float = Field(
        900.0,
        description="the longest a pipeline's model load (its files' downloads and the build) "
        "may take: past it the pipeline is unavailable (reason load_timeout), its held tasks "
        "given back, its load tried again as WORKER_MODEL__LOAD_RETRY_S says; at start, the "
        "start fails (exit 1); a load still running at twice this asks for a restart (/livez "
        "503). 900 s: AMI's largest pipeline's files (about 760 MB) at 1 MB/s, and two minutes "
        "to build",
        gt=0,
    )
    hold_per_load: float = Field(
        4.0,
        description="after a pipeline's models load, pipelines whose models are not loaded wait "
        "until it has had the engine for this many times its load time (at most 30 s) or has "
        "no task left: loading then takes at most 1/(1+N) of the time when jobs of more "
        "pipelines than the budget holds interleave; 0 = switch whenever the fair share says",
        ge=0,
    )
    device: str = Field(
        "auto",
        description="auto, cpu, cuda, cuda:N, or a GPU/MIG UUID; a comma-separated list gives "
        "process WORKER_PROCESS_INDEX the entry at that index (modulo its length)",
    )
    scores: Literal["all", "top_k"] = Field(
        "all", description="each classification's scores: the full softmax vector, or the top k"
    )
    top_k: int = Field(5, description="scores per classification when SCORES=top_k", ge=1)
    labels_inline_max: int = Field(
        100,
        description="class lists up to this long are written in every classification; longer "
        "ones are published once per algorithm (docs/nats.md, Result)",
        ge=0,
    )
    precision: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="the forward passes' precision: float32, or autocast to bfloat16 or float16 "
        "(docs/gpu.md: how often labels change)",
    )
    detector_batch_size: int = Field(4, description="images per detector forward pass", ge=1)
    crop_batch_size: int = Field(64, description="crops per classifier forward pass", ge=1)
    keep_freed_memory: bool = Field(
        True,
        description="in a CPU process (device cpu, or auto without an NVIDIA driver; not with "
        "forked loader children), the C allocator (glibc) keeps the memory the forward passes "
        "free for the next ones (one arena, no mapped chunks, trim past 2 GiB) instead of "
        "handing each large activation back to the kernel to fault it in again; resident memory "
        "stays near its peak between jobs; false = glibc's defaults; logged (allocator)",
    )
    torch_threads: int = Field(
        0,
        description="intra-op threads for the forward pass; 0 = chosen at start from the cores "
        "this process may use (its CPU affinity, and its cgroup's CPU quota): every core when a "
        "served pipeline has a detector (decoding is a few per cent of its forward pass), else "
        "the cores the loader children leave (at least 1); logged (torch_threads)",
    )

    @field_validator("files_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("file_digests", mode="before")
    @classmethod
    def _digest_pairs(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        pairs = {}
        for part in (p.strip() for p in value.split(",") if p.strip()):
            name, _, digest = part.rpartition("=")  # a URI's query may hold "="
            digest = digest.strip().lower().removeprefix("sha256:")
            if not name.strip() or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
                raise ValueError(f"{name.strip()!r}: give name=<64 hex digits>")
            pairs[name.strip()] = digest
        return pairs

    @field_validator("pipelines", mode="before")
    @classmethod
    def _pipeline_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                import json

                try:
                    return json.loads(text)
                except ValueError as error:
                    raise ValueError(f"not a JSON list: {error}") from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    def pipeline_entries(self) -> list[str]:
        """The pipelines this process serves, as given: WORKER_MODEL__PIPELINES when set,
        else WORKER_MODEL__PIPELINE alone."""
        return list(self.pipelines) if self.pipelines else [self.pipeline]

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        for entry in (part.strip() for part in value.split(",")):
            if entry.startswith(("MIG-", "GPU-")):
                continue
            head, _, index = entry.partition(":")
            if head not in ("auto", "cpu", "cuda") or (
                index and (head != "cuda" or not index.isdigit())
            ):
                raise ValueError(f"expected auto, cpu, cuda, cuda:N or GPU/MIG UUID, not {entry!r}")
        return value


class HealthSettings(BaseModel):
    stall_timeout_s: float = Field(
        120.0,
        description="held work and no progress (a batch, or a forward pass of one) for this "
        "long = stalled",
    )
    drain_timeout_s: float = Field(
        30.0,
        description="SIGTERM: time to finish or give back work; shorter than "
        "WORKER_HEALTH__WATCHDOG_TIMEOUT_S (when on)",
    )
    disconnected_timeout_s: float = Field(
        60.0,
        description="NATS connection lost, or JetStream answering none of its requests over it "
        "(a cluster that lost its quorum), for this long: /readyz and /healthz answer 503, "
        "/livez stays 200 (a connection closed for good ends the process with code 5 at once)",
    )
    watchdog_timeout_s: float = Field(
        180.0,
        description="held work and no progress (a batch, or a forward pass of one) for this "
        "long: dump every thread's stack and exit 1, even if the main thread is stuck in C code "
        "or holding the GIL; 0 turns it off",
    )
    warm_pass: bool = Field(
        True,
        description="at start, time a warm forward pass of each stage of the pipelines loaded "
        "then, on one synthetic input, and refuse (exit 2) a detector or crop batch size whose "
        "pass, 4 times over, does not fit the stall timeout, or a batch size whose batch does "
        "not fit the ack wait (Antenna: its TTR); false skips it",
    )


class MetricsSettings(BaseModel):
    port: int = Field(
        9464,
        description="port of process 0 for /metrics and the probes (/livez, /readyz, /healthz); "
        "process N listens on this "
        "+ N (WORKER_PROCESS_INDEX); 0 turns it off (and the healthwatch listener with it)",
    )
    host: str = Field(
        "127.0.0.1",
        description="address the /metrics listener binds (0.0.0.0 or an interface's address "
        "for a Prometheus on another host); healthwatch never uses it",
    )
    healthz_port: int = Field(
        0,
        description="port of process 0 for the probes' listener healthwatch asks (/livez): "
        "loopback only, connection slots of its own; process N listens on this + N; 0 = "
        "WORKER_METRICS__PORT + 1000",
    )
    tasks_waiting_read_s: float = Field(
        30.0,
        description="how often each process reads how many tasks wait for its pipelines "
        "(inference_worker_tasks_waiting: NATS consumer info, Antenna's job listing); 0 "
        "turns the read off (docs/metrics.md, Tasks waiting)",
        ge=0,
    )


class GuardSettings(BaseModel):
    """Resource guards: crossing one drains the worker and exits 4 for a fresh process."""

    max_tree_rss_bytes: int = Field(
        0, description="resident memory of main + loader children + forkserver; 0 = off"
    )
    max_open_fds: int = Field(0, description="open descriptors of any one process; 0 = off")
    check_interval_s: float = Field(5.0, description="how often the guards are read")


class AntennaSettings(BaseModel):
    """Antenna's HTTP task API as the task source (``WORKER_SOURCE=antenna``; docs/antenna.md)."""

    base_url: str = Field(
        "",
        description="Antenna's API root, e.g. https://antenna.insectai.org/api/v2 (a URL without "
        "/api/ gets /api/v2 added); alias AMI_ANTENNA_API_BASE_URL",
    )
    token: SecretStr = Field(
        SecretStr(""),
        description="API token (sent as `Authorization: <AUTH_SCHEME> ...`, never logged); "
        "alias AMI_ANTENNA_API_AUTH_TOKEN",
    )
    auth_scheme: Literal["Token", "Api-Key"] = Field(
        "Token",
        description="the Authorization scheme the token is sent with: Token (a user's API "
        "token, what Antenna's main authenticates) or Api-Key (a processing service's key, "
        "where an Antenna takes them)",
    )
    project_ids: str = Field(
        "",
        description="comma-separated project ids: `register` registers the pipelines in each, "
        "`check` checks them, and `run` serves only these projects' jobs; empty: `run` serves "
        "every project's jobs the token lists",
    )
    service_name: str = Field(
        "inference-worker",
        description="processing service name given to `register`; alias AMI_ANTENNA_SERVICE_NAME",
    )
    poll_interval_s: float = Field(
        5.0,
        description="how often the active jobs are listed; an empty job is asked again at the "
        "next poll, then twice as late each time, up to 12 polls",
    )
    fetch_wait_s: float = Field(
        1.0,
        description="how long a fetch that reserves nothing waits before the worker asks again "
        "(the NATS source's is WORKER_NATS__FETCH_TIMEOUT_S)",
    )
    reservation_size: int = Field(
        0,
        description="most tasks asked for in one reservation; 0 = WORKER_LOADER__BATCH_SIZE; "
        "alias AMI_ANTENNA_API_BATCH_SIZE",
        ge=0,
    )
    ttr_s: float = Field(
        300.0,
        description="Antenna's reservation time (its NATS_TASK_TTR): a task not "
        "answered within it is delivered again",
    )
    finish_within_s: float = Field(
        0.0,
        description="reserve only what the measured rate finishes and posts within this long of "
        "its reservation; 0 = half of TTR_S",
    )
    max_deliver: int = Field(
        2, description="deliveries Antenna makes of a task (its consumer's max_deliver)", ge=1
    )
    max_post_bytes: int = Field(
        32 * 1024 * 1024,
        description="largest body of one POST .../result/ (results are split to stay under it; "
        "docs/antenna.md: results over the cap)",
    )
    jobs_limit: int = Field(
        100, description="jobs per page of the active jobs' listing (every page is read)", ge=1
    )
    request_timeout_s: float = Field(30.0, description="one jobs, tasks or register call")
    idle_wait_s: float = Field(
        0.0,
        description="`run --until-idle`: how long the active jobs may give no task while listed "
        "(their tasks out with another process, or left by one that died, until Antenna "
        "redelivers them after TTR_S) before the run ends NOT_SERVED (6) naming them; "
        "0 = TTR_S + 13 poll intervals",
        ge=0,
    )
    post_timeout_s: float = Field(120.0, description="one POST .../result/ call")
    unreachable_wait_s: float = Field(
        120.0,
        description="`run --until-idle`: how long every listing of the jobs may find Antenna "
        "unavailable (no answer, or 5xx: a restart) before the run takes it as idle and ends "
        "NOT_SERVED (6); meanwhile the listing is tried again after POLL_INTERVAL_S, then twice "
        "as late each time, up to 4 intervals; 0 = at the first failed listing. With tasks "
        "held, once every call has failed as long (they are left to redelivery); and for a "
        "listed job whose own page cannot be read",
        ge=0,
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        env_nested_delimiter=NESTED_DELIMITER,
        env_file=".env",
        extra="ignore",
    )

    nats: NatsSettings = Field(default_factory=NatsSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    sources: SourceSettings = Field(default_factory=SourceSettings)
    loader: LoaderSettings = Field(default_factory=LoaderSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    guards: GuardSettings = Field(default_factory=GuardSettings)
    antenna: AntennaSettings = Field(default_factory=AntennaSettings)
    source: Literal["nats", "antenna"] = Field(
        "nats", description="where tasks come from: this worker's NATS streams, or Antenna's API"
    )
    _aliases_used: tuple[str, ...] = PrivateAttr(default=())
    process_index: int = Field(
        0,
        ge=0,
        description="this process's number among its siblings (supervisord's process_num)",
    )
    run_dir: str = Field(
        "",
        description="where each process keeps its temporary files, under process-<index>; "
        "empty: <system temp dir>/inference-worker",
    )

    @model_validator(mode="after")
    def _fits_together(self) -> Settings:
        problems = settings_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _format_validation_error(error: ValidationError) -> str:
    lines: list[str] = []
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        message = str(item["msg"]).removeprefix("Value error, ")
        if loc:
            lines.append(f"{env_name(*loc)}: {message}")
        else:
            lines.extend(message.splitlines())
    return "\n".join(lines)


def aliases_used(s: Settings) -> tuple[str, ...]:
    """Which of AMI's names (``AMI_ANTENNA_API_*``, ``AMI_NUM_WORKERS``) gave a setting."""
    return s._aliases_used


def load_settings(*, for_worker: bool = True, **overrides: object) -> Settings:
    """Read and validate settings once; raise ConfigError with one line per problem (a
    ``WORKER_*`` name in the environment or ``.env`` that is no setting is one). AMI's names for
    our settings are read as aliases (``config/aliases.py``; ours win).

    ``for_worker=False`` serves client commands (submit, results, provision), which need no
    model weights.
    """
    from config.aliases import alias_overrides, read_env_file

    unknown = unknown_settings(Settings, os.environ, Path(str(Settings.model_config["env_file"])))
    if unknown:
        raise ConfigError("\n".join(unknown))
    aliased, used = alias_overrides(os.environ, read_env_file())
    merged: dict[str, object] = {**aliased}
    for group, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(group), dict):
            merged[group] = {**merged[group], **value}  # type: ignore[dict-item]
        else:
            merged[group] = value
    try:
        settings = Settings(**merged)  # type: ignore[arg-type]
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None
    settings._aliases_used = used
    if for_worker:
        problems = worker_problems(settings)
        if problems:
            raise ConfigError("\n".join(problems))
    return settings

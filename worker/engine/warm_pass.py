"""The warm pass: at start, each stage of each pipeline loaded then runs one synthetic input
of a realistic size three times (a warm-up, then the fastest of two timed), and settings that
the time seen does not fit are refused (ConfigError: exit 2), naming them and the value that
would fit.

Liveness counts progress per forward pass (``Runner.progress``: a detector chunk of
``WORKER_MODEL__DETECTOR_BATCH_SIZE`` images, a classifier chunk of
``WORKER_MODEL__CROP_BATCH_SIZE`` crops), so the longest time with no progress is one such
pass: it must fit the stall timeout (and so the watchdog's window, which is longer), and a whole
batch of ``WORKER_LOADER__BATCH_SIZE`` images must fit the time before the source delivers its
tasks again (the ack wait, or Antenna's reservation), since held tasks are kept alive only
after a batch. Settings the time seen does not fit are refused; those it fits but not with a
margin of ``MARGIN`` (a warm pass is one sample, on a host that may be busier later: a loaded
2-core CPU host ran AMI's detector 3.6 times slower than idle) are said in a ``warm_pass_tight``
warning, not refused: a start on a host busy for the moment (CI's, or processes starting side by
side) would refuse, and restart into, settings that fit it (AMI's defaults on a busy 2-core
host measured a crop pass of 64 at 43 s: fits 120 s, not 4 times over).

Refused, not adjusted: a batch size lowered by the worker itself would differ from process to
process and from start to start of one host, unseen, with the throughput and memory it sets;
the refusal says what fits, and the operator sets it once (docs/operating.md, "The timing
budget").
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from config.errors import ConfigError
from config.names import env_name as n
from config.settings import Settings

log = structlog.get_logger(__name__)

MARGIN = 4.0  # the time seen, times this, must fit: see the module's doc
SIDE = 4096  # a detector's synthetic image: 4096 x 3072 (a trap camera's), within max_side


@dataclass(frozen=True)
class StageTime:
    """One stage's warm forward pass of one input, and how many inputs one pass takes."""

    pipeline: str
    stage: str  # detector | filter | classifier
    per_input_s: float
    chunk: int
    first: bool  # the stage every image of a batch goes through (crops vary with detections)

    @property
    def setting(self) -> str:
        return n("model", "detector_batch_size" if self.stage == "detector" else "crop_batch_size")


def measure(pipeline: str, runner: Any) -> list[StageTime]:
    """Each stage of ``runner`` (a ``pipelines.runner.Runner``), timed on one synthetic input
    after a warm-up of the same. On the caller's thread; the results are back on the host
    before each timing ends."""
    import torch

    limits = runner.limits
    times: list[StageTime] = []
    generator = torch.Generator().manual_seed(0)
    if runner.detector is not None:
        image = _noise((3, SIDE * 3 // 4, SIDE), generator)
        side = min(SIDE, limits.max_side)
        if side < SIDE:
            image = image[:, : side * 3 // 4, :side].contiguous()
        seconds = _timed(lambda: runner.detector.detect([image]))
        times.append(StageTime(pipeline, "detector", seconds, limits.detector_batch, True))
    for stage in ("filter", "classifier"):
        model = getattr(runner, stage)
        if model is None:
            continue
        size = model.stage.preprocess.size
        crop = _noise((1, 3, size, size), generator)
        seconds = _timed(functools.partial(model.logits, crop))
        first = runner.detector is None and stage == "classifier"
        times.append(StageTime(pipeline, stage, seconds, limits.crop_batch, first))
    return times


def _noise(shape: tuple[int, ...], generator: Any) -> Any:
    import torch

    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _timed(call: Callable[[], Any], timed: int = 2) -> float:
    """The fastest of ``timed`` runs after a warm-up: a host busy for a moment (another
    process starting beside this one) does not refuse settings that fit it."""
    call()  # the warm-up: lazy initialisation, allocator, kernels chosen
    best_s = float("inf")
    for _ in range(timed):
        started = time.perf_counter()
        call()
        best_s = min(best_s, time.perf_counter() - started)
    return best_s


def redelivery(s: Settings) -> tuple[str, float]:
    """The setting after which the source delivers a held task again, and its value."""
    if s.source == "antenna":
        return n("antenna", "ttr_s"), s.antenna.ttr_s
    return n("nats", "ack_wait_s"), s.nats.ack_wait_s


def problems(times: Sequence[StageTime], s: Settings, margin: float = MARGIN) -> list[str]:
    """One line per setting the warm pass's times, ``margin`` times over, do not fit (empty:
    they all fit)."""
    over = "that" if margin == 1 else f"{margin:g} times that"
    found: list[str] = []
    stall_s, watchdog_s = s.health.stall_timeout_s, s.health.watchdog_timeout_s
    budgets = f"{n('health', 'stall_timeout_s')} ({stall_s:g}s)"
    if watchdog_s:
        budgets += f" and {n('health', 'watchdog_timeout_s')} ({watchdog_s:g}s)"
    for t in times:
        pass_s = t.per_input_s * t.chunk
        if pass_s * margin < stall_s:
            continue
        fits = math.floor(stall_s / (margin * t.per_input_s)) if t.per_input_s > 0 else t.chunk
        remedy = f"set {t.setting} to {fits} or less" if fits >= 1 else "use a faster device"
        found.append(
            f"pipeline {t.pipeline!r}: one {t.stage} forward pass of {t.setting}={t.chunk} "
            f"is expected to take {pass_s:.1f}s on this host ({t.per_input_s:.2f}s per input "
            f"in a warm pass); {over} does not fit {budgets}, which count "
            f"progress per forward pass: {remedy}, or raise them"
        )
    name, redeliver_s = redelivery(s)
    batch = s.loader.batch_size
    for t in times:
        batch_s = t.per_input_s * batch
        if not t.first or batch_s * margin < redeliver_s:
            continue
        fits = math.floor(redeliver_s / (margin * t.per_input_s))
        remedy = f"set {n('loader', 'batch_size')} to {fits} or less" if fits >= 1 else ""
        found.append(
            f"pipeline {t.pipeline!r}: a batch of {n('loader', 'batch_size')}={batch} is "
            f"expected to take {batch_s:.0f}s on this host ({t.per_input_s:.2f}s per image "
            f"in a warm pass of its {t.stage}); {over} does not fit {name} "
            f"({redeliver_s:g}s), after which its tasks are delivered again while it runs: "
            f"{remedy + ', or ' if remedy else ''}raise {name}"
        )
    return found


async def check(s: Settings, runners: dict[str, Any]) -> list[StageTime]:
    """Measure each of ``runners`` (pipeline name: loaded runner) on a daemon thread of its
    own and refuse (ConfigError) settings they do not fit. A pipeline whose warm pass has not
    ended within the stall timeout is refused as well: one input alone takes longer than any
    forward pass may (its thread is left behind; the process exits)."""
    from worker.core.threads import in_daemon_thread

    times: list[StageTime] = []
    for name, runner in runners.items():
        try:
            measured = await asyncio.wait_for(
                in_daemon_thread(measure, name, runner), s.health.stall_timeout_s
            )
        except TimeoutError:
            raise ConfigError(
                f"pipeline {name!r}: its warm pass (one synthetic input per stage, three "
                f"times) did not end within {n('health', 'stall_timeout_s')} "
                f"({s.health.stall_timeout_s:g}s) on this host: no forward pass could fit it; "
                f"use a faster device, or raise {n('health', 'stall_timeout_s')} and "
                f"{n('health', 'watchdog_timeout_s')}"
            ) from None
        times += measured
    log.info(
        "warm_pass",
        margin=MARGIN,
        stages=[
            {"pipeline": t.pipeline, "stage": t.stage, "per_input_s": round(t.per_input_s, 4)}
            for t in times
        ],
    )
    for line in problems(times, s):  # fits as measured, not with the margin: said, not refused
        log.warning("warm_pass_tight", problem=line)
    found = problems(times, s, margin=1.0)
    if found:
        raise ConfigError("\n".join(found))
    return times

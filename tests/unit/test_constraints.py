"""constraints.txt (the exact versions ``make`` installs) and pyproject.toml (the ranges the
code supports) agree: every dependency ``make test`` installs has one pin, inside its range.
A range raised without a new pin, or a dependency added without one, would leave ``make`` to
resolve versions nobody ran."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).parents[2]


def pins() -> dict[str, Version]:
    """constraints.txt's ``name==version`` lines, by canonical name."""
    found: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt: {line!r} is not an exact pin"
        assert canonicalize_name(name) not in found, f"constraints.txt pins {name} twice"
        found[canonicalize_name(name)] = Version(version)
    return found


def test_every_dependency_make_test_installs_is_pinned_inside_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    pinned = pins()
    wrong = []
    for text in requirements:
        requirement = Requirement(text)
        version = pinned.get(canonicalize_name(requirement.name))
        if version is None:
            wrong.append(f"{requirement.name}: not pinned")
        elif not requirement.specifier.contains(version, prereleases=True):
            wrong.append(f"{requirement.name}: pinned {version}, outside {requirement.specifier}")
    assert wrong == []


def test_the_ranges_admit_a_host_torch_older_than_the_pins():
    """A GPU host's torch (the field ran 2.10.0+cu128) satisfies the package: ``pip install``
    keeps it instead of replacing it with the pinned wheel."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(text) for text in project["dependencies"]]
    ranges = {requirement.name: requirement.specifier for requirement in requirements}
    assert ranges["torch"].contains(Version("2.10.0+cu128"))
    assert ranges["torchvision"].contains(Version("0.25.0+cu128"))
    assert not ranges["torch"].contains(Version("3.0.0"))

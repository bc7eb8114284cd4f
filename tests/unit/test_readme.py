"""The docs document every setting, so operators never have to read the code; and every link
in README.md and docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from config.settings import Settings

ROOT = Path(__file__).parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"
LINKED = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "BENCHMARKS.md"]
LINKED += sorted((ROOT / "docs").glob("*.md"))


def _setting_rows() -> list[str]:
    """The variables of docs/configuration.md's settings tables: each row's first cell."""
    return re.findall(r"^\| `(WORKER_[A-Z0-9_]+)` \|", CONFIGURATION.read_text(), re.M)


def test_every_setting_has_a_row_in_the_configuration_table():
    rows = set(_setting_rows())
    for group, field in Settings.model_fields.items():
        nested = getattr(field.default_factory, "model_fields", None)
        if nested is None:
            assert f"WORKER_{group.upper()}" in rows, f"WORKER_{group.upper()} has no row"
            continue
        for name in nested:
            variable = f"WORKER_{group.upper()}__{name.upper()}"
            assert variable in rows, f"{variable} has no row in docs/configuration.md"


def test_each_setting_has_one_row_and_no_test_hook_has_one():
    """The operators' tables: the settings an operator sets first, the rest by room, none twice;
    the tests' fault hooks (``config/faults.py``) are no setting of theirs."""
    rows = _setting_rows()
    assert len(rows) == len(set(rows)), "a setting has two rows"
    assert not [row for row in rows if row.startswith("WORKER_FAULTS")]
    text = CONFIGURATION.read_text()
    lead = text.index("### The settings an operator sets")
    rest = text.index("### Every other setting, by room")
    assert lead < rest
    assert 10 <= len(re.findall(r"^\| `WORKER_", text[lead:rest], re.M)) <= 15


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


def test_every_relative_link_in_the_docs_points_at_an_existing_file_and_heading():
    broken = []
    for doc in LINKED:
        for target in _relative_links(doc):
            file_part, _, anchor = target.partition("#")
            linked = (doc.parent / file_part).resolve() if file_part else doc
            if not linked.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_stays_short_and_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "make demo   #" in readme and "make test   #" in readme

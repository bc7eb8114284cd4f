"""docs/operating.md's table of exit codes is the one in ``worker/core/exits.py``: every command's
codes, no more and no fewer, so an operator's script can trust what the docs say."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from worker.core.exits import ExitReason, documented, forced_exit_code

OPERATING = Path(__file__).parents[3] / "docs" / "operating.md"


def docs_exit_codes() -> dict[str, set[int]]:
    """{command: codes} from the rows of docs/operating.md's "### Exit codes" table."""
    text = OPERATING.read_text()
    section = text[text.index("### Exit codes\n") :]
    table_text = section[section.index("\n|") : section.index("\n\n", section.index("\n|"))]
    rows = [line for line in table_text.splitlines() if line.startswith("| `")]
    assert rows, "the exit-code table has no rows"
    table: dict[str, set[int]] = {}
    for row in rows:
        commands, codes, _meaning = (cell.strip() for cell in row.strip("|").split("|", 2))
        for command in commands.split(","):
            for code in codes.split(","):
                table.setdefault(command.strip().strip("`"), set()).add(int(code))
    return table


def test_the_docs_list_exactly_the_exit_codes_each_command_defines():
    assert docs_exit_codes() == documented()


def test_every_command_of_the_cli_has_its_exit_codes_listed():
    from worker.commands.cli import _parser

    (choices,) = re.findall(r"\{([a-z,]+)\}", _parser().format_usage())
    commands = set(choices.split(","))
    listed = {name.split()[0] for name in documented()}  # "models fetch": the command "models"
    assert "run" in commands and commands <= listed


def test_the_second_signal_codes_are_the_shells_and_no_run_reason_collides_with_them():
    assert forced_exit_code(signal.SIGTERM) == 143 and forced_exit_code(signal.SIGINT) == 130
    assert {r.code for r in ExitReason}.isdisjoint({130, 143})

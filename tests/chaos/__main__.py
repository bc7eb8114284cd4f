"""python -m tests.chaos [name ...]: run the chaos scenarios and print the table."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

from tests.chaos.suite import run_scenario, scenarios, table
from worker.commands.localservers import S3Server


async def main(names: list[str]) -> int:
    from pipelines.models import save_classifier

    root = Path(tempfile.mkdtemp(prefix="iw-chaos-"))
    s3 = S3Server().start()
    os.environ.update(s3.credentials_env())
    weights = save_classifier("mobilenet_v3_small", ["a", "b", "c"], str(root / "model"))
    rows, leftovers = [], []
    try:
        for scenario in scenarios(root):
            if names and scenario.name not in names:
                continue
            print(f"running {scenario.name} ...", flush=True)
            row, left = await run_scenario(scenario, root / scenario.name, s3, weights)
            rows.append(row)
            leftovers += left
    finally:
        s3.stop()
    print()
    print(table(rows))
    print(f"\nleftover processes: {leftovers or 'none'}; logs in {root}")
    return 0 if all(r.passed for r in rows) and not leftovers else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))

"""``python3 -m bench.gpukit gather|run``: the GPU kit's two commands (``bench/gpukit``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.gpukit import machine
from bench.gpukit.run import BUDGET_S, SECTIONS

REPO = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpukit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gather = commands.add_parser("gather", help="the wheels the GPU machine lacks (network)")
    gather.add_argument("--python-version", default=machine.PYTHON_VERSION)
    gather.add_argument("--out", type=Path, default=REPO / ".gpukit")
    gather.add_argument(
        "--constraint", type=Path, action="append", default=[], help="CI's exact versions"
    )
    run = commands.add_parser("run", help="on the GPU machine, offline: one JSON report")
    run.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    run.add_argument("--kit", type=Path, default=REPO / ".gpukit", help="the gathered wheels")
    run.add_argument("--site", type=Path, default=Path("/tmp/gpukit-site"), help="installed here")
    run.add_argument("--quick", action="store_true", help="fewer tasks, bench.gpu --quick")
    run.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run")
    run.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"a comma-separated subset of {','.join(SECTIONS)} (a second, shorter call)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "gather":
        from bench.gpukit.gather import GatherFailed, gather

        try:
            manifest = gather(REPO, args.out, args.python_version, args.constraint)
        except GatherFailed as error:
            print(f"gpu-kit: {error}", file=sys.stderr)
            return 1
        print(
            f"gpu-kit: {len(manifest['wheels'])} wheels, {manifest['kit_mib']} MiB, for Python "
            f"{args.python_version}, in {args.out} (the tree: {manifest['tree_mib']} MiB; "
            f"the device tool carries {manifest['carry_limit_mib']} MiB)"
        )
        return 0
    from bench.gpukit.run import Options
    from bench.gpukit.run import main as run_kit

    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        print(f"gpu-kit: unknown sections {sorted(unknown)}; of {SECTIONS}", file=sys.stderr)
        return 2
    return run_kit(
        Options(REPO, args.kit, args.site, args.device, args.quick, args.budget_s, sections)
    )


if __name__ == "__main__":
    sys.exit(main())

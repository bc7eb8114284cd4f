"""What AMI's whole catalogue takes loaded: every slug's pipeline with random weights at its
published category map sizes (from ``pipelines/ami/catalogue.py``; a size AMI does not state
is taken as ``--classes``), loaded on the CPU in one process.

    python -m bench.ami_memory [--classes 1000] [--dir /tmp/ami-memory]

Prints one JSON line: the process's RSS before and after, each pipeline's weights bytes as
the memory budget counts them (``Runner.weights_bytes``), their sum, what the budget counts
for all ten together (shared stages once), and the bytes of the distinct stages.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch

from datasets.uris import SourceConfig
from pipelines.ami import catalogue
from pipelines.cache import tensor_bytes
from pipelines.registry import resolve
from pipelines.runner import Runner, load_runner
from tests.ami_files import classifier_state, detector_state


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _category_map(binary: bool, classes: int) -> dict[str, int]:
    return {"moth": 0, "nonmoth": 1} if binary else {f"taxon {i}": i for i in range(classes)}


def _write(root: Path, default_classes: int) -> None:
    """Random weights at each published size, wrapped as AMI's files are."""
    path = root / catalogue.DETECTOR.weights
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state_dict": detector_state()}, path)
    for slug in catalogue.SLUGS:
        model = catalogue.model_of(slug)
        classes = model.classes or default_classes
        assert model.labels is not None
        for relative, value in (
            (model.weights, {"model_state_dict": classifier_state(model.architecture, classes, 0)}),
            (model.labels, _category_map(model is catalogue.BINARY, classes)),
        ):
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(value, dict) and relative.endswith(".json"):
                target.write_text(json.dumps(value))
            else:
                torch.save(value, target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--dir", default="/tmp/ami-memory")
    args = parser.parse_args()
    root = Path(args.dir)
    _write(root, args.classes)
    before = _rss_bytes()
    runners = [
        load_runner(resolve(s, "", str(root)), SourceConfig(), "cpu") for s in catalogue.SLUGS
    ]
    after = _rss_bytes()
    stages = {id(m): m.model for r in runners for m in (r.detector, r.filter, r.classifier) if m}
    distinct = sum(
        tensor_bytes([*module.parameters(), *module.buffers()]) for module in stages.values()
    )
    print(
        json.dumps(
            {
                "rss_before_bytes": before,
                "rss_after_bytes": after,
                "pipelines_weights_bytes": {r.pipeline.name: r.weights_bytes() for r in runners},
                "one_by_one_bytes": sum(r.weights_bytes() for r in runners),
                "budget_counts_bytes": Runner.weights_bytes_together(runners),
                "distinct_stages": len(stages),
                "distinct_weights_bytes": distinct,
            }
        )
    )


if __name__ == "__main__":
    main()

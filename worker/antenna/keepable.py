"""Which pipelines Antenna can keep the results of: one rule, read where a pipeline is chosen
for Antenna (``register``, ``check``, ``run``).

Antenna saves a result post in a background task that first looks up its pipeline's one
detection algorithm (task type detection, localization or segmentation) and fails when there
is none: the post was already answered 200, the task is not acked, and after its reservation
runs out it comes back and fails again. A classifier-only pipeline (no detector) therefore
cannot be served to Antenna: it is refused before anything is registered or reserved, rather
than dressed up as a whole-image "detection" (every image would become one occurrence boxed
by its whole frame, which an AMI trap image is not). Imports no torch.
"""

from __future__ import annotations

from config.names import env_name
from pipelines.declare import Pipeline


def refusal(pipeline: Pipeline) -> str | None:
    """One line saying why Antenna cannot keep ``pipeline``'s results; None when it can."""
    if pipeline.detector is not None:
        return None
    return (
        f"pipeline {pipeline.name!r} has no detector: Antenna keeps results only of a "
        "pipeline with a detection algorithm (it answers 200 to each result post, then drops "
        "it: 'Pipeline does not have a detection algorithm'); serve it with "
        f"{env_name('source')}=nats, or serve Antenna a pipeline with a detector "
        "(docs/antenna.md)"
    )


def refusals(pipelines: list[Pipeline]) -> list[str]:
    return [line for p in pipelines if (line := refusal(p)) is not None]

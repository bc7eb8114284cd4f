"""Antenna's result, rendered (`worker.antenna.render`): compacted scores keep the top index
Antenna reads, an oversized result keeps every logit."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipelines.models import Algorithm
from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import (
    DETECTOR,
    SLUG,
    TOKEN,
    CoreSettle,
    client_of,
    detection,
    images,
    reserve_all,
    source_of,
    task_of,
)
from worker.antenna.catalog import Catalog
from worker.antenna.post import Poster
from worker.antenna.render import (
    AntennaPipeline,
    _compacted,
    antenna_key,
    encoded,
    fit,
    item,
)
from worker.antenna.settle import AntennaSettler
from worker.core.outcome import Outcome
from worker.core.tasks import Task


def test_an_oversized_result_keeps_every_logit_and_what_antenna_reads_of_its_scores() -> None:
    import random

    classes = 29_176
    rng = random.Random(0)
    logits = [rng.gauss(0.0, 2.0) for _ in range(classes)]
    logits[7] = 20.0  # a confident top class, as a trained classifier gives
    logits[8] = 19.9995  # a runner-up that rounding would tie with it
    raw = [math.exp(v) for v in logits]
    total = sum(raw)
    scores = [round(v / total, 6) for v in raw]
    labels = tuple(f"taxon-{i}" for i in range(classes))
    big = Algorithm("species", "Species", "classification", "cd" * 32, labels)
    served = AntennaPipeline(SLUG, "", (big,))
    task = Task("1", "1", "1", "http://x/1.jpg", reply_subject="$JS.ACK.a.b.1.1.1.1.0")
    rounded = [round(v, 6) for v in logits]

    def result_of(count: int) -> dict[str, Any]:
        detections = []
        for i in range(count):
            entry = detection("1", antenna_key(big), scores, x1=float(i))
            entry["classifications"][0]["logits"] = list(rounded)
            detections.append(entry)
        return {
            "pipeline": SLUG,
            "total_time": 1.0,
            "source_images": [{"id": "1", "url": "u"}],
            "detections": detections,
            "errors": None,
        }

    entry = item(task, result_of(115))
    before = len(encoded(entry))
    fitted, steps = fit(task, entry, 32 * 1024 * 1024)
    after = len(encoded(fitted))
    print(f"29176 classes x 115 detections: {before} bytes -> {after} bytes ({steps})")
    assert before > 32 * 1024 * 1024 >= after
    assert steps == ["scores_compacted", "logits_rounded"]
    for found in fitted["result"]["detections"]:
        (kept,) = found["classifications"]
        # Antenna's class masking reads the logits alone, whole: every one is there
        assert len(kept["logits"]) == classes
        assert max(abs(a - b) for a, b in zip(kept["logits"], rounded, strict=True)) <= 5.001e-4
        # its save reads max(scores) and the first index of it: both as they were
        assert len(kept["scores"]) == classes
        assert max(kept["scores"]) == max(scores) == scores[7]
        assert kept["scores"].index(max(kept["scores"])) == 7
    assert served.classes()[antenna_key(big)] == classes
    # Past every step: logits are never dropped, the result becomes an error result instead.
    small, small_steps = fit(task, item(task, result_of(5)), 1024 * 1024)
    assert small_steps[-1] == "error_result" and small["result"]["image_id"] == "1"


def _near_ties() -> st.SearchStrategy[list[float]]:
    """Score vectors whose values sit on, just under and just over 3-decimal steps and each
    other: where a cut to 3 decimals could tie (or pass) the top score."""

    def around(v: float) -> st.SearchStrategy[float]:
        step = round(v, 3)
        near = [v, math.nextafter(v, 0), math.nextafter(v, 2), step, math.nextafter(step, 0)]
        return st.sampled_from([max(0.0, x) for x in near])

    return st.floats(0, 1).flatmap(
        lambda v: st.lists(around(v) | st.floats(0, 1), min_size=1, max_size=12)
    )


@example([0.9369999999999999, 0.937, 0])  # 0.9369999999999999 * 1000 rounds up to 937
@example([0.5, 0.5, 0.25])
@example([0.0, 0.0])
@settings(max_examples=300, deadline=None)
@given(_near_ties())
def test_compacted_scores_keep_the_top_index_antenna_reads(scores: list[float]) -> None:
    (found,) = _compacted({"detections": [{"classifications": [{"scores": scores}]}]})["detections"]
    out = found["classifications"][0]["scores"]
    top = scores.index(max(scores))
    assert max(out) == max(scores) and out.index(max(out)) == top  # as Antenna's save reads
    for i, (was, cut) in enumerate(zip(scores, out, strict=True)):
        if i == top:
            continue
        assert cut < out[top] or cut == out[top] == 0, (i, scores, out)
        assert cut <= was and was - cut < 0.002 and cut == round(cut, 3), (i, was, cut)


async def test_a_result_over_the_cap_reaches_antenna_with_every_logit() -> None:
    classes = 2000
    big = Algorithm("clf", "Species", "classification", "ef" * 32, tuple(map(str, range(classes))))
    served = AntennaPipeline(SLUG, "", (DETECTOR, big))
    logits = [math.sin(i) * 3 + 0.1234567 for i in range(classes)]
    total = sum(math.exp(v) for v in logits)
    scores = [math.exp(v) / total for v in logits]
    found = detection("ignored", "clf", scores, by="det")
    found.pop("source_image_id")
    found["classifications"][0]["logits"] = logits
    fake = FakeAntenna(token=TOKEN, ttr_s=30.0)
    fake.register_direct(1, served.config())
    with fake.running():
        job = fake.add_job(SLUG, images(1))
        (got,) = await reserve_all(source_of(fake, size=1), 1)
        poster = Poster(client_of(fake), 30_000, 5.0)
        catalog = Catalog([SLUG])
        catalog.add(served)
        rules = CoreSettle(AntennaSettler(poster, catalog, 30_000))
        done = Outcome(detections=[found], timings_s={"load_s": 0.01, "infer_s": 0.01})
        assert await rules.settle(task_of(got), got, done) == "ok"
    (body,) = fake.bodies
    assert len(json.dumps({"results": [{"result": {"detections": [found]}}]})) > 30_000
    assert len(body) <= 30_000
    assert fake.jobs[job].done == {"i0"}
    (saved,) = fake.jobs[job].saved["i0"][0]["classifications"]
    assert fake.maskable(saved, classes)  # what Antenna's class masking reads: all there
    assert saved["scores"].index(max(saved["scores"])) == scores.index(max(scores))

"""Antenna's result, rendered (`worker.antenna.render`): compacted scores keep the top index
Antenna reads, an oversized result keeps every logit. The entry, written once from the typed
detections, is the compact JSON of the ``PipelineResultsResponse`` both sources' results carry
(the NATS document's ``response``, with Antenna's keys and a detector's own label left out);
making it smaller writes again only the vectors a step changes, to the bytes a whole re-encode
would give."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipelines.found import Box, Classification, Detection, Ref
from pipelines.models import Algorithm
from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import (
    DETECTOR,
    SLUG,
    TOKEN,
    CoreSettle,
    client_of,
    found_box,
    images,
    reserve_all,
    source_of,
    task_of,
)
from worker.antenna.catalog import Catalog
from worker.antenna.post import Poster
from worker.antenna.render import AntennaPipeline, _compact, antenna_key, fit, ok_entry, problems
from worker.antenna.settle import AntennaSettler
from worker.core.outcome import Outcome
from worker.core.results import Result
from worker.core.tasks import Task
from worker.nats.render import response


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

    def result_of(count: int) -> Any:
        found = [
            found_box("species", scores, x1=float(i), logits=list(rounded)) for i in range(count)
        ]
        made = Result(task, found, None, {}, {"total_s": 1.0}, {}, 1)
        return ok_entry(task, made, served, SLUG)

    entry = result_of(115)
    before = entry.size()
    fitted, steps = fit(task, entry, 32 * 1024 * 1024)
    after = len(fitted.body)
    print(f"29176 classes x 115 detections: {before} bytes -> {after} bytes ({steps})")
    assert before > 32 * 1024 * 1024 >= after
    assert steps == ["scores_compacted", "logits_rounded"]
    for found in json.loads(fitted.body)["result"]["detections"]:
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
    small, small_steps = fit(task, result_of(5), 1024 * 1024)
    assert small_steps[-1] == "error_result" and json.loads(small.body)["result"]["image_id"] == "1"


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
    out = _compact(scores)
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
    found = found_box("clf", scores, by="det", logits=logits)
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
    assert len(json.dumps([scores, logits])) > 30_000
    assert len(body) <= 30_000
    assert fake.jobs[job].done == {"i0"}
    (saved,) = fake.jobs[job].saved["i0"][0]["classifications"]
    assert fake.maskable(saved, classes)  # what Antenna's class masking reads: all there
    assert saved["scores"].index(max(saved["scores"])) == scores.index(max(scores))


# -- the entry, written once ---------------------------------------------------------------------
AT = "2026-12-06T12:00:00.123456+00:00"
SPECIES_LABELS = tuple(f"sp{i}" for i in range(300))
SPECIES = Algorithm("clf", "Species", "classification", "ab" * 32, SPECIES_LABELS)
SPECIES_SERVED = AntennaPipeline("moths", "", (DETECTOR, SPECIES))
TASK = Task("t1", "17", "img-1", "https://u:pw@x.org/a.jpg?sig=1", reply_subject="$JS.ACK.a.1")


def result_of(boxes: int) -> Result:
    found = []
    for i in range(boxes):
        raw = [math.sin(i + j) * 3 + 0.123456789 for j in range(len(SPECIES_LABELS))]
        total = sum(math.exp(v) for v in raw)
        scores = [round(math.exp(v) / total, 6) for v in raw]
        logits = [round(v, 6) for v in raw]
        own = Classification(
            "object", ["object"], [0.9], None, 0.01, Ref("Detector", "det"), True, AT
        )
        species = Classification(
            "sp1", None, scores, logits, 0.012345, Ref("Species", "clf"), True, AT
        )
        box = Box(i * 1.5, 2.25, i * 1.5 + 10, 20.75)
        found.append(Detection(box, 0.045678, Ref("Detector", "det"), AT, [own, species]))
    timings_s = {"load_s": 0.01, "infer_s": 0.02, "total_s": 0.123456789}
    return Result(TASK, found, None, {}, timings_s, {}, 1)


def as_antenna(result: Result) -> dict[str, Any]:
    """The NATS response of ``result`` as Antenna takes it: its keys, no detector label."""
    shaped = response(result)
    assert shaped is not None
    keys = SPECIES_SERVED.keys()
    shaped["pipeline"] = "moths"
    for detection in shaped["detections"]:
        detection["algorithm"]["key"] = keys[detection["algorithm"]["key"]]
        detection["classifications"] = [
            {**c, "algorithm": {**c["algorithm"], "key": keys[c["algorithm"]["key"]]}}
            for c in detection["classifications"]
            if c["algorithm"]["key"] != "det"
        ]
    return {"reply_subject": TASK.reply_subject, "result": shaped}


def compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def test_the_entry_is_the_compact_json_of_the_response_both_sources_carry() -> None:
    result = result_of(3)
    entry = ok_entry(TASK, result, SPECIES_SERVED, "moths")
    fitted, steps = fit(TASK, entry, 10**8)

    assert steps == [] and entry.size() == len(fitted.body)
    assert fitted.body == compact(as_antenna(result))
    assert fitted.detections == 3 and fitted.error is None
    assert b"pw" not in fitted.body and b"sig" not in fitted.body
    assert problems(result, SPECIES_SERVED) == []


def smaller(entry: dict[str, Any], steps: int) -> dict[str, Any]:
    """``entry`` with its scores compacted, then (``steps`` 2) its logits rounded, as dicts."""
    out = json.loads(json.dumps(entry))
    for detection in out["result"]["detections"]:
        for c in detection["classifications"]:
            c["scores"] = _compact(c["scores"])
            if steps == 2:
                c["logits"] = [round(v, 3) for v in c["logits"]]
    return out


@pytest.mark.parametrize("steps", [1, 2])
def test_each_step_gives_the_bytes_a_whole_re_encode_would(steps: int) -> None:
    result = result_of(6)
    whole = as_antenna(result)
    sizes = [len(compact(whole)), *(len(compact(smaller(whole, n))) for n in (1, 2))]
    assert sizes[0] > sizes[1] > sizes[2]
    envelope = len(b'{"results":[]}')
    cap = sizes[steps] + envelope  # fits after ``steps`` steps, not before

    fitted, taken = fit(TASK, ok_entry(TASK, result, SPECIES_SERVED, "moths"), cap)

    assert taken == ["scores_compacted", "logits_rounded"][:steps]
    assert fitted.body == compact(smaller(whole, steps))


def test_a_result_still_over_the_cap_becomes_an_error_result_saying_its_size() -> None:
    entry = ok_entry(TASK, result_of(6), SPECIES_SERVED, "moths")
    fitted, steps = fit(TASK, entry, 5_000)

    assert steps == ["scores_compacted", "logits_rounded", "error_result"]
    said = json.loads(fitted.body)
    assert said["result"]["image_id"] == "img-1" and fitted.error == said["result"]["error"]
    assert said["result"]["error"].startswith("the result is ")
    again, _ = fit(TASK, entry, 10**8)  # the steps wrote their own copy of the parts
    assert again.body == compact(as_antenna(result_of(6)))


def test_keys_antenna_does_not_know_and_short_score_vectors_are_problems() -> None:
    stranger = Detection(None, 0.0, Ref("Other", "other"), AT, [])
    short = result_of(1).detections[0]  # type: ignore[index]
    cut = Classification("sp1", None, [1.0], [1.0], 0.0, Ref("Species", "clf"), True, AT)
    odd = Detection(short.bbox, 0.0, short.algorithm, AT, [cut])
    found = problems(Result(TASK, [stranger, odd], None, {}, {}, {}, 1), SPECIES_SERVED)

    assert found == [
        f"1 scores for {antenna_key(SPECIES)!r}, whose category map has 300 classes",
        "algorithm key 'other' is not registered",
    ]

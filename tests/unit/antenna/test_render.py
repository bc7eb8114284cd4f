"""Antenna's result entry, written once from the typed detections: its bytes are the compact
JSON of the ``PipelineResultsResponse`` both sources' results carry (the NATS document's
``response``, with Antenna's keys and a detector's own label left out), and making it smaller
writes again only the vectors a step changes, to the bytes a whole re-encode would give."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from pipelines.found import Box, Classification, Detection, Ref
from pipelines.models import Algorithm
from worker.antenna.render import AntennaPipeline, _compact, antenna_key, fit, ok_entry, problems
from worker.core.results import Result
from worker.core.tasks import Task
from worker.nats.render import response

AT = "2026-12-06T12:00:00.123456+00:00"
LABELS = tuple(f"sp{i}" for i in range(300))
DETECTOR = Algorithm("det", "Detector", "detection", "cd" * 32, ("object",))
CLASSIFIER = Algorithm("clf", "Species", "classification", "ab" * 32, LABELS)
SERVED = AntennaPipeline("moths", "", (DETECTOR, CLASSIFIER))
TASK = Task("t1", "17", "img-1", "https://u:pw@x.org/a.jpg?sig=1", reply_subject="$JS.ACK.a.1")


def result_of(boxes: int) -> Result:
    found = []
    for i in range(boxes):
        raw = [math.sin(i + j) * 3 + 0.123456789 for j in range(len(LABELS))]
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
    keys = SERVED.keys()
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
    entry = ok_entry(TASK, result, SERVED, "moths")
    fitted, steps = fit(TASK, entry, 10**8)

    assert steps == [] and entry.size() == len(fitted.body)
    assert fitted.body == compact(as_antenna(result))
    assert fitted.detections == 3 and fitted.error is None
    assert b"pw" not in fitted.body and b"sig" not in fitted.body
    assert problems(result, SERVED) == []


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

    fitted, taken = fit(TASK, ok_entry(TASK, result, SERVED, "moths"), cap)

    assert taken == ["scores_compacted", "logits_rounded"][:steps]
    assert fitted.body == compact(smaller(whole, steps))


def test_a_result_still_over_the_cap_becomes_an_error_result_saying_its_size() -> None:
    entry = ok_entry(TASK, result_of(6), SERVED, "moths")
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
    found = problems(Result(TASK, [stranger, odd], None, {}, {}, {}, 1), SERVED)

    assert found == [
        f"1 scores for {antenna_key(CLASSIFIER)!r}, whose category map has 300 classes",
        "algorithm key 'other' is not registered",
    ]

"""The runner: boxes in source pixels, crops classified by the right stages, the next batch
prepared while the last stage runs, the detections each stage reports."""

from __future__ import annotations

import pytest

from datasets.images import DecodePlan, decode
from datasets.uris import SourceConfig
from pipelines.declare import Detector, Pipeline
from pipelines.models import save_classifier, save_detector
from pipelines.registry import resolve
from pipelines.response import ResponseFormat
from pipelines.runner import DeviceLimits, decode_plan, load_runner
from tests.antenna import PipelineResults
from tests.fakes import result_document
from worker.commands.demo_images import image_bytes, rectangles_bytes
from worker.core.tasks import Task

# Three rectangles in columns of their own, on a 1600x1000 source.
TRUTH = [(100, 100, 300, 400, "red"), (500, 200, 700, 300, "green"), (900, 600, 1200, 900, "blue")]


def _response(detections, image_id="img-1"):
    task = Task("t1", "j1", image_id, "s3://bucket/img.jpg?X-Amz-Signature=secret")
    result = result_document(task, detections, {"load_s": 0.1, "infer_s": 0.2})
    return PipelineResults.model_validate(result["response"]), result


def test_boxes_are_reported_in_source_pixels_when_the_image_is_decoded_smaller(toy):
    pipeline = resolve("toy_moths:moths")
    plan = decode_plan(pipeline, max_side=800, fast=False)
    image = decode(rectangles_bytes(1600, 1000, TRUTH), plan)
    assert image.pixels.shape == (3, 500, 800)  # decoded at half scale
    runner = load_runner(pipeline, SourceConfig(), "cpu")

    (detections,) = runner.run([image])

    response, result = _response(detections)
    boxes = sorted((d.bbox.x1, d.bbox.y1, d.bbox.x2, d.bbox.y2) for d in response.detections)
    for got, (x1, y1, x2, y2, _colour) in zip(boxes, TRUTH, strict=True):
        assert got == pytest.approx((x1, y1, x2, y2), abs=4.0)  # two decoded pixels
    assert response.source_images[0].url == "s3://bucket/img.jpg?<redacted>"  # no signature
    assert "secret" not in str(result)


def test_the_filter_decides_which_crops_go_on_to_the_classifier(toy):
    pipeline = resolve("toy_moths:moths")
    runner = load_runner(pipeline, SourceConfig(), "cpu")
    image = decode(rectangles_bytes(1600, 1000, TRUTH, fmt="PNG"), DecodePlan(max_side=4096))

    (detections,) = runner.run([image])

    by_x = sorted(detections, key=lambda d: d["bbox"]["x1"])
    chains = [
        [(c["algorithm"]["key"], c["classification"], c["terminal"]) for c in d["classifications"]]
        for d in by_x
    ]
    assert chains == [
        [("colour-filter", "red", False), ("colour", "reddish", True)],
        [("colour-filter", "green", False), ("colour", "greenish", True)],
        [("colour-filter", "blue", True)],  # not kept: the filter's word is final
    ]
    assert all(d["algorithm"] == {"name": "Bright boxes", "key": "bright-boxes"} for d in by_x)


def test_a_filter_whose_dropped_label_is_not_terminal_marks_no_filter_label_terminal(toy):
    # AMI's rule (ami worker): the moth / non-moth label is never terminal, kept or not.
    import dataclasses

    declared = resolve("toy_moths:moths")
    assert declared.filter is not None
    pipeline = dataclasses.replace(
        declared, filter=dataclasses.replace(declared.filter, dropped_terminal=False)
    )
    runner = load_runner(pipeline, SourceConfig(), "cpu")
    image = decode(rectangles_bytes(1600, 1000, TRUTH, fmt="PNG"), DecodePlan(max_side=4096))

    (detections,) = runner.run([image])

    chains = [
        [(c["algorithm"]["key"], c["classification"], c["terminal"]) for c in d["classifications"]]
        for d in sorted(detections, key=lambda d: d["bbox"]["x1"])
    ]
    assert chains == [
        [("colour-filter", "red", False), ("colour", "reddish", True)],
        [("colour-filter", "green", False), ("colour", "greenish", True)],
        [("colour-filter", "blue", False)],  # not kept, and still not terminal
    ]


def test_a_classifier_alone_gives_one_detection_without_a_box(tmp_path):
    weights = save_classifier("mobilenet_v3_small", ["a", "b", "c"], str(tmp_path))
    pipeline = resolve("mobilenet-v3-small-classifier", weights)
    plan = decode_plan(pipeline, max_side=4096, fast=False)
    assert plan == DecodePlan(size=224, resize="squash", max_side=4096, fast=False)
    runner = load_runner(pipeline, SourceConfig(), "cpu")
    images = [decode(image_bytes(640, 480, seed=i), plan) for i in range(2)]

    results = runner.run(images)

    assert len(results) == len(images) == 2
    for detections in results:
        response, _ = _response(detections)
        (detection,) = response.detections
        (classification,) = detection.classifications
        assert detection.bbox is None and classification.terminal
        assert classification.labels == ["a", "b", "c"]
        assert sum(classification.scores) == pytest.approx(1.0, abs=1e-5)
        best = max(range(3), key=lambda i: classification.scores[i])
        assert classification.classification == classification.labels[best]
        assert classification.logits is not None and len(classification.logits) == 3


def test_top_k_scores_carry_their_labels_and_long_class_lists_are_left_out(toy):
    many = resolve("toy_moths:many")
    image = decode(image_bytes(320, 240, seed=1), decode_plan(many, 4096, False))
    full = load_runner(many, SourceConfig(), "cpu", DeviceLimits(crop_batch=128)).run([image])[0]
    top = load_runner(
        many, SourceConfig(), "cpu", None, ResponseFormat(scores="top_k", top_k=3)
    ).run([image])[0]

    assert len(full) == len(top) == 500
    whole, best = full[0]["classifications"][0], top[0]["classifications"][0]
    assert "labels" not in whole and len(whole["scores"]) == 1000  # over labels_inline_max
    assert best["labels"][0] == whole["classification"] == best["classification"]
    assert best["scores"] == sorted(whole["scores"], reverse=True)[:3]


def test_crops_are_classified_a_chunk_at_a_time(toy):
    runner = load_runner(
        resolve("toy_moths:many"), SourceConfig(), "cpu", DeviceLimits(crop_batch=64)
    )
    assert runner.classifier is not None
    sizes: list[int] = []
    forward = runner.classifier.forward

    def counting(batch):
        sizes.append(len(batch))
        return forward(batch)

    runner.classifier.forward = counting  # type: ignore[method-assign]
    runner.run([decode(image_bytes(320, 240, seed=1), DecodePlan(max_side=4096))])
    assert sum(sizes) == 500 and max(sizes) == 64


def test_a_built_in_detector_reports_boxes_inside_the_source_image(tmp_path):
    weights = save_detector("fasterrcnn_mobilenet_v3_large_fpn", ["moth"], str(tmp_path / "d"))
    detector = Detector(
        "moth-detector",
        architecture="fasterrcnn_mobilenet_v3_large_fpn",
        weights=weights,
        labels=None,
        score_threshold=0.0,
        max_detections=20,
        min_size=128,
        max_size=160,
    )
    pipeline = Pipeline("detect", detector=detector)
    runner = load_runner(pipeline, SourceConfig(), "cpu")
    plan = decode_plan(pipeline, max_side=400, fast=False)
    images = [decode(image_bytes(w, h, seed=w), plan) for w, h in [(800, 600), (300, 500)]]

    results = runner.run(images)

    assert runner.detector is not None and runner.detector.algorithm.labels == ("moth",)
    for image, detections in zip(images, results, strict=True):
        assert 0 < len(detections) <= 20
        for d in detections:
            box = d["bbox"]
            assert 0 <= box["x1"] <= box["x2"] <= image.source_width + 0.01
            assert 0 <= box["y1"] <= box["y2"] <= image.source_height + 0.01
            (only,) = d["classifications"]  # a detector alone: its class and score
            assert only["classification"] == "moth" and 0.0 <= only["scores"][0] <= 1.0


def test_a_detector_alone_reports_each_box_with_its_class_and_score(toy):
    detector = resolve("toy_moths:moths").detector
    runner = load_runner(Pipeline("boxes", detector=detector), SourceConfig(), "cpu")
    image = decode(rectangles_bytes(1600, 1000, TRUTH, fmt="PNG"), DecodePlan(max_side=4096))

    (detections,) = runner.run([image])

    assert len(detections) == 3
    for d in detections:
        (only,) = d["classifications"]
        assert (only["classification"], only["scores"], only["terminal"]) == ("thing", [1.0], True)
        assert only["algorithm"] == {"name": "Bright boxes", "key": "bright-boxes"}


def test_jpegs_left_encoded_for_the_device_give_the_same_boxes_through_the_cpu_fallback(toy):
    pipeline = resolve("toy_moths:moths")
    runner = load_runner(pipeline, SourceConfig(), "cpu", DeviceLimits(max_side=800))
    data = rectangles_bytes(1600, 1000, TRUTH)
    usual = decode(data, decode_plan(pipeline, 800, fast=False))
    encoded = decode(data, decode_plan(pipeline, 800, fast=False, device_decode=True))
    png = decode(
        rectangles_bytes(1600, 1000, TRUTH, fmt="PNG"), DecodePlan(max_side=800, encoded=True)
    )

    assert encoded.encoded == data and encoded.pixels.size == 0  # handed over undecoded
    assert (encoded.source_width, encoded.source_height) == (1600, 1000)
    assert png.encoded is None and png.pixels.shape == (3, 500, 800)  # only JPEGs wait

    def boxes(image):
        (detections,) = runner.run([image])
        return sorted(tuple(d["bbox"].values()) for d in detections)

    assert boxes(encoded) == boxes(usual) and len(boxes(usual)) == 3


def _traced(runner, events):
    """Record each stage's forward passes and the moments their results come back."""

    def wrap(name, method, model):
        inner = getattr(model, method)

        def traced(*args):
            events.append(f"{name}.{method}")
            return inner(*args)

        setattr(model, method, traced)

    if runner.detector is not None:
        wrap("detector", "forward", runner.detector)
        wrap("detector", "cleaned", runner.detector)
    for name in ("filter", "classifier"):
        model = getattr(runner, name)
        if model is not None:
            wrap(name, "forward", model)
            wrap(name, "checked", model)


def _squeezed(events):
    """Repeats of one event as one."""
    return [e for i, e in enumerate(events) if i == 0 or events[i - 1] != e]


@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [
        (
            "toy_moths:moths",
            [
                "detector.forward",
                "detector.cleaned",
                "detector.forward",
                "detector.cleaned",
                "filter.forward",
                "filter.checked",
                "classifier.forward",
                "next batch",
                "classifier.checked",
            ],
        ),
        (
            "detector-only",
            [
                "detector.forward",
                "detector.cleaned",
                "detector.forward",
                "next batch",
                "detector.cleaned",
            ],
        ),
        ("classifier-only", ["classifier.forward", "next batch", "classifier.checked"]),
    ],
)
def test_the_next_batch_is_prepared_once_after_the_last_stage_is_given_to_the_device(
    toy, pipeline, expected
):
    """The engine's ``while_running`` comes after the last forward pass is started and before
    its results are brought back (on a GPU: while it computes); each stage's results come
    back once for the whole batch."""
    moths = resolve("toy_moths:moths")
    chosen = {
        "toy_moths:moths": moths,
        "detector-only": Pipeline("boxes", detector=moths.detector),
        "classifier-only": Pipeline("colour", classifier=moths.classifier),
    }[pipeline]
    limits = DeviceLimits(detector_batch=2, crop_batch=2)
    runner = load_runner(chosen, SourceConfig(), "cpu", limits)
    events: list[str] = []
    _traced(runner, events)
    rectangles = [(10 + 40 * i, 10, 30 + 40 * i, 40, "red") for i in range(5)]
    plan = decode_plan(chosen, 4096, False)
    images = [decode(rectangles_bytes(240, 60, rectangles), plan) for _ in range(3)]

    results = runner.run(images, lambda: events.append("next batch"))

    assert _squeezed(events) == expected
    assert len(results) == 3 and all(len(found) >= 1 for found in results)


def test_the_next_batch_is_prepared_once_when_no_crop_reaches_the_device(toy):
    runner = load_runner(resolve("toy_moths:moths"), SourceConfig(), "cpu")
    black = decode(rectangles_bytes(64, 64, []), DecodePlan(max_side=4096))
    calls: list[int] = []
    assert runner.run([black, black], lambda: calls.append(1)) == [[], []]
    assert calls == [1]


def _without_clocks(results):
    """Results with their timestamps and timings left out, to compare two runs."""
    if isinstance(results, dict):
        return {
            k: _without_clocks(v)
            for k, v in results.items()
            if k not in ("timestamp", "inference_time")
        }
    if isinstance(results, list):
        return [_without_clocks(v) for v in results]
    return results


@pytest.mark.parametrize("pipeline", ["toy_moths:moths", "toy_moths:many"])
def test_images_copied_ahead_give_the_same_results_as_images_that_were_not(toy, pipeline):
    chosen = resolve(pipeline)
    runner = load_runner(
        chosen, SourceConfig(), "cpu", DeviceLimits(detector_batch=2, crop_batch=64)
    )
    rectangles = [(10, 10, 40, 50, "red"), (60, 5, 90, 30, "green"), (120, 20, 150, 60, "blue")]
    plan = decode_plan(chosen, 4096, False)
    images = [decode(rectangles_bytes(200, 80, rectangles), plan) for _ in range(3)]
    ahead = runner.copy_ahead(images[:2]) + images[2:]  # the next batch's first chunk, ahead

    assert _without_clocks(runner.run(ahead)) == _without_clocks(runner.run(images))
    assert runner.copy_ahead_images == 2


def test_each_forward_pass_of_a_batch_is_reported_as_progress(toy):
    runner = load_runner(
        resolve("toy_moths:moths"),
        SourceConfig(),
        "cpu",
        DeviceLimits(detector_batch=1, crop_batch=1),
    )
    passes: list[str] = []
    for stage in ("detector", "filter", "classifier"):
        model = getattr(runner, stage)
        forward = model.forward

        def counted(inputs, forward=forward, stage=stage):
            passes.append(stage)
            return forward(inputs)

        model.forward = counted
    ticks: list[int] = []
    runner.progress = lambda: ticks.append(len(passes))
    image = decode(rectangles_bytes(1600, 1000, TRUTH, fmt="PNG"), DecodePlan(max_side=4096))

    runner.run([image, image])

    assert passes.count("detector") == 2 and passes.count("filter") == 6
    assert ticks == list(range(1, len(passes) + 1)), "a tick after each pass, none before"

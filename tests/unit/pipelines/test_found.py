"""The typed detections' wire shape (``pipelines.found``): Antenna's ``DetectionResponse`` and
``ClassificationResponse``, field for field and in their order, labels left out where the
runner did not write them."""

from __future__ import annotations

import json

from pipelines.found import Box, Classification, Detection, Ref, classification_fields, fields

AT = "2026-12-06T12:00:00+00:00"


def test_a_detection_is_written_as_a_detection_response_for_its_image() -> None:
    by = Ref("Species", "clf")
    long_list = Classification("b", None, [0.25, 0.75], [-1.0, 0.1], 0.5, by, True, AT)
    inline = Classification("b", ["a", "b"], [0.25, 0.75], None, 0.5, by, False, AT)
    found = Detection(Box(1.0, 2.0, 3.5, 4.25), 0.125, Ref("Detector", "det"), AT, [long_list])

    written = fields(found, "img-1")

    assert json.dumps(written, separators=(",", ":")) == (
        '{"source_image_id":"img-1","bbox":{"x1":1.0,"y1":2.0,"x2":3.5,"y2":4.25},'
        '"inference_time":0.125,"algorithm":{"name":"Detector","key":"det"},'
        f'"timestamp":"{AT}","crop_image_url":null,"classifications":[{{"classification":"b",'
        '"scores":[0.25,0.75],"logits":[-1.0,0.1],"inference_time":0.5,'
        f'"algorithm":{{"name":"Species","key":"clf"}},"terminal":true,"timestamp":"{AT}"}}]}}'
    )
    assert list(classification_fields(inline, "antenna-key")) == [
        "classification",
        "labels",
        "scores",
        "logits",
        "inference_time",
        "algorithm",
        "terminal",
        "timestamp",
    ]
    assert classification_fields(inline, "antenna-key")["algorithm"]["key"] == "antenna-key"
    assert fields(Detection(None, 0.0, by, AT), "i")["bbox"] is None

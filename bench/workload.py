"""The real workload on this machine's CPU: 4096x2160 JPEGs through decode (bounded by
MAX_SIDE), a FasterRCNN detector, crops, a binary filter and a species classifier, with the
pipeline's own code (``pipelines.runner``). Seconds per image by stage and peak RSS.

Random weights: the detector keeps its top ``--boxes`` boxes whatever their score, so the crop
stages see a realistic count.

    .venv/bin/python -m bench.workload [--images 4] [--boxes 100] [--detector ARCH]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import torch

from bench.preprocess import scene
from datasets.images import decode
from datasets.sources import SourceConfig
from pipelines.declare import Classifier, Detector, Pipeline, Preprocess
from pipelines.models import save_classifier, save_detector
from pipelines.runner import DeviceLimits, decode_plan, load_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--boxes", type=int, default=100)
    parser.add_argument("--detector", default="fasterrcnn_mobilenet_v3_large_fpn")
    parser.add_argument("--max-side", type=int, default=4096)
    parser.add_argument("--species", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Pipeline(
            "moths",
            detector=Detector(
                "detector",
                architecture=args.detector,
                weights=save_detector(args.detector, ["moth"], f"{tmp}/d"),
                labels=None,
                score_threshold=0.0,
                max_detections=args.boxes,
            ),
            filter=Classifier(
                "binary",
                architecture="resnet50",
                weights=save_classifier("resnet50", ["moth", "nonmoth"], f"{tmp}/b"),
                keep=("moth", "nonmoth"),  # random weights: keep every crop, the worst case
                preprocess=Preprocess(128),
            ),
            classifier=Classifier(
                "species",
                architecture="resnet50",
                weights=save_classifier(
                    "resnet50", [f"s{i}" for i in range(args.species)], f"{tmp}/s"
                ),
                preprocess=Preprocess(128, mean=(0.5,) * 3, std=(0.5,) * 3),
            ),
        )
        runner = load_runner(pipeline, SourceConfig(), "cpu", DeviceLimits(detector_batch=1))
        plan = decode_plan(pipeline, args.max_side, fast=False)
        data = [scene(4096, 2160, seed) for seed in range(args.images)]
        started = time.perf_counter()
        images = [decode(d, plan) for d in data]
        decode_s = (time.perf_counter() - started) / args.images
        started = time.perf_counter()
        results = runner.run(images)
        run_s = (time.perf_counter() - started) / args.images
    detections = sum(len(r) for r in results) / args.images
    per_image = json.dumps(results[0]).encode()
    report = {
        "detector": args.detector,
        "max_side": args.max_side,
        "images": args.images,
        "decoded": list(images[0].pixels.shape),
        "detections_per_image": detections,
        "decode_s_per_image": round(decode_s, 3),
        "detect_and_classify_s_per_image": round(run_s, 3),
        "response_bytes_per_image": len(per_image),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

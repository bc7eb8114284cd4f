"""How often reduced precision changes what the worker reports, against float32, on a fixed
image set: top-1 labels of a classifier and the detections of a detector. Runs where it is
started (`--device cuda` on a GPU; on the CPU, autocast's bfloat16 and float16 kernels).

    .venv/bin/python -m bench.precision [--device cpu] [--images 24]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from bench.preprocess import scene, trained_looking
from datasets.images import DecodePlan, decode
from datasets.sources import SourceConfig
from pipelines.architectures import build_classifier
from pipelines.declare import Detector, Pipeline
from pipelines.models import save_detector
from pipelines.runner import load_runner

PRECISIONS = ("bfloat16", "float16")


def classifier_agreement(images: torch.Tensor, device: str) -> dict[str, object]:
    """Top-1 of a ResNet-50 (1,000 classes, trained-looking norms) on standardised logits."""
    torch.manual_seed(0)
    model = trained_looking(build_classifier("resnet50", 1000), seed=1).to(device)
    mean = torch.tensor((0.485, 0.456, 0.406), device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor((0.229, 0.224, 0.225), device=device).view(1, 3, 1, 1) * 255
    batch = (images.to(device).float() - mean) / std
    out: dict[str, object] = {}
    with torch.inference_mode():
        reference = model(batch).float()
        centre, spread = reference.mean(0), reference.std(0) + 1e-6
        ref_top = ((reference - centre) / spread).argmax(1)
        for precision in PRECISIONS:
            try:
                with torch.autocast(
                    device_type=torch.device(device).type, dtype=getattr(torch, precision)
                ):
                    logits = model(batch).float()
            except RuntimeError as error:
                out[precision] = f"not supported here: {error}"
                continue
            top = ((logits - centre) / spread).argmax(1)
            out[precision] = {
                "top1_changed": int((top != ref_top).sum()),
                "of": len(images),
                "max_abs_logit_diff": round(float((logits - reference).abs().max()), 4),
            }
    return out


def _iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    from torchvision.ops import box_iou

    return box_iou(a, b) if len(a) and len(b) else torch.zeros((len(a), len(b)))


def detector_agreement(data: list[bytes], device: str) -> dict[str, object]:
    """fasterrcnn_mobilenet_v3_large_fpn (random weights, its top 50 boxes): boxes found in
    float32 and matched (IoU >= 0.9) under reduced precision, and count differences."""
    with tempfile.TemporaryDirectory() as tmp:
        weights = save_detector("fasterrcnn_mobilenet_v3_large_fpn", ["moth"], tmp)
        stage = Detector(
            "d",
            architecture="fasterrcnn_mobilenet_v3_large_fpn",
            weights=weights,
            labels=None,
            score_threshold=0.3,
            max_detections=50,
        )
        pipeline = Pipeline("p", detector=stage)
        plan = DecodePlan(max_side=1333)
        images = [torch.from_numpy(decode(d, plan).pixels) for d in data]
        runs = {}
        for precision in ("float32", *PRECISIONS):
            runner = load_runner(pipeline, SourceConfig(), device, precision=precision)
            assert runner.detector is not None
            try:
                runs[precision] = runner.detector.detect(images)
            except RuntimeError as error:
                runs[precision] = f"not supported here: {error}"  # type: ignore[assignment]
    out: dict[str, object] = {}
    reference = runs["float32"]
    for precision in PRECISIONS:
        found = runs[precision]
        if isinstance(found, str):
            out[precision] = found
            continue
        matched = total = count_diff = 0
        for ref, got in zip(reference, found, strict=True):
            total += len(ref.boxes)
            count_diff += abs(len(ref.boxes) - len(got.boxes))
            iou = _iou(ref.boxes, got.boxes)
            matched += int((iou.max(dim=1).values >= 0.9).sum()) if iou.numel() else 0
        out[precision] = {
            "float32_boxes": total,
            "matched_iou_0.9": matched,
            "box_count_difference": count_diff,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--images", type=int, default=24)
    args = parser.parse_args()
    data = [scene(1920, 1080, seed) for seed in range(args.images)]
    squares = torch.stack([torch.from_numpy(decode(d, DecodePlan(size=224)).pixels) for d in data])
    report = {
        "device": args.device,
        "torch": torch.__version__,
        "classifier_resnet50_224": classifier_agreement(squares, args.device),
        "detector_fasterrcnn_mobilenet": detector_agreement(data[:8], args.device),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

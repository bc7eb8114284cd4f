"""AMI's pattern for detect-and-classify, which ``bench.workload`` runs in a process of its
own to compare against.

    python -m bench.common.ami_pattern CONFIG_JSON

Per job, a DataLoader is built (fork, 2 workers) over the job's images, each returned as a
full-resolution float32 tensor; the detector runs on each image; every box is cut from the
float image at source resolution, resized to the classifier's input, and the job's crops are
stacked into one batch for the binary classifier and then the species classifier. The models
are plain torchvision modules with the same weights as the worker's pipeline (no batch norm
folding, no channels-last). Prints one JSON line: per-job seconds, the images that had
detections and classifications (``bench.workload`` checks them), CPU ms per image.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import resource
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from pipelines.architectures import build_classifier, build_detector

_clients: dict[int, Any] = {}


class FullResolution(Dataset[torch.Tensor]):
    """Each image as a full-resolution float32 tensor, read with a boto3 client of the
    process's own (keyed by pid): what AMI's pattern loads."""

    def __init__(self, uris: list[str], endpoint: str) -> None:
        self.uris = uris
        self.endpoint = endpoint

    def __len__(self) -> int:
        return len(self.uris)

    def __getitem__(self, index: int) -> torch.Tensor:
        import boto3

        client = _clients.get(os.getpid())
        if client is None:
            client = _clients[os.getpid()] = boto3.client("s3", endpoint_url=self.endpoint)
        bucket, _, key = self.uris[index][len("s3://") :].partition("/")
        data = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        array = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


def as_list(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """No collation: images of different sizes stay a list."""
    return batch


def cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (DataLoader
    workers, once their loader is gone)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load(config: dict[str, Any]) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    detector = build_detector(
        config["detector_architecture"],
        2,
        box_score_thresh=0.0,
        box_detections_per_img=config["boxes"],
        min_size=config["detector_min_size"],
        max_size=config["detector_max_size"],
    )
    detector.load_state_dict(torch.load(config["detector_weights"], weights_only=True))
    binary = build_classifier(config["classifier_architecture"], 2)
    binary.load_state_dict(torch.load(config["binary_weights"], weights_only=True))
    species = build_classifier(config["classifier_architecture"], config["species"])
    species.load_state_dict(torch.load(config["species_weights"], weights_only=True))
    return detector.eval(), binary.eval(), species.eval()


def crops(image: torch.Tensor, boxes: torch.Tensor, size: int) -> list[torch.Tensor]:
    out = []
    for x1, y1, x2, y2 in boxes.round().int().tolist():
        if x2 > x1 and y2 > y1:
            crop = image[:, y1:y2, x1:x2][None]
            out.append(F.interpolate(crop, size=(size, size), mode="bilinear")[0])
    return out


def job(
    models: tuple[torch.nn.Module, ...], uris: list[str], endpoint: str, size: int
) -> tuple[int, int]:
    """One job, AMI's way: (images with detections, crops classified by both classifiers)."""
    detector, binary, species = models
    loader = DataLoader(
        FullResolution(uris, endpoint),
        batch_size=4,
        num_workers=2,
        collate_fn=as_list,
        multiprocessing_context=mp.get_context("fork"),
    )
    mean = torch.tensor((0.485, 0.456, 0.406)).view(1, 3, 1, 1)
    std = torch.tensor((0.229, 0.224, 0.225)).view(1, 3, 1, 1)
    detected, classified = 0, 0
    with torch.inference_mode():
        for batch in loader:
            cut: list[torch.Tensor] = []
            for image, found in zip(batch, detector(batch), strict=True):
                pieces = crops(image, found["boxes"], size)
                detected += bool(pieces)
                cut += pieces
            if cut:
                stacked = (torch.stack(cut) - mean) / std  # one batch of every crop
                first, second = binary(stacked), species(stacked)
                good = torch.isfinite(first).all(dim=1) & torch.isfinite(second).all(dim=1)
                classified += int(good.sum())
    return detected, classified


def main() -> None:
    with open(sys.argv[1]) as handle:
        config = json.loads(handle.read())
    torch.set_num_threads(config["torch_threads"])
    models = load(config)
    seconds, detected, classified = [], 0, 0
    cpu_started = 0.0
    for run in range(config["runs"] + 1):  # the first job warms up
        if run == 1:
            cpu_started = cpu_s()
        started = time.perf_counter()
        got, crops_done = job(models, config["uris"], config["endpoint"], config["size"])
        seconds.append(time.perf_counter() - started)
        if run:
            detected += got
            classified += crops_done
    images = len(config["uris"]) * config["runs"]
    print(
        json.dumps(
            {
                "seconds": seconds[1:],
                "images": images,
                "images_with_detections": detected,
                "crops_classified": classified,
                "cpu_ms_per_image": 1000 * (cpu_s() - cpu_started) / max(1, images),
            }
        )
    )


if __name__ == "__main__":
    main()

"""The DataLoader patterns in use today, for comparison (run by bench/throughput.py).

    python -m bench.patterns {fork_rebuilt|no_workers|forkserver_rebuilt} URIS_FILE ENDPOINT WEIGHTS

(a) fork_rebuilt: a DataLoader rebuilt per job with the fork context, full-resolution float32
    tensors, batches collated in the workers, no timeout;
(b) no_workers: num_workers=0, the usual workaround;
(c) forkserver_rebuilt: rebuilt per job with forkserver and no preload.
Prints one JSON line: images/s over all jobs, model included; the images classified (a
finite row of logits each), which ``bench.throughput`` checks; CPU ms per image of this
process and the DataLoader workers it waited for.
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

JOB_SIZE = 16
_clients: dict[int, Any] = {}


class FullResolution(Dataset[torch.Tensor]):
    """Each image as a full-resolution float32 tensor, read with a boto3 client of the
    process's own (keyed by pid): what these patterns and AMI's (``bench.workload_ami``) load."""

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


def loader_for(pattern: str, job: list[str], endpoint: str) -> DataLoader[Any]:
    dataset = FullResolution(job, endpoint)
    if pattern == "no_workers":
        return DataLoader(dataset, batch_size=JOB_SIZE, num_workers=0, collate_fn=as_list)
    context = "fork" if pattern == "fork_rebuilt" else "forkserver"
    return DataLoader(
        dataset,
        batch_size=JOB_SIZE,
        num_workers=2,
        collate_fn=as_list,
        multiprocessing_context=mp.get_context(context),
    )


def main() -> None:
    pattern, uris_file, endpoint, weights = sys.argv[1:5]
    from datasets.sources import SourceConfig
    from pipelines.declare import Classifier
    from pipelines.models import ClassifierModel

    with open(uris_file) as handle:
        uris = json.loads(handle.read())
    stage = Classifier("c", architecture="mobilenet_v3_small", weights=weights)
    model = ClassifierModel(stage, SourceConfig(s3_endpoint_url=endpoint), torch.device("cpu"))
    jobs = [uris[i : i + JOB_SIZE] for i in range(0, len(uris), JOB_SIZE)]
    started, cpu_started = time.perf_counter(), cpu_s()
    classified = 0
    for job in jobs:
        for batch in loader_for(pattern, job, endpoint):
            small = torch.cat(
                [F.interpolate(t[None], size=(224, 224), mode="bilinear") for t in batch]
            )
            logits = model.logits((small * 255).clamp(0, 255).to(torch.uint8))
            classified += int(torch.isfinite(logits).all(dim=1).sum())
    elapsed = time.perf_counter() - started
    print(
        json.dumps(
            {
                "pattern": pattern,
                "images": len(uris),
                "classified": classified,
                "seconds": elapsed,
                "images_per_s": len(uris) / elapsed,
                "cpu_ms_per_image": 1000 * (cpu_s() - cpu_started) / len(uris),
            }
        )
    )


def cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (DataLoader
    workers, once their loader is gone)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


if __name__ == "__main__":
    main()

"""Antenna's result shape, for tests: the package's models, written from the field names and
meanings of Antenna's ``PipelineResultsResponse`` (``worker/antenna/schemas.py``)."""

from __future__ import annotations

from worker.antenna.schemas import (
    AlgorithmRef,
    Box,
    Classification,
    Detection,
    ErrorResult,
    PipelineResults,
    ResultPost,
    SourceImage,
    TaskResult,
)

__all__ = [
    "AlgorithmRef",
    "Box",
    "Classification",
    "Detection",
    "ErrorResult",
    "PipelineResults",
    "ResultPost",
    "SourceImage",
    "TaskResult",
]

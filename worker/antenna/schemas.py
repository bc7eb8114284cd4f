"""Antenna's wire shapes, written from the field names and meanings of its pydantic schemas
(RolnickLab/antenna ``ami/ml/schemas.py``): ``PipelineResultsResponse`` and what it holds, the
error result, and the result post's envelope. Strict about types, tolerant of extra fields, as
Antenna is. Imports nothing of ours.
"""

from __future__ import annotations

import datetime

import pydantic


class Box(pydantic.BaseModel):
    x1: float
    y1: float
    x2: float
    y2: float


class AlgorithmRef(pydantic.BaseModel):
    name: str
    key: str


class Classification(pydantic.BaseModel):
    classification: str
    labels: list[str] | None = None
    scores: list[float] = []
    logits: list[float] | None = None
    inference_time: float | None = None
    algorithm: AlgorithmRef
    terminal: bool = True
    timestamp: datetime.datetime


class Detection(pydantic.BaseModel):
    source_image_id: str
    bbox: Box | None = None
    inference_time: float | None = None
    algorithm: AlgorithmRef
    timestamp: datetime.datetime
    crop_image_url: str | None = None
    classifications: list[Classification] = []


class SourceImage(pydantic.BaseModel):
    id: str
    url: str


class PipelineResults(pydantic.BaseModel):
    pipeline: str
    total_time: float
    source_images: list[SourceImage]
    detections: list[Detection]
    errors: list[object] | str | None = None


class ErrorResult(pydantic.BaseModel):
    error: str
    image_id: str | None = None


class TaskResult(pydantic.BaseModel):
    reply_subject: str
    result: PipelineResults | ErrorResult


class ResultPost(pydantic.BaseModel):
    results: list[TaskResult]

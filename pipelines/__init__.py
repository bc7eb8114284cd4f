"""Inference: pipelines of stages (detector, crop filter, classifier) declared as data.

Takes decoded images, returns typed detections (``pipelines.found``); knows nothing of NATS
or asyncio.
"""

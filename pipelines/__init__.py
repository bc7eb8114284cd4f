"""Inference: pipelines of stages (detector, crop filter, classifier) declared as data.

Takes decoded images, returns Antenna-shaped detections; knows nothing of NATS or asyncio.
"""

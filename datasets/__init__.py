"""Data loading: image sources, decode/resize, and the persistent DataLoader.

Knows nothing of NATS or asyncio.
"""

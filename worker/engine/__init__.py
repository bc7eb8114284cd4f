"""Loads and forward passes, on one dedicated thread (``Engine``). Knows nothing of NATS.

Its pieces, one job each: ``models`` (what a batch runs on), ``stash`` (loads submitted and
loaded, kept by key until their batch), ``collect`` (a batch's images from the stash and the
loader), ``recovery`` (rebuilding the loader when it breaks, giving up after too many),
``split`` (a failed forward pass: each image alone, or halves when out of device memory),
``forward`` (one forward pass and its timing), ``copy_ahead`` (the next batch's first images
sent to the device while this one runs), ``reads`` (the loader children's read statistics);
``engine`` composes them."""

from worker.engine.engine import Engine

__all__ = ["Engine"]

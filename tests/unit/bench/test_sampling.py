"""A background sampler ends when its block does, even when its probe swallows a cancel, as
``asyncio.wait_for`` does on Python 3.11 when the cancel comes in the turn its future is done
(nats-py waits for every reply so): ``bench.many_jobs --smoke`` stalled there."""

from __future__ import annotations

import asyncio

from bench.common.sampling import sampled


async def test_the_sampler_stops_though_its_probe_swallows_every_cancel():
    probes = 0

    async def probe() -> int:
        nonlocal probes
        probes += 1
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            pass  # what wait_for does when the reply came in the same turn
        return probes

    async def run() -> list[int]:
        async with sampled(probe, every_s=0.001) as seen:  # a cancel lands in the probe
            for _ in range(3000):
                if len(seen) >= 3:
                    break
                await asyncio.sleep(0.01)
        return seen

    seen = await asyncio.wait_for(run(), 30)
    assert seen[:3] == [1, 2, 3]
    assert probes == len(seen)  # nothing sampled after the block

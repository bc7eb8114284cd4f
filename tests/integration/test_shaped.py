"""S3 at a distance: the worker against a real S3 endpoint behind a shaped network
(``testing.shapednet``: first-byte delays, a bandwidth cap, stalls and throttling on request).

Delays here are short so the suite stays fast; the benchmarks use S3's real figures. What is
asserted comes from the counters of the network itself (requests in flight at once, the
connection each request came on) and of the worker (its children's reads), never from timing.
"""

from __future__ import annotations

from collections import Counter

import pytest

from testing.shapednet import Shape, ShapedProxy
from tests.helpers import client, running_worker, submit, upload_images, wait_results

pytestmark = pytest.mark.integration


def shaped(s3_server, **shape) -> ShapedProxy:
    defaults = {"first_byte_median_s": 0.02, "first_byte_p99_s": 0.08, "bytes_per_s": 4e6}
    return ShapedProxy(s3_server.port, Shape(**{**defaults, **shape}))


def worker_settings(settings_for, nats_server, proxy, **loader):
    return settings_for(
        nats_server.url,
        # A stall is 2 s without a byte: far from anything the loaded test machine makes.
        s3={"endpoint_url": proxy.url, "read_timeout_s": 2.0, "max_attempts": 3},
        loader={"num_workers": 1, "batch_size": 4, "reads_per_worker": 4, **loader},
    )


async def run_job(settings, proxy, job: str, uris: list[str]):
    """A job through a worker behind ``proxy``: its results, the worker's read retries by
    reason and its children's reads (as they last reported them), the network's counts."""
    async with running_worker(settings) as app, client(settings) as js:
        await submit(js, settings, job, uris)
        results = await wait_results(js, settings, job, len(uris), timeout_s=90)
        assert app.engine is not None
        retries, reads = dict(app.engine.read_retries), app.engine.reads()
    return results, retries, reads, proxy.stats()


async def test_a_job_over_a_shaped_network_completes_with_reads_overlapping_within_their_bound(
    nats_server, s3_server, bucket, settings_for
):
    uris = upload_images(s3_server.client(), bucket, 24)
    with shaped(s3_server, seed=1) as proxy:
        settings = worker_settings(settings_for, nats_server, proxy)
        results, retries, _reads, stats = await run_job(settings, proxy, "job-shaped", uris)
    assert Counter(r["status"] for r in results) == {"ok": len(uris)}
    assert sorted(path for _conn, path, _fate in stats["gets"]) == sorted(
        "/" + uri.removeprefix("s3://") for uri in uris
    )
    assert retries == {}
    # One loader child with four reads: several objects on the wire at once, never more.
    assert 2 <= stats["max_in_flight"] <= 4


async def test_a_stalled_read_is_made_again_on_a_new_connection_and_throttling_is_retried(
    nats_server, s3_server, bucket, settings_for
):
    uris = upload_images(s3_server.client(), bucket, 6)
    # The first GET gets no byte at all, the second a 503 SlowDown.
    with shaped(s3_server, stall_first=1, throttle_first=1, stall_s=30) as proxy:
        settings = worker_settings(settings_for, nats_server, proxy)
        results, retries, _reads, stats = await run_job(settings, proxy, "job-stalled", uris)
    assert Counter(r["status"] for r in results) == {"ok": len(uris)}
    assert retries == {"stalled": 1, "throttled": 1}
    gets = stats["gets"]
    (stalled_conn, stalled_path, _), (_, throttled_path, _) = gets[0], gets[1]
    assert [fate for *_, fate in gets[:2]] == ["stalled", "throttled"]
    again = [conn for conn, path, fate in gets[2:] if path == stalled_path and fate == "ok"]
    assert again and all(conn != stalled_conn for conn in again)
    assert any(path == throttled_path and fate == "ok" for _c, path, fate in gets[2:])
    assert len(gets) == len(uris) + 2  # one more GET per retry, none lost, none repeated


async def test_bytes_held_for_reads_stay_under_their_cap(
    nats_server, s3_server, bucket, settings_for
):
    s3 = s3_server.client()
    uris = upload_images(s3, bucket, 16)
    sizes = [
        s3.head_object(Bucket=bucket, Key=uri.split("/", 3)[3])["ContentLength"] for uri in uris
    ]
    cap = 2 * max(sizes)  # room for two of the largest: the other reads wait for it
    with shaped(s3_server, bytes_per_s=2e6) as proxy:
        settings = worker_settings(
            settings_for, nats_server, proxy, reads_per_worker=8, read_bytes_per_worker=cap
        )
        results, _retries, (reads,), _stats = await run_job(settings, proxy, "job-capped", uris)
    assert Counter(r["status"] for r in results) == {"ok": len(uris)}
    assert max(sizes) <= reads.peak_bytes <= cap
    assert reads.held_bytes <= cap


def test_throttling_past_the_attempts_is_a_transient_error_and_the_next_read_succeeds(
    s3_server, bucket
):
    from config.errors import TransientError
    from datasets.budget import Reading
    from datasets.uris import SourceConfig, read_bytes

    (uri,) = upload_images(s3_server.client(), bucket, 1)
    with shaped(s3_server, throttle_first=3) as proxy:
        config = SourceConfig(
            s3_endpoint_url=proxy.url,
            connect_timeout_s=1,
            read_timeout_s=2,
            max_attempts=3,
            object_deadline_s=20,
        )
        reading = Reading()
        with pytest.raises(TransientError) as raised:
            read_bytes(uri, config, reading)
        assert raised.value.kind == "s3_unavailable" and "SlowDown" in str(raised.value)
        assert reading.retries == ["throttled", "throttled"]  # three attempts, no more
        assert [fate for *_, fate in proxy.stats()["gets"]] == ["throttled"] * 3
        key = uri.split("/", 3)[3]
        body = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        assert read_bytes(uri, config) == body  # S3 answers again: so does the read


def read_through(shape: Shape, **config):
    """One http read of a local image server behind ``shape``: what it returned (or the
    transient error it raised), the retries it made, and the network's GETs."""
    from config.errors import TransientError
    from datasets.budget import Reading
    from datasets.uris import SourceConfig, read_bytes
    from tests.listeners import Listener

    reading = Reading()
    with Listener(b"IMAGE") as listener, ShapedProxy(listener.port, shape) as proxy:
        sources = SourceConfig(allowed_hosts=frozenset({"127.0.0.1"}), max_attempts=3, **config)
        try:
            got: object = read_bytes(proxy.url + "/image.jpg", sources, reading)
        except TransientError as error:
            got = error
        return got, reading.retries, proxy.stats()["gets"]


def test_an_http_read_that_stalls_then_is_throttled_is_made_again_and_completes():
    faults = Shape(
        first_byte_median_s=0.0, bytes_per_s=0.0, stall_first=1, throttle_first=1, stall_s=30
    )
    got, retries, gets = read_through(faults, http_timeout_s=1.0, object_deadline_s=20)
    assert got == b"IMAGE"
    assert retries == ["stalled", "throttled"]
    assert [fate for *_, fate in gets] == ["stalled", "throttled", "ok"]


def test_no_attempt_is_started_that_the_objects_deadline_cannot_hold():
    from config.errors import TransientError

    stall = Shape(first_byte_median_s=0.0, bytes_per_s=0.0, stall_first=1, stall_s=30)
    # A 1 s stall leaves 0.5 s of the deadline: less than a whole attempt (1 s + 1 s).
    got, retries, gets = read_through(
        stall, connect_timeout_s=1.0, http_timeout_s=1.0, object_deadline_s=1.5
    )
    assert isinstance(got, TransientError)
    assert [fate for *_, fate in gets] == ["stalled"]  # one attempt, none past the deadline
    assert retries == []

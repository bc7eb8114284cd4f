"""Numbers per pipeline: the task outcomes and the batch stages carry the served pipeline's
name, with values bounded to what the process serves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from worker.health.liveness import Liveness
from worker.health.metrics import Metrics


def test_each_served_pipeline_has_its_series_from_the_start_and_counts_its_own():
    metrics = Metrics(CollectorRegistry(), Liveness(60.0), pipelines=("moths", "orders"))
    metrics.count_task("error", "moths")
    metrics.observe_stage("infer", "orders", 0.2)

    text = generate_latest(metrics.registry).decode()
    assert 'inference_worker_tasks_total{outcome="error",pipeline="moths"} 1.0' in text
    assert 'inference_worker_tasks_total{outcome="ok",pipeline="orders"} 0.0' in text
    assert (
        'inference_worker_batch_duration_seconds_count{pipeline="orders",stage="infer"} 1.0' in text
    )
    assert (
        'inference_worker_batch_duration_seconds_count{pipeline="moths",stage="load"} 0.0' in text
    )


def test_a_pipeline_this_process_does_not_serve_makes_no_series_of_its_own():
    """What a task names is untrusted: a thousand names make one ``other`` series, not a
    thousand."""
    metrics = Metrics(CollectorRegistry(), Liveness(60.0), pipelines=("moths",))
    for i in range(1000):
        metrics.count_task("ok", f"made-up-{i}")
        metrics.observe_stage("store", f"made-up-{i}", 0.01)

    text = generate_latest(metrics.registry).decode()
    assert "made-up" not in text
    assert 'inference_worker_tasks_total{outcome="ok",pipeline="other"} 1000.0' in text
    assert (
        'inference_worker_batch_duration_seconds_count{pipeline="other",stage="store"} 1000.0'
        in text
    )

"""Fair share across jobs: which waiting tasks make the next batch."""

from __future__ import annotations

from worker.core.fairshare import FairQueue


def test_a_small_job_behind_a_big_one_gets_the_next_batch():
    queue: FairQueue[str] = FairQueue()
    for i in range(240):
        queue.add(("p", "big"), f"big-{i}")
    first = queue.next_batch(16)
    for i in range(5):
        queue.add(("p", "small"), f"small-{i}")
    second = queue.next_batch(16)
    assert first == [f"big-{i}" for i in range(16)]
    # the small job goes first; the batch is topped up from the big one (same pipeline)
    assert second[:5] == [f"small-{i}" for i in range(5)]
    assert second[5:] == [f"big-{i}" for i in range(16, 27)]


def test_jobs_get_batches_in_proportion_to_their_weights():
    weights = {("p", "a"): 1.0, ("p", "b"): 3.0}
    queue: FairQueue[str] = FairQueue(weights.__getitem__)
    for _ in range(400):
        queue.add(("p", "a"), "a")
        queue.add(("p", "b"), "b")
    served = [item for _ in range(40) for item in queue.next_batch(4)]
    share_b = served.count("b") / len(served)
    assert 0.70 <= share_b <= 0.80


def test_equal_jobs_alternate_and_a_batch_never_mixes_pipelines():
    queue: FairQueue[tuple[str, int]] = FairQueue()
    for i in range(20):
        queue.add(("classify", "j1"), ("classify", i))
        queue.add(("detect", "j2"), ("detect", i))
    pipelines = []
    while batch := queue.next_batch(4):
        assert len({pipeline for pipeline, _ in batch}) == 1
        pipelines.append(batch[0][0])
    assert pipelines == ["classify", "detect"] * 5
    assert len(queue) == 0


def test_taking_a_pipeline_leaves_the_others():
    queue: FairQueue[str] = FairQueue()
    queue.add(("a", "j"), "a1")
    queue.add(("b", "j"), "b1")
    queue.add(("a", "k"), "a2")
    assert sorted(queue.take_pipeline("a")) == ["a1", "a2"]
    assert queue.next_batch(4) == ["b1"]

"""Models on demand under a memory budget: what is loaded, what is unloaded, and when."""

from __future__ import annotations

import threading

import pytest

from config.errors import ConfigError, ModelLoadFailed, PermanentError, TransientError
from pipelines.cache import ModelCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def a_cache(sizes: dict[str, int], budget: int, clock: Clock | None = None, fail=()):
    loads: list[str] = []
    unloaded: list[str] = []

    def load(name: str) -> str:
        if name in fail:
            raise fail[name]
        loads.append(name)
        return f"model-{name}"

    cache: ModelCache[str] = ModelCache(
        load,
        lambda model: sizes[model.removeprefix("model-")],
        budget,
        unloaded=unloaded.append,
        clock=clock or Clock(),
    )
    return cache, loads, unloaded


def test_the_least_recently_used_pipeline_makes_room_for_another():
    cache, loads, unloaded = a_cache({"a": 4, "b": 4, "c": 4}, budget=10)
    for name in ("a", "b"):
        cache.acquire(name)
        cache.release(name)
    cache.acquire("a")  # a is now the most recent
    cache.release("a")
    cache.acquire("c")
    assert unloaded == ["b"] and list(cache.resident()) == ["a", "c"]
    assert cache.stats.evictions == {"b": 1} and loads == ["a", "b", "c"]


def test_a_pipeline_in_use_is_never_unloaded_even_over_the_budget():
    cache, _loads, unloaded = a_cache({"a": 6, "b": 6}, budget=10)
    assert cache.acquire("a") == "model-a"  # a batch holds it
    cache.acquire("b")
    assert unloaded == [] and set(cache.resident()) == {"a", "b"}
    cache.release("a")
    cache.release("b")
    cache.load("a")  # resident: no load, no eviction
    assert unloaded == []


def test_a_hit_does_not_load_again():
    cache, loads, _ = a_cache({"a": 1}, budget=10)
    for _ in range(3):
        cache.acquire("a")
        cache.release("a")
    assert loads == ["a"] and cache.stats.loads == {"a": 1}


def test_idle_pipelines_are_unloaded_after_the_idle_time_but_not_one_in_use():
    clock = Clock()
    cache, _loads, unloaded = a_cache({"a": 1, "b": 1}, budget=10, clock=clock)
    cache.acquire("a")
    cache.acquire("b")
    cache.release("b")
    clock.now = 100.0
    assert cache.unload_idle(60.0) == ["b"]
    assert unloaded == ["b"] and list(cache.resident()) == ["a"]


def test_a_failed_load_is_tried_again_at_every_ask_and_says_why():
    clock = Clock()
    cache, _loads, _ = a_cache(
        {"a": 1}, budget=10, clock=clock, fail={"a": TransientError("S3 is down")}
    )
    for tries in (1, 2):  # when to ask again is the caller's (worker.core.availability)
        with pytest.raises(ModelLoadFailed) as failed:
            cache.acquire("a")
        assert cache.stats.load_failures == {"a": tries}
    assert failed.value.failure.kind == "model_load_failed"
    assert failed.value.failure.reason == "load_failed"


def _refused_download() -> Exception:
    """How a model file's 403 reaches the cache: the runner's ConfigError around the read's."""
    try:
        try:
            raise PermanentError("GET https://host/m.pt: 403 Forbidden", kind="access_denied")
        except PermanentError as error:
            raise ConfigError(f"pipeline 'a' cannot be loaded: {error}") from None
    except ConfigError as wrapped:
        return wrapped


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (_refused_download(), "download_refused"),
        (PermanentError("no such key", kind="object_missing"), "download_refused"),
        (
            ConfigError("WORKER_MODEL__CACHE_DIR: cannot write model files in /c: Read-only"),
            "cache_unwritable",
        ),
        (
            TransientError("WORKER_MODEL__CACHE_DIR: no space left", kind="model_load_failed"),
            "cache_unwritable",
        ),
        (RuntimeError("the plugin's own bug"), "load_failed"),
    ],
)
def test_a_failed_load_names_its_reason_of_the_host_or_the_file_host(error, reason):
    cache, _loads, _ = a_cache({"a": 1}, budget=10, fail={"a": error})
    with pytest.raises(ModelLoadFailed) as failed:
        cache.load("a")
    assert failed.value.failure.kind == "model_load_failed"
    assert failed.value.failure.reason == reason
    assert not failed.value.failure.retryable  # never a task's retry: the pipeline's state


def test_a_loaded_pipeline_is_acquired_while_another_one_loads():
    started, release = threading.Event(), threading.Event()
    sizes = {"a": 1, "slow": 1}

    def load(name: str) -> str:
        if name == "slow":
            started.set()
            assert release.wait(10), "the test never released the slow load"
        return f"model-{name}"

    cache: ModelCache[str] = ModelCache(load, lambda m: sizes[m.removeprefix("model-")], 10)
    cache.load("a")
    loading = threading.Thread(target=cache.load, args=("slow",), daemon=True)
    loading.start()
    assert started.wait(10)
    acquired: list[str] = []
    batch = threading.Thread(target=lambda: acquired.append(cache.acquire("a")), daemon=True)
    batch.start()
    batch.join(10)  # a download can take minutes: a batch of a loaded model never waits for it
    release.set()
    loading.join(10)
    assert acquired == ["model-a"] and set(cache.resident()) == {"a", "slow"}


def test_a_model_over_the_whole_budget_is_refused_and_not_kept():
    cache, _loads, unloaded = a_cache({"big": 20, "a": 1}, budget=10)
    cache.acquire("a")
    cache.release("a")
    with pytest.raises(ModelLoadFailed) as refused:
        cache.load("big")
    assert refused.value.failure.kind == "model_too_large"
    assert refused.value.failure.reason == "over_budget"
    assert not refused.value.failure.retryable
    assert "big" not in cache.resident() and "big" in unloaded


def test_what_pipelines_share_counts_once_against_the_budget():
    parts = {"a": {"detector": 6, "a": 2}, "b": {"detector": 6, "b": 2}, "c": {"c": 9}}

    def together(models: list[str]) -> int:
        held = {}
        for model in models:
            held.update(parts[model.removeprefix("model-")])
        return sum(held.values())

    cache: ModelCache[str] = ModelCache(
        lambda name: f"model-{name}",
        lambda model: together([model]),
        10,
        unloaded=(unloaded := []).append,
        clock=Clock(),
        together=together,
    )
    for name in ("a", "b"):
        cache.acquire(name)
        cache.release(name)
    assert unloaded == [] and list(cache.resident()) == ["a", "b"]  # 6 + 2 + 2 bytes
    cache.acquire("c")
    assert unloaded == ["a", "b"] and list(cache.resident()) == ["c"]


def test_a_retry_of_a_pipeline_that_failed_unloads_nothing_when_it_fails_again():
    """A pipeline's files refused (a 403) are tried again every 30..600 s: each retry that
    fails again leaves the idle pipelines it would have made room for loaded."""
    sizes = {"a": 6, "x": 6}
    refused = TransientError("403 from the file host", kind="access_denied")

    def load(name: str) -> str:
        if name == "x":
            raise refused
        return f"model-{name}"

    unloaded: list[str] = []
    cache: ModelCache[str] = ModelCache(
        load,
        lambda m: sizes[m.removeprefix("model-")],
        10,
        estimated_bytes={"x": 6},
        unloaded=unloaded.append,
    )
    with pytest.raises(ModelLoadFailed):
        cache.load("x")  # the first try makes room as for any load
    cache.load("a")
    unloaded.clear()
    for _retry in range(3):
        with pytest.raises(ModelLoadFailed):
            cache.load("x")
    assert unloaded == [] and list(cache.resident()) == ["a"]


def test_a_load_is_not_held_up_by_another_pipelines_slow_failing_download():
    """Pipeline x's files take minutes and are then refused: y loads meanwhile."""
    downloading, give_up = threading.Event(), threading.Event()

    def prefetch(name: str) -> None:
        if name == "x":
            downloading.set()
            assert give_up.wait(10), "the test never ended x's download"
            raise TransientError("403 from the file host", kind="access_denied")

    cache: ModelCache[str] = ModelCache(
        lambda name: f"model-{name}", lambda _m: 1, 10, prefetch=prefetch
    )
    failed: list[BaseException] = []

    def load_x() -> None:
        try:
            cache.load("x")
        except ModelLoadFailed as error:
            failed.append(error)

    x = threading.Thread(target=load_x, daemon=True)
    x.start()
    assert downloading.wait(10)
    y = threading.Thread(target=cache.load, args=("y",), daemon=True)
    y.start()
    y.join(10)  # bounded: behind x's download it would wait until give_up is set
    loaded_meanwhile = cache.ready("y")
    give_up.set()
    x.join(10)
    assert loaded_meanwhile and list(cache.resident()) == ["y"]
    assert len(failed) == 1 and failed[0].failure.reason == "download_refused"

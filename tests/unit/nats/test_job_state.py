"""The job consumers' state and its one owner (``worker.nats.job_state``): the map of a round,
the room under the bound, the remakes owed, what deleted consumers delivered, the counts."""

from __future__ import annotations

import datetime

import pytest
from nats.js import api

from worker.nats.job_state import DONE_KEPT, JobConsumerState


def info(name: str, subject: str = "tasks.p.j") -> api.ConsumerInfo:
    now = datetime.datetime.now(datetime.UTC)
    config = api.ConsumerConfig(name=name, filter_subject=subject)
    return api.ConsumerInfo(name=name, stream_name="t", config=config, created=now)


def listing(*names: str) -> dict[str, api.ConsumerInfo]:
    return {name: info(name) for name in names}


def test_after_a_listing_the_map_is_the_listing_and_only_it_counts_against_the_bound():
    state = JobConsumerState(bound=3)
    # Given a round after a listing of two job consumers
    state.listed(listing("a", "b"))
    # Then both exist, and one more fits under the bound of 3
    assert sorted(state.consumers) == ["a", "b"] and state.existing == 2
    assert state.room()
    # When one is made
    assert state.made(info("c"))
    # Then there is no room left, and the map holds it
    assert not state.room() and "c" in state.consumers


def test_a_round_without_a_listing_counts_the_others_last_listed():
    state = JobConsumerState(bound=4)
    state.listed(listing("a", "b", "c"))
    # Given a round with no listing, one consumer known from hints, two others counted
    state.unlisted(listing("a"), others=2)
    assert state.room()
    assert state.made(info("d"))
    # Then the bound is reached, and the round's end counts the one made
    assert not state.room()
    state.round_done()
    assert state.existing == 4


def test_a_consumer_made_is_counted_once_found_or_listed_ones_not_at_all():
    state = JobConsumerState(bound=10)
    state.listed(listing("a"))
    assert not state.made(info("a"))  # add_consumer answered for one that was listed
    state.found(info("b"))  # made meanwhile by another process
    assert state.made(info("c"))
    assert not state.made(info("c"))  # made before, this round
    assert state.stats.made == 1 and sorted(state.consumers) == ["a", "b", "c"]


def test_a_deleted_consumer_leaves_the_map_is_remembered_and_counts_as_made_again():
    state = JobConsumerState(bound=10)
    state.listed(listing("a"))
    # When it is deleted, having delivered up to sequence 7
    state.deleted("a", "tasks.p.j", 7)
    # Then it is gone from the map, and what it delivered is known by its subject
    assert "a" not in state.consumers and state.stats.deleted == 1
    assert state.deleted_here("tasks.p.j") and state.delivered_by_deleted("tasks.p.j") == 7
    assert state.delivered_by_deleted("tasks.p.other") == 0
    # And made again, it counts as made
    assert state.made(info("a"))
    state.round_done()
    assert state.existing == 1 and state.stats.made == 1


def test_deleted_consumers_are_remembered_within_a_bound_the_oldest_forgotten_first():
    state = JobConsumerState(bound=10)
    for i in range(DONE_KEPT + 1):
        state.deleted(f"c{i}", f"tasks.p.j{i}", i + 1)
    assert not state.deleted_here("tasks.p.j0") and state.deleted_here(f"tasks.p.j{DONE_KEPT}")


def test_a_remake_owed_is_kept_until_paid():
    state = JobConsumerState(bound=10)
    state.owe("tasks.p.j1", 42)
    state.owe("tasks.p.j2", 9)
    assert state.owes("tasks.p.j1") and state.owed() == [("tasks.p.j1", 42), ("tasks.p.j2", 9)]
    state.paid("tasks.p.j1")
    assert not state.owes("tasks.p.j1") and state.owed() == [("tasks.p.j2", 9)]


def test_a_refusal_is_said_until_a_consumer_is_made_or_nothing_waits():
    state = JobConsumerState(bound=10)
    assert state.refused("limit reached")
    assert not state.refused("limit reached again")  # logged once while they last
    assert state.refusal == "limit reached again" and state.stats.refused == 2
    state.made(info("a"))
    assert state.refusal is None
    state.refused("limit reached")
    state.refusal_over()
    assert state.refusal is None


def test_the_map_and_the_counts_are_read_only_to_those_who_ask():
    state = JobConsumerState(bound=10)
    state.listed(listing("a"))
    with pytest.raises(TypeError):
        state.consumers["b"] = info("b")  # type: ignore[index]
    state.stats.made = 99  # a copy: the state's own count is untouched
    state.count_updated()
    assert state.stats.made == 0 and state.stats.updated == 1


def test_updates_replace_the_map_entries_and_the_bound_is_set_at_start():
    state = JobConsumerState(bound=10)
    state.listed(listing("a"))
    newer = info("a", subject="tasks.p.k")
    state.updated({"a": newer})
    assert state.consumers["a"] is newer
    state.bounded(1)
    assert state.bound == 1 and not state.room()

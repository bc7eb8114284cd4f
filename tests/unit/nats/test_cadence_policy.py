"""The listing cadence: idle listings double the interval up to the bound; work, or anything
that makes the process not quiet, brings it back to the base at once."""

from __future__ import annotations

from worker.nats.listing_cadence import ListingCadence


def test_idle_listings_double_the_interval_up_to_the_bound():
    cadence = ListingCadence(1.0, 10.0)
    seen = []
    for _ in range(6):
        cadence.listed(quiet=True)
        seen.append(cadence.interval_s)
    assert seen == [2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_a_task_fetched_brings_the_base_back_at_once_and_for_the_next_listing():
    cadence = ListingCadence(1.0, 10.0)
    for _ in range(4):
        cadence.listed(quiet=True)
    cadence.worked()
    assert cadence.interval_s == 1.0
    cadence.listed(quiet=True)  # the listing after the work: not idle since the last one
    assert cadence.interval_s == 1.0
    cadence.listed(quiet=True)
    assert cadence.interval_s == 2.0


def test_not_quiet_keeps_the_base_and_a_bound_at_the_base_never_backs_off():
    cadence = ListingCadence(1.0, 10.0)
    cadence.listed(quiet=True)
    cadence.listed(quiet=False)  # a message in hand, or the hints not subscribed
    assert cadence.interval_s == 1.0
    today = ListingCadence(1.0, 0.5)
    for _ in range(3):
        today.listed(quiet=True)
    assert today.interval_s == 1.0

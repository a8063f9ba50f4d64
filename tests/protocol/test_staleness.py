"""Staleness gate: the capacity formula keeps every trained group within max_staleness versions."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol.staleness import group_capacity, is_too_stale, staleness, staleness_histogram

versions_lists = st.lists(st.integers(-1, 20), max_size=12)


# --- staleness of a sample


def test_staleness_hand_examples():
    assert staleness(6, [5, -1, 3, 6]) == 3
    assert staleness(6, []) == 0
    assert staleness(6, [-1, -1]) == 0
    assert staleness(4, [4, 4]) == 0


@given(trainer=st.integers(0, 25), versions=versions_lists, tool=st.lists(st.just(-1), max_size=4))
def test_staleness_is_lag_of_oldest_generated_token_and_ignores_tool_tokens(trainer, versions, tool):
    generated = [v for v in versions if v >= 0]
    expected = max(0, trainer - min(generated)) if generated else 0
    assert staleness(trainer, versions) == expected
    assert staleness(trainer, tool + versions + tool) == expected


@given(trainer=st.integers(0, 25), versions=versions_lists, eta=st.integers(0, 6))
def test_is_too_stale_is_a_strict_threshold(trainer, versions, eta):
    assert is_too_stale(trainer, versions, eta) == (staleness(trainer, versions) > eta)


def test_is_too_stale_boundary():
    assert not is_too_stale(5, [3, 4, -1], max_staleness=2)
    assert is_too_stale(5, [2, 4, -1], max_staleness=2)
    assert not is_too_stale(5, [-1], max_staleness=0)


def test_histogram_hand_example():
    assert staleness_histogram(5, [[5, 5, -1, 4], [3, -1], []]) == {0: 2, 1: 1, 2: 1}
    assert staleness_histogram(5, []) == {}


@given(trainer=st.integers(0, 25), samples=st.lists(versions_lists, max_size=5))
def test_histogram_counts_every_generated_token_once(trainer, samples):
    hist = staleness_histogram(trainer, samples)
    assert sum(hist.values()) == sum(v >= 0 for s in samples for v in s)
    assert max(hist, default=0) == max((staleness(trainer, s) for s in samples), default=0)


# --- capacity


def test_capacity_hand_examples():
    # (1 + 0 + 1)·4
    assert group_capacity(0, 1, 4, started_groups=0) == 8
    assert group_capacity(0, 1, 4, started_groups=8) == 0
    # never negative
    assert group_capacity(0, 1, 4, started_groups=11) == 0
    # (2 + 3 + 1)·2 − 7
    assert group_capacity(3, 2, 2, started_groups=7) == 5
    assert group_capacity(3, 2, 2, started_groups=7, max_in_flight=4, running_groups=1) == 3
    assert group_capacity(3, 2, 2, started_groups=7, max_in_flight=4, running_groups=6) == 0


@pytest.mark.parametrize(
    ("kwargs", "name", "bound"),
    [
        ({"max_staleness": -1}, "max_staleness", ">= 0"),
        ({"groups_per_version": 0}, "groups_per_version", ">= 1"),
        ({"started_groups": -1}, "started_groups", ">= 0"),
        ({"current_version": -2}, "current_version", ">= 0"),
        ({"max_in_flight": -1}, "max_in_flight", ">= 0"),
    ],
)
def test_capacity_rejects_bad_arguments(kwargs, name, bound):
    args = {"current_version": 0, "max_staleness": 1, "groups_per_version": 2, "started_groups": 0} | kwargs
    with pytest.raises(ValueError, match=f"{name} must be {bound}"):
        group_capacity(**args)
    if name == "max_staleness":
        with pytest.raises(ValueError, match="max_staleness must be >= 0"):
            is_too_stale(0, [0], -1)


@given(b=st.integers(1, 8), versions=st.integers(1, 10))
def test_zero_staleness_admits_exactly_b_groups_per_version(b, versions):
    started = 0
    for v in range(versions):
        admitted = group_capacity(v, 0, b, started)
        assert admitted == b
        started += admitted
        assert group_capacity(v, 0, b, started) == 0


def _simulate(
    eta: int,
    b: int,
    max_in_flight: int | None,
    rng: random.Random,
    starts_per_tick: int | None,
    max_delay: int,
    versions: int = 10,
) -> tuple[list[int], list[int], int]:
    """Rollout starts groups while the gate allows; each finishes after a random delay; the trainer consumes
    groups in start order (FIFO), exactly B per version, as soon as the next B have all finished.
    Returns (start version of each group, staleness of each consumed group, peak running)."""
    start_version: list[int] = []
    finish_tick: list[int] = []
    trained: list[int] = []
    version = consumed = peak = 0
    for tick in range(100_000):
        attempts = 10**9 if starts_per_tick is None else rng.randint(0, starts_per_tick)
        for _ in range(attempts):
            running = sum(f > tick for f in finish_tick[consumed:])
            if group_capacity(version, eta, b, len(start_version), max_in_flight, running) == 0:
                break
            start_version.append(version)
            finish_tick.append(tick + rng.randint(1, max_delay))
            peak = max(peak, running + 1)
        while len(start_version) - consumed >= b and all(f <= tick for f in finish_tick[consumed : consumed + b]):
            trained += [version - s for s in start_version[consumed : consumed + b]]
            consumed += b
            version += 1
            if version == versions:
                return start_version, trained, peak
    raise AssertionError("simulation made no progress: the gate starved the trainer")


@settings(max_examples=80, deadline=None)
@given(
    eta=st.integers(0, 3),
    b=st.integers(1, 4),
    max_in_flight=st.none() | st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    starts_per_tick=st.none() | st.integers(1, 6),
    max_delay=st.integers(1, 6),
)
def test_capacity_keeps_every_trained_group_within_max_staleness(
    eta, b, max_in_flight, seed, starts_per_tick, max_delay
):
    rng = random.Random(seed)
    starts, trained, peak = _simulate(eta, b, max_in_flight, rng, starts_per_tick, max_delay)
    assert trained and max(trained) <= eta
    if max_in_flight is not None:
        assert peak <= max_in_flight
    # synchronous: exactly B groups start under each version
    if eta == 0:
        assert set(Counter(starts[: len(trained)]).values()) == {b}


@given(eta=st.integers(0, 3), b=st.integers(1, 4), seed=st.integers(0, 2**32 - 1), max_delay=st.integers(1, 6))
@settings(max_examples=30, deadline=None)
def test_greedy_rollout_reaches_exactly_max_staleness(eta, b, seed, max_delay):
    """The bound is tight: a rollout that starts everything the gate allows trains some group exactly η behind."""
    _, trained, _ = _simulate(eta, b, None, random.Random(seed), None, max_delay)
    assert max(trained) == eta

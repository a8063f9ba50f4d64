"""The long-tail repack policy (services/rollout/groups/repack_policy.py): pure functions, and the config keys that
drive it."""

from __future__ import annotations

import pytest

from services.rollout.groups.repack_policy import GroupTail, capacity, choose, claim_cap, pick_target
from shared.protocol.episode.errors import EventError
from shared.protocol.streams import repacks
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.sources import load

# a worker generating 16 episodes when full
CAP = 16


def test_off_by_default_and_when_no_room():
    groups = [GroupTail("g1", (100,))]
    assert choose(groups, CAP, below=0.0, min_tokens=10, room=4) == []
    assert choose(groups, CAP, below=0.25, min_tokens=10, room=0) == []
    assert load(env={}).repack_below == 0.0 and load(env={}).rollout_role == "normal"


def test_only_once_the_batch_has_mostly_finished():
    # 6 generating > 0.25 x 16
    busy = [GroupTail(f"g{i}", (50, 50)) for i in range(3)]
    assert choose(busy, CAP, below=0.25, min_tokens=10, room=4) == []
    # 4 <= 4
    tail = [GroupTail("g0", (50, 50)), GroupTail("g1", (60,)), GroupTail("g2", (70,))]
    assert choose(tail, CAP, below=0.25, min_tokens=10, room=4) == ["g2", "g1", "g0"]
    # nothing generating: nothing to move
    assert choose([], CAP, below=0.25, min_tokens=10, room=4) == []


def test_a_group_needs_a_long_episode_and_nothing_waiting_on_a_job():
    groups = [
        GroupTail("short", (5, 9)),
        GroupTail("long", (3, 40)),
        GroupTail("tool", (80,), waiting=1),
        GroupTail("done", ()),
    ]
    assert choose(groups, CAP, below=0.5, min_tokens=10, room=4) == ["long"]
    assert choose(groups, CAP, below=0.5, min_tokens=9, room=4) == ["long", "short"]


def test_longest_tail_first_up_to_the_targets_room():
    groups = [GroupTail("a", (20,)), GroupTail("b", (90,)), GroupTail("c", (50,))]
    assert choose(groups, CAP, below=0.25, min_tokens=10, room=2) == ["b", "c"]


def test_capacity_is_the_smaller_of_the_batch_and_the_groups():
    assert capacity(64, 8, 8) == 64 and capacity(16, 8, 8) == 16 and capacity(64, 2, 4) == 8


def test_the_target_is_the_live_longtail_worker_with_most_room():
    workers = {
        "A": {"role": "normal", "room": "8"},
        "L1": {"role": "longtail", "room": "2"},
        "L2": {"role": "longtail", "room": "5"},
        "L3": {"role": "longtail", "room": "9", "paused": "1"},
        "L4": {"role": "longtail", "room": "0"},
        "old": {"version": "0"},
    }
    assert pick_target(workers, "A") == ("L2", 5)
    # never itself
    assert pick_target(workers, "L2") == ("L1", 2)
    assert pick_target({"A": {"role": "normal", "room": "8"}}, "B") is None


def test_a_longtail_worker_fills_its_share_with_new_groups():
    assert claim_cap("normal", 8, 0.5) == 8
    assert claim_cap("longtail", 8, 0.5) == 4 and claim_cap("longtail", 3, 0.5) == 2
    assert claim_cap("longtail", 8, 0.0) == 0 and claim_cap("longtail", 8, 1.0) == 8


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("rollout_role", "tail", "expected 'normal' or 'longtail'"),
        ("repack_below", "1.5", "expected a fraction 0 <= x < 1"),
        ("repack_min_tokens", "0", "expected an integer >= 1"),
        ("longtail_claim_share", "-0.1", "expected a fraction 0 <= x <= 1"),
    ],
)
def test_bad_keys_are_named(key, value, expected):
    with pytest.raises(ConfigError, match=f"'{key}'.*{expected}"):
        load(env={f"STREAMRL_{key.upper()}": value})


def test_a_notice_round_trips_and_a_bad_one_names_its_field():
    r = repacks.Repack("s", "1-0", "g1", "A", "L", 2, 77, 12.5)
    assert repacks.decode("9-0", repacks.encode(r)) == repacks.Repack("s", "1-0", "g1", "A", "L", 2, 77, 12.5, "9-0")
    with pytest.raises(EventError, match="entry 9-0: field 'target'"):
        repacks.decode("9-0", {**repacks.encode(r), "target": ""})
    with pytest.raises(EventError, match="field 'step_ms'"):
        repacks.decode("9-0", {**repacks.encode(r), "step_ms": "fast"})

"""Which commits a restore re-trains, and with what (services/trainer/state/replay.py, state/commit.py): pure."""

from __future__ import annotations

import pytest

from services.trainer.state import commit, replay


def _line(v: int, batches=None) -> dict:
    return commit.record(v, v, [f"g{v}"], [], batches if batches is not None else [[[f"g{v}", 2]]], {"x": v})


def test_the_commits_after_the_snapshot_in_order_and_their_steps_with_episode_ids():
    own = commit.batch_of([("a", ["a-0", "a-1"]), ("b", ["b-0", "x-7"])])
    # a group's own episodes are kept as a count; anything else as the ids
    assert own == [["a", 2], ["b", ["b-0", "x-7"]]]
    records = [_line(1), {"version": 1, "step": 1, "groups": [], "skipped": ["s"]}, _line(3), _line(2, [own, own])]
    lines = replay.commits_after(records, 1)
    assert [line["commit"] for line in lines] == [2, 3]
    assert replay.steps_of(lines[0]) == [[("a", ["a-0", "a-1"]), ("b", ["b-0", "x-7"])]] * 2
    assert replay.commits_after(records, 3) == []


def test_a_gap_in_the_commits_or_a_line_without_batches_is_refused_naming_the_version():
    with pytest.raises(
        replay.ReplayError, match="commit 2 is missing .*next line is commit 3.*snapshot is at version 1"
    ):
        replay.commits_after([_line(1), _line(3)], 1)
    old = {"commit": 2, "version": 2, "step": 2, "groups": ["g"], "skipped": []}
    with pytest.raises(replay.ReplayError, match="commit 2 has no 'batches'.*snapshot is\\s+at version 1"):
        replay.commits_after([_line(1), old], 1)
    # level with the snapshot: nothing to re-train, whatever the older lines hold
    assert replay.commits_after([old], 2) == []

"""`streamrl episodes`: one summary per episode stream (pure), the filters and sorts, and the command on a real
server printing the ids `streamrl replay` takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.ops.inspect.episodes import Filters, ordered, summarize
from shared.protocol.episode.events import Event
from tests.support.helpers import finished, raw, started, tokens


def _aborted(seq, n, worker="A"):
    return Event("aborted", 1, worker, seq, {"reason": "pause", "num_tokens": n})


def _resumed(seq, n, worker, **data):
    return Event("resumed", 2, worker, seq, {"num_tokens": n, **data})


# episode id -> events
STREAMS = {
    "g1-0": [started(episode_id="g1-0"), tokens(1, [1, 2], policy=1), finished(2, reward=1.0)],
    "g1-1": [
        started(episode_id="g1-1"),
        tokens(1, [1, 2], policy=1),
        _aborted(2, 2),
        _resumed(3, 2, "A"),
        tokens(4, [3], policy=2),
        _aborted(5, 3),
        _resumed(6, 3, "B", takeover_from="A"),
        tokens(7, [4], policy=3),
        finished(8, reward=0.0),
    ],
    "g2-0": [
        started(episode_id="g2-0"),
        tokens(1, [5], policy=2),
        Event("failed", 2, "w", 2, {"error": "tool calc crashed", "where": "tool"}),
    ],
    "g2-1": [
        started(episode_id="g2-1"),
        tokens(1, [5, 6, 7], policy=2),
        Event("finished", 2, "w", 2, {"reason": "length", "reward": 0.0, "details": {}}),
    ],
}


def _summaries():
    return {eid: summarize(eid, raw(evs)) for eid, evs in STREAMS.items()}


def test_a_summary_counts_what_the_stream_says():
    s = _summaries()
    assert (s["g1-0"].outcome, s["g1-0"].reward, s["g1-0"].versions, s["g1-0"].aborts) == ("finished", 1.0, [1], 0)
    assert (s["g1-1"].aborts, s["g1-1"].takeovers, s["g1-1"].versions, s["g1-1"].span) == (2, 1, [1, 2, 3], 3)
    assert s["g2-0"].outcome == "failed" and "tool calc crashed" in s["g2-0"].error
    assert s["g2-1"].outcome == "truncated" and s["g2-1"].length == 3
    # no started event: fold refuses it
    bad = summarize("g9-0", raw([tokens(0, [1])]))
    assert bad.outcome == "unreadable" and bad.error


def test_filters_and_sorts_choose_the_rows():
    rows = list(_summaries().values())
    pick = lambda **kw: sorted(s.episode_id for s in rows if Filters(**kw).keep(s))  # noqa: E731
    assert pick(outcomes=("failed", "truncated")) == ["g2-0", "g2-1"]
    # a failed episode has no reward: not below anything
    assert pick(reward_below=0.5) == ["g1-1", "g2-1"]
    assert pick(min_aborts=2) == pick(taken_over=True) == pick(min_span=3) == ["g1-1"]
    assert pick(agent=True) == [] and len(pick(agent=False)) == 4
    assert [s.episode_id for s in ordered(rows, "length", descending=True)][:1] == ["g1-1"]
    with pytest.raises(ValueError, match="--outcome: unknown lost"):
        Filters(outcomes=("lost",))
    with pytest.raises(ValueError, match="--sort"):
        ordered(rows, "size")


def test_the_command_prints_the_ids_replay_takes(cli_env, client, keys):
    for eid, evs in STREAMS.items():
        for _, fields in raw(evs):
            client.xadd(keys.episode(eid), fields)
    run = lambda *a: subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "episodes", *a],
        env=cli_env,  # noqa
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = run("--taken-over", "--ids")
    assert out.returncode == 0 and out.stdout.split() == ["g1-1"], out.stderr
    out = run("--outcome", "failed,truncated", "--json")
    assert sorted(r["episode_id"] for r in json.loads(out.stdout)) == ["g2-0", "g2-1"]
    out = run("--sort", "reward", "--desc", "--limit", "1")
    assert out.stdout.startswith("g1-0") and "4 episodes match; the first 1 shown" in out.stderr
    out = run("--outcome", "lost")
    assert out.returncode == 2 and "--outcome: unknown lost" in out.stderr

"""The archiver moves only old trained episodes, and a kill -9 at each point of the move loses none and
leaves none counted twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.archiver.mover import Mover
from services.archiver.select import due_groups, due_val_groups, old_groups, still_needed
from services.ops.check.data import read_run
from services.ops.cli.main import main
from shared.protocol.archive import segments
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams.samples import Sample, encode
from shared.runtime import faults
from tests.archiver.tiers_support import all_streams, make_run, write_episode

ROOT = Path(__file__).resolve().parents[2]


def test_old_groups_are_those_of_commits_retention_versions_behind():
    ledger = [{"commit": v, "version": v, "groups": [f"g{v}"], "skipped": [f"s{v}"]} for v in range(1, 6)]
    # an untrainable group judged between commits: no commit yet
    ledger.append({"groups": [], "skipped": ["u"]})
    assert old_groups(ledger, 2) == ["g1", "s1", "g2", "s2", "g3", "s3"]
    # off
    assert old_groups(ledger, 0) == []
    # known ones
    assert due_groups(ledger, {"g1": ["a", "b"], "g2": ["c"], "g5": ["d"]}, 3) == ["g1", "g2"]


def test_the_archiver_lets_go_of_ledger_lines_it_is_done_with():
    """A run of days has a ledger line per step: the archiver keeps only the window's lines and those with a group
    not moved whole yet, so what it holds and scans each step stays bounded."""
    ledger = [{"commit": v, "version": v, "groups": [f"g{v}"], "skipped": [f"s{v}"]} for v in range(1, 7)]
    # no commit: never acted on
    ledger.append({"groups": [], "skipped": ["u"]})
    # s2 not moved whole yet; 5 and 6 inside the window
    waiting = {"s2": ["e"], "g5": ["f"], "g6": ["h"]}
    assert [r.get("commit") for r in still_needed(ledger, waiting, 2)] == [2, 5, 6]
    # the newest line always stays
    assert [r.get("commit") for r in still_needed(ledger, {}, 2)] == [5, 6]


def _tiers(client, keys, folder, eids):
    store = segments.SegmentStore(folder)
    hot = {e for e in eids if client.exists(keys.episode(e))}
    return hot, set(store.ids()) & set(eids)


def _replays(redis_url, keys, run_dir: Path, eids, capsys) -> dict[str, str]:
    """`streamrl replay <episode> --json --no-text` of each episode: what an operator sees."""
    out = {}
    for eid in eids:
        rc = main(
            [
                "replay",
                eid,
                "--json",
                "--no-text",
                "--run",
                keys.run,
                "--run-dir",
                str(run_dir),
                "--redis-url",
                redis_url,
            ]
        )
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        out[eid] = captured.out
    return out


def test_the_mover_moves_trained_episodes_past_the_window_and_readers_see_one_log(
    client, keys, redis_url, tmp_path, capsys
):
    run_path = tmp_path / keys.run
    groups = make_run(client, keys, run_path, versions=6)
    eids = [e for es in groups.values() for e in es]
    before = all_streams(client, keys, eids)
    sample = eids[::3]
    # while in Redis
    replayed = _replays(redis_url, keys, tmp_path, sample, capsys)
    log = EpisodeLog(client, keys, "w2")
    # published nowhere, trained by no one: stays
    write_episode(log, "late", "g9", 6)
    client.hset(keys.call_index("g1-0"), "#n", 1)
    mover = Mover(client, keys, run_path, retention=2)
    # versions 1..4 (newest commit 6, window 2)
    assert mover.step() == 8
    hot, cold = _tiers(client, keys, run_path / "episodes", eids)
    assert cold == {e for g in ("g1", "g2", "g3", "g4") for e in groups[g]} and not hot & cold
    assert hot | cold == set(eids) and client.exists(keys.episode("late"))
    assert not client.exists(keys.call_index("g1-0"))
    reader = EpisodeLog(client, keys, "cli", archive=segments.SegmentStore(run_path / "episodes"))
    # byte-identical whichever tier holds it
    assert dict(zip(eids, reader.read_many(eids))) == before
    assert {e for e in sample if e in cold} and _replays(redis_url, keys, tmp_path, sample, capsys) == replayed
    # nothing new is due: the move is idempotent
    assert mover.step() == 0
    # the lines of moved groups are let go
    assert [r["commit"] for r in mover._ledger.records] == [5, 6]
    data = read_run(client, keys, run_path)
    assert set(eids) <= set(data.episodes)


def test_validation_rounds_retention_versions_behind_are_movable():
    published = {"val-v00005-g000": ["a"], "val-v00005-s000": ["b", "c"], "val-v00010-g000": ["d"], "q1": ["e"]}
    # round 5
    assert due_val_groups(published, newest=26, retention=20) == ["val-v00005-g000", "val-v00005-s000"]
    # off
    assert due_val_groups(published, newest=26, retention=0) == []


def test_validation_episodes_move_too_and_the_drivers_validation_reads_them_from_the_segments(client, keys, tmp_path):
    """Validation rounds are never in the trainer's ledger: without their own rule they stayed in Redis for good
    (most of the episode streams left in Redis on a 10,000-version run)."""
    from services.driver.validation import Validator

    run_path = tmp_path / keys.run
    make_run(client, keys, run_path, versions=6)
    log = EpisodeLog(client, keys, "w1")
    rows = [{"prompt": "1+1=", "answer": "2"}]
    # reward: version % 2
    for version in (3, 5):
        for kind, gid in (("g", f"val-v{version:05d}-g000"), ("s", f"val-v{version:05d}-s000")):
            write_episode(log, f"{gid}-0", gid, version)
            client.xadd(keys.val_samples, encode(Sample(gid, [f"{gid}-0"], "w1")))
    log.flush()
    mover = Mover(client, keys, run_path, retention=2)
    mover.step()
    # round 3 <= 6-2
    assert not client.exists(keys.episode("val-v00003-g000-0"), keys.episode("val-v00003-s000-0"))
    # round 5: inside the window
    assert client.exists(keys.episode("val-v00005-g000-0"))
    validator = Validator(client, keys, rows, every=1, size=1, archive=segments.SegmentStore(run_path / "episodes"))
    rounds = {r["version"]: r for r in validator.poll()}
    assert set(rounds) == {3, 5}
    assert rounds[3]["reward_greedy"] == rounds[3]["reward_mean"] == 1.0 and rounds[3]["token_version_max"] == 3


def test_an_episode_that_has_not_ended_is_never_moved(client, keys, tmp_path):
    log = EpisodeLog(client, keys, "w1")
    write_episode(log, "open", "g1", 1, end=False)
    client.xadd(keys.samples, encode(Sample("g1", ["open"], "w1")))
    from shared.protocol.archive.ledger import append_ledger

    for v in (1, 2, 3):
        append_ledger(tmp_path / "trainer", {"commit": v, "version": v, "groups": ["g1"] if v == 1 else []})
    assert Mover(client, keys, tmp_path, retention=1).step() == 0
    assert client.exists(keys.episode("open"))


_MOVE = """
import sys
from shared.runtime.connection import connect
from shared.protocol.keys import Keys
from services.archiver.mover import Mover
m = Mover(connect(sys.argv[1]), Keys(sys.argv[2]), sys.argv[3], retention=1, batch=int(sys.argv[4]))
m.recover()
m.step()
"""


@pytest.mark.parametrize("point", faults.POINTS["archiver"])
def test_kill_9_at_each_move_point_loses_nothing_and_counts_nothing_twice(point, client, keys, redis_url, tmp_path):
    groups = make_run(client, keys, tmp_path, versions=5, per_group=3)
    eids = [e for es in groups.values() for e in es]
    before = all_streams(client, keys, eids)
    # the second segment's move dies there
    env = {**os.environ, **faults.spec("archiver", point, 2)}
    proc = subprocess.run(
        [sys.executable, "-c", _MOVE, redis_url, keys.run, str(tmp_path), "5"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr
    folder = tmp_path / "episodes"
    reader = EpisodeLog(client, keys, "cli", archive=segments.SegmentStore(folder))
    # lost: 0, even right after the kill
    assert dict(zip(eids, reader.read_many(eids))) == before
    data = read_run(client, keys, tmp_path)
    # counted once each
    assert sorted(e for e in data.episodes if e in before) == sorted(eids)
    # the restarted archiver
    mover = Mover(client, keys, tmp_path, retention=1, batch=5)
    mover.recover()
    mover.step()
    hot, cold = _tiers(client, keys, folder, eids)
    assert not hot & cold, f"in both tiers after recovery: {sorted(hot & cold)}"
    assert cold == {e for g in ("g1", "g2", "g3", "g4") for e in groups[g]} and hot == set(groups["g5"])
    assert dict(zip(eids, reader.read_many(eids))) == before
    listed = [r["segment"] for r in segments.read_manifest(folder)]
    # no orphan left
    assert sorted(p.name for p in folder.glob("*seg-*")) == sorted(listed)


def test_a_read_whose_script_the_server_forgot_mid_pipeline_is_read_again_not_a_crash(
    client, keys, tmp_path, monkeypatch
):
    """After a Redis restart the client's retry re-sends a pipeline's EVALSHA to a server that never loaded the
    script (NoScriptError: the archiver exited on it under --chaos). Here the script cache is flushed right after the
    pipeline loaded it, once: the mover reads again and moves every due episode."""
    import redis

    run_path = tmp_path / keys.run
    groups = make_run(client, keys, run_path, versions=6)
    load = redis.client.Pipeline.load_scripts
    flushed = []

    def load_then_forget(pipe):
        load(pipe)
        if not flushed:
            flushed.append(True)
            client.script_flush()

    monkeypatch.setattr(redis.client.Pipeline, "load_scripts", load_then_forget)
    assert Mover(client, keys, run_path, retention=2).step() == 8 and flushed
    _, cold = _tiers(client, keys, run_path / "episodes", [e for es in groups.values() for e in es])
    assert cold == {e for g in ("g1", "g2", "g3", "g4") for e in groups[g]}

"""Weights pulled, not pushed (sync_mode = pull) with real rollout worker processes, the real Syncer loop, the real
weight server and relays over loopback HTTP, real Redis: the syncer only announces (no command on the control
stream), each worker fetches from its relay parent while it generates and loads at a cheap point of its own under
the load lease, never more than ``max_loading`` at once; a worker killed -9 holding the lease blocks the others only
until the lease expires, and nothing is lost or done twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.trainer.publish import publish
from shared.protocol import gate
from shared.protocol.streams import control, metrics, pulls
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import faults
from shared.runtime.weights.server import WeightServer
from tests.support.models import nudged_weights
from tests.support.procs import kill9, wait_until
from tests.support.rollout_harness import samples, worker_info
from tests.sync.test_rolling_sync import WORKERS, _generating, _syncs, _worker

# real rollout worker processes
pytestmark = pytest.mark.slow

HEARTBEAT_TTL = 3.0
# busy workers load a version this long after it was announced (the default, 10 s, only waits)
PULL_MAX_WAIT_S = 2.0


def _puller(redis_url, keys, model_dir, worker_id, tmp_path, *extra, env=None):
    return _worker(
        redis_url,
        keys,
        model_dir,
        worker_id,
        "--sync-mode",
        "pull",
        "--max-loading",
        "1",
        "--weights-fetch",
        "always",
        "--rollout-weights-dir",
        tmp_path / f"own-{worker_id}",
        "--relay-port",
        "-1",
        "--relay-fanout",
        "1",
        "--pull-max-wait-s",
        PULL_MAX_WAIT_S,
        *extra,
        env=env,
    )


def _versions(client, keys, workers) -> dict[str, int]:
    return {w: int(worker_info(client, keys, w).get("version", -1)) for w in workers}


def _last_report(client, keys, worker) -> dict:
    recs = [rec for _, rec in metrics.read(client, keys, "rollout") if rec.get("worker") == worker]
    return recs[-1] if recs else {}


def test_workers_pull_each_version_through_the_relay_chain_and_load_one_at_a_time_with_no_command(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    """Three relaying workers, fan-out 1 (a chain trainer -> A -> B -> C), busy with 40 groups. Two versions,
    announced one after the other: each worker asks its parent at once (the parent's relay waits for its own copy),
    loads when its policy says, under a lease of one; every worker ends generating with version 2; the trainer's
    server sends one copy per version; no fetch, pause, load or resume ever goes out."""
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    server = WeightServer(trainer_dir).start()
    start_syncer(sync_mode="pull")
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}+{i}=") for i in range(40)])
    procs = {w: _puller(redis_url, keys, tiny_model_dir, w, tmp_path) for w in WORKERS}
    try:
        wait_until(_generating(client, keys, WORKERS, 0), "all three generating", 90, procs.values())
        sizes = 0
        for v in (1, 2):
            path, digest = nudged_weights(tiny_model_dir, trainer_dir, v)
            sizes += path.stat().st_size
            publish(client, keys, v, path, digest, step=v, url_base=server.url)
            wait_until(lambda: len(_syncs(client, keys)) == v, f"every worker running version {v}", 90, procs.values())
            rec = _syncs(client, keys)[-1]
            assert rec["version"] == v and rec["sync_mode"] == "pull" and rec["workers"] == 3, rec
            assert set(_versions(client, keys, WORKERS).values()) == {v}
            assert gate.complete_version(client, keys) == v == gate.opened_version(client, keys)
            # one copy per version left the trainer: B and C got theirs from A, B
            assert server.sent_bytes == sizes
        wait_until(_generating(client, keys, WORKERS, 2), "all three generating with version 2", 60, procs.values())
        wait_until(
            lambda: all(_last_report(client, keys, w).get("pulled") == 2 for w in WORKERS),
            "every worker's metrics counting two pulled versions",
            30,
            procs.values(),
        )
    finally:
        kill9(*procs.values())
        server.stop()
    assert [e for _, e in control.read_after(client, keys, "0-0", 10_000) if isinstance(e, control.Command)] == []
    records = pulls.read_all(client, keys)
    assert pulls.most_holders(records) == 1
    loaded = sorted((p.worker, p.version) for p in records if p.event == "released")
    assert loaded == [(w, v) for w in WORKERS for v in (1, 2)]
    fetched = {(p.worker, p.version): p.extra["source"] for p in records if p.event == "fetched"}
    assert fetched == {(w, v): "trainer" if w == "A" else "relay" for w in WORKERS for v in (1, 2)}
    for w in WORKERS:
        report = _last_report(client, keys, w)
        assert report["pulled_from_relay"] == (0 if w == "A" else 2) and report["relay_fetches"] == (
            0 if w == "A" else 2
        ), report
        assert report["pulled_from_trainer"] == (2 if w == "A" else 0)
        assert 0 < report["pull_paused_s"] and 0 < report["pull_announced_max_s"] <= report["pull_announced_s"]


def test_a_worker_killed_holding_the_load_lease_blocks_the_others_only_until_it_expires_nothing_lost(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer, cli_env
):
    """B kills itself (kill -9, a crash point) right after it got the load lease of version 1; the lease (3 s)
    runs out, A and C load versions 1 and 2 with it one at a time, the gate is complete once B's heartbeat lapsed,
    A and C take over B's groups; `streamrl check` counts nothing lost and nothing twice."""
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    server = WeightServer(trainer_dir).start()
    start_syncer(sync_mode="pull")
    groups = [PromptGroup(f"g{i}", 2, prompt=f"{i}*2=") for i in range(12)]
    enqueue(client, keys, groups)
    crash = {**os.environ, **faults.spec("rollout", "pull_leased")}
    procs = {
        w: _puller(redis_url, keys, tiny_model_dir, w, tmp_path, "--load-lease-s", "3", env=crash if w == "B" else None)
        for w in WORKERS
    }
    alive = [procs["A"], procs["C"]]
    try:
        wait_until(_generating(client, keys, WORKERS, 0), "all three generating", 90, procs.values())
        publish(client, keys, 1, *nudged_weights(tiny_model_dir, trainer_dir, 1), step=1, url_base=server.url)
        wait_until(lambda: procs["B"].poll() is not None, "B killing itself with the lease", 60, alive)
        assert procs["B"].returncode == -9
        wait_until(lambda: _syncs(client, keys), "A and C at version 1, B let go", 60, alive)
        assert _versions(client, keys, ("A", "C")) == {"A": 1, "C": 1} and gate.complete_version(client, keys) == 1
        publish(client, keys, 2, *nudged_weights(tiny_model_dir, trainer_dir, 2), step=2, url_base=server.url)
        wait_until(lambda: len(_syncs(client, keys)) == 2, "A and C at version 2", 60, alive)
        wait_until(lambda: len(samples(client, keys)) == len(groups), "every group published", 120, alive)
    finally:
        kill9(*procs.values())
        server.stop()
    records = pulls.read_all(client, keys)
    assert pulls.most_holders(records) == 1
    held = [(p.event, p.worker) for p in records if p.event != "fetched"]
    assert ("acquired", "B") in held and ("expired", "B") in held and ("released", "B") not in held
    assert sorted((p.worker, p.version) for p in records if p.event == "released") == [
        ("A", 1),
        ("A", 2),
        ("C", 1),
        ("C", 2),
    ]
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g.group_id for g in groups)
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "check", "--json"],
        env=cli_env,
        capture_output=True,
        timeout=120,
    )
    report = json.loads(out.stdout)
    assert report["groups_lost"] == 0 and report["episodes_finished_twice"] == 0, report
    assert report["groups_enqueued_twice"] == 0 and report["samples_trained_twice"] == 0, report

"""Rolling version changes (sync_mode = rolling) with real rollout worker processes, the real Syncer loop, the real
weight server and relays over loopback HTTP, real Redis: generation never stops on every worker at once, every
worker ends at the newest version, a relay tree makes the trainer send one copy per version, and a worker killed
(kill -9) between its pause and its load loses nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.trainer.publish import publish
from shared.protocol import gate
from shared.protocol.episode.fold import fold
from shared.protocol.streams import control, metrics
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import faults
from shared.runtime.heartbeat import alive_of
from shared.runtime.weights.server import WeightServer
from tests.support.models import nudged_weights
from tests.support.procs import kill9, spawn, wait_until
from tests.support.rollout_harness import samples, worker_info

# real rollout worker processes
pytestmark = pytest.mark.slow

HEARTBEAT_TTL = 3.0
WORKERS = ("A", "B", "C")


def _worker(redis_url, keys, model_dir, worker_id, *extra, env=None):
    return spawn(
        "services.rollout",
        "--worker-id",
        worker_id,
        "--run",
        keys.run,
        "--redis-url",
        redis_url,
        "--model-dir",
        model_dir,
        "--max-tokens",
        "400",
        "--tools",
        "",
        "--flush-tokens",
        "4",
        "--flush-ms",
        "20",
        "--heartbeat-ttl",
        HEARTBEAT_TTL,
        "--step-delay-ms",
        "10",
        "--max-groups-in-flight",
        "2",
        "--log-level",
        "warning",
        "--sync-mode",
        "rolling",
        *extra,
        env=env,
    )


@pytest.fixture
def start_syncer(start_syncer):
    """tests/conftest.py's syncer threads, rolling, one worker loading at a time."""
    return lambda **overrides: start_syncer(
        **{"fetch_timeout": 20.0, "sync_mode": "rolling", "max_loading": 1, **overrides}
    )


def _versions_by_worker(client, keys) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for key in client.scan_iter(match=keys.episode("*")):
        for e in fold(client.xrange(key)).events:
            if e.kind == "tokens":
                out.setdefault(e.worker, set()).add(e.policy)
    return out


def _generating(client, keys, workers, version):
    return lambda: all(version in _versions_by_worker(client, keys).get(w, set()) for w in workers)


def _syncs(client, keys) -> list[dict]:
    return [rec for _, rec in metrics.read(client, keys, "sync")]


def _most_paused_at_once(client, keys, workers: set[str]) -> int:
    """From the order of the control stream alone (no clocks): a worker can be paused only between a pause command
    that names it (or everyone) and its own resume ack. The largest number of ``workers`` inside such a span at
    any point of the stream: an upper bound on how many of them were ever paused together."""
    paused: set[str] = set()
    most = 0
    for _, entry in control.read_after(client, keys, "0-0", 10_000):
        if isinstance(entry, control.Command) and entry.cmd == "pause":
            paused |= set(entry.targets or workers)
        elif isinstance(entry, dict) and entry["cmd"] == "resume":
            paused.discard(entry["worker"])
        most = max(most, len(paused & workers))
    return most


def test_rolling_update_through_a_relay_chain_never_pauses_every_worker_and_the_trainer_sends_one_copy(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    """Three workers with folders of their own, each relaying (a free port), relay_fanout 1: a chain trainer -> A
    -> B -> C. Two versions, each changed one worker at a time while the other two generate; the trainer's server
    sends each file once; every worker ends generating with version 2. Then the root relay dies: the next version
    reaches the other two through B."""
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    server = WeightServer(trainer_dir).start()
    start_syncer(relay_fanout=1)
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}+{i}=") for i in range(40)])
    procs = {
        w: _worker(
            redis_url,
            keys,
            tiny_model_dir,
            w,
            "--weights-fetch",
            "always",
            "--rollout-weights-dir",
            tmp_path / f"own-{w}",
            "--relay-port",
            "-1",
        )
        for w in WORKERS
    }
    try:
        wait_until(_generating(client, keys, WORKERS, 0), "all three generating", 90, procs.values())
        relays = {w: info["relay"] for w, info in alive_of(client, keys, "rollout").items()}
        assert set(relays) == set(WORKERS) and all(u.startswith("http://127.0.0.1:") for u in relays.values())
        sizes = 0
        for v in (1, 2):
            path, digest = nudged_weights(tiny_model_dir, trainer_dir, v)
            sizes += path.stat().st_size
            publish(client, keys, v, path, digest, step=v, url_base=server.url)
            wait_until(lambda: len(_syncs(client, keys)) == v, f"the sync of version {v}", 90, procs.values())
            rec = _syncs(client, keys)[-1]
            assert rec["version"] == v and rec["missing"] == [] and rec["refused"] == {}, rec
            assert rec["sync_mode"] == "rolling" and rec["waves"] == 3 and rec["fetch_levels"] == 3
            assert rec["generating_min"] == pytest.approx(2 / 3) and 0 < rec["max_paused_s"] <= rec["paused_s"]
            assert rec["relayed"] == {
                "B": f"{relays['A']}/weights/v{v:06d}.safetensors",
                "C": f"{relays['B']}/weights/v{v:06d}.safetensors",
            }
            # one copy per version left the trainer: B and C got theirs from A and B
            assert server.sent_bytes == sizes
        assert _most_paused_at_once(client, keys, set(WORKERS)) == 1
        assert gate.opened_version(client, keys) == 2
        wait_until(_generating(client, keys, WORKERS, 2), "all three generating with version 2", 60, procs.values())
        assert {w: worker_info(client, keys, w)["version"] for w in WORKERS} == {w: "2" for w in WORKERS}
        # the root relay dies (kill -9): whether the next sync still counts it live (its heartbeat key not lapsed
        # yet, then it is let go at its fetch) or not, B takes the root's place and C still gets its copy from B
        kill9(procs["A"])
        path, digest = nudged_weights(tiny_model_dir, trainer_dir, 3)
        publish(client, keys, 3, path, digest, step=3, url_base=server.url)
        wait_until(lambda: len(_syncs(client, keys)) == 3, "the sync of version 3", 90, [procs["B"], procs["C"]])
        rec = _syncs(client, keys)[-1]
        assert rec["missing"] in ([], ["A"]) and rec["refused"] == {}, rec
        assert rec["relayed"] == {"C": f"{relays['B']}/weights/v000003.safetensors"}
        assert server.sent_bytes == sizes + path.stat().st_size
        wait_until(
            _generating(client, keys, {"B", "C"}, 3), "B and C generating with version 3", 60, [procs["B"], procs["C"]]
        )
    finally:
        kill9(*procs.values())
        server.stop()
    # every load came after the worker's own pause, and each wave's pause after the previous wave's resume ack
    order = [
        (e.cmd, e.targets) if isinstance(e, control.Command) else (e["cmd"], e["worker"])
        for _, e in control.read_after(client, keys, "0-0", 10_000)
    ]
    for w in WORKERS:
        assert order.index(("load", w)) > order.index(("pause", w)) > order.index(("pause", (w,)))


def test_a_worker_killed_between_its_pause_and_its_load_the_others_change_and_take_its_groups_nothing_lost(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer, cli_env
):
    """B kills itself (kill -9, a crash point) right after acknowledging its wave's pause: the syncer lets it go when
    its heartbeat lapses, changes C, opens the gate; A and C take over B's groups; `streamrl check` counts nothing
    lost and nothing twice."""
    start_syncer()
    groups = [PromptGroup(f"g{i}", 2, prompt=f"{i}*2=") for i in range(12)]
    enqueue(client, keys, groups)
    crash = {**os.environ, **faults.spec("rollout", "paused")}
    procs = {w: _worker(redis_url, keys, tiny_model_dir, w, env=crash if w == "B" else None) for w in WORKERS}
    try:
        wait_until(_generating(client, keys, WORKERS, 0), "all three generating", 90, procs.values())
        path, digest = nudged_weights(tiny_model_dir, tmp_path, 1)
        publish(client, keys, 1, path, digest, step=1)
        wait_until(lambda: _syncs(client, keys), "the sync record", 60, [procs["A"], procs["C"]])
        (rec,) = _syncs(client, keys)
        assert procs["B"].wait(10) == -9
        assert rec["waves"] == 3 and rec["missing"] == ["B"] and rec["missing_why"] == {"B": "load: heartbeat lapsed"}
        acked = {
            (a["cmd"], a["worker"]) for _, a in control.read_after(client, keys, "0-0", 10_000) if isinstance(a, dict)
        }
        assert acked == {("fetch", w) for w in WORKERS} | {("pause", "B")} | {
            (c, w) for c in ("pause", "load", "resume") for w in ("A", "C")
        }
        assert _most_paused_at_once(client, keys, {"A", "C"}) == 1
        # both run version 1; the groups left (B's among them) are generated with it, by whichever has room (a
        # fast engine may have finished the others before the sync: then one of them takes B's two groups)
        wait_until(
            lambda: all(int(worker_info(client, keys, w).get("version", -1)) == 1 for w in ("A", "C")),
            "A and C running version 1",
            60,
            [procs["A"], procs["C"]],
        )
        wait_until(
            lambda: (
                1
                in _versions_by_worker(client, keys).get("A", set()) | _versions_by_worker(client, keys).get("C", set())
            ),
            "A or C generating with version 1",
            60,
            [procs["A"], procs["C"]],
        )
        wait_until(
            lambda: len(samples(client, keys)) == len(groups), "every group published", 120, [procs["A"], procs["C"]]
        )
    finally:
        kill9(*procs.values())
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


def test_the_gate_opens_after_the_first_wave_complete_after_the_last_a_syncer_killed_between_is_repaired(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    """The syncer process kills itself right after the first wave's resume (a crash point): A runs version 1 and
    generates with it, B still runs 0; the gate is open for version 1 but not complete, and B, on version 0,
    reserves only under version 0's limit (the gate's per-worker rule). A restarted syncer finds B behind,
    changes it, and marks the gate complete."""
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}-3=") for i in range(24)])
    procs = {w: _worker(redis_url, keys, tiny_model_dir, w) for w in ("A", "B")}
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "STREAMRL_RUN": keys.run,
        "STREAMRL_MODEL_DIR": tiny_model_dir,
        "STREAMRL_SYNC_MODE": "rolling",
        "STREAMRL_HEARTBEAT_TTL": str(HEARTBEAT_TTL),
        "STREAMRL_LOG_LEVEL": "warning",
        **faults.spec("syncer", "resume"),
    }
    try:
        wait_until(_generating(client, keys, {"A", "B"}, 0), "both generating", 90, procs.values())
        first = spawn("services.syncer", env=env)
        try:
            wait_until(lambda: client.exists(keys.gate), "the first syncer ready", 60, procs.values())
            publish(client, keys, 1, *nudged_weights(tiny_model_dir, tmp_path, 1), step=1)
            # right after the first wave's resume went out
            assert first.wait(60) == -9
        finally:
            kill9(first)
        loads = [
            (a["worker"], a["version"])
            for _, a in control.read_after(client, keys, "0-0", 10_000)
            if isinstance(a, dict) and a["cmd"] == "load"
        ]
        assert loads == [("A", "1")] and gate.opened_version(client, keys) == 1
        assert gate.complete_version(client, keys) == 0
        # A, changed, generates with version 1 under the new gate; B never stopped, on version 0's limit
        wait_until(_generating(client, keys, {"A"}, 1), "A generating with version 1", 60, procs.values())
        assert worker_info(client, keys, "B")["version"] == "0" and gate.complete_version(client, keys) == 0
        start_syncer()
        wait_until(lambda: _syncs(client, keys), "the repair sync", 60, procs.values())
        assert gate.opened_version(client, keys) == 1 and gate.complete_version(client, keys) == 1
        wait_until(_generating(client, keys, {"A", "B"}, 1), "both generating with version 1", 60, procs.values())
        assert _most_paused_at_once(client, keys, {"A", "B"}) == 1
    finally:
        kill9(*procs.values())

"""The syncer against real rollout worker processes: a worker killed mid-sync, a worker silent past
sync_timeout, version order, weights refused by checksum, versions coalesced into one sync, and the
recovery of a worker left paused (a lost resume) and of a lost gate."""

from __future__ import annotations

import os
import signal

import pytest

from services.trainer.publish import publish
from shared.protocol import gate
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams import control, metrics
from shared.protocol.streams import versions as pversions
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.heartbeat import alive_of
from tests.support.models import nudged_weights
from tests.support.procs import gone_worker_id, kill9, spawn, wait_until
from tests.support.rollout_harness import worker_info

# real rollout worker processes
pytestmark = pytest.mark.slow

HEARTBEAT_TTL = 3.0


def _worker(redis_url, keys, model_dir, worker_id, heartbeat_ttl=HEARTBEAT_TTL, step_delay_ms=10):
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
        heartbeat_ttl,
        "--step-delay-ms",
        step_delay_ms,
        "--max-groups-in-flight",
        "2",
        "--log-level",
        "warning",
    )


def _token_events(client, keys) -> list:
    """Every tokens event of the run: (entry id, worker, policy)."""
    out = []
    for key in client.scan_iter(match=keys.episode("*")):
        ep = fold(client.xrange(key))
        out += [(e.entry_id, e.worker, e.policy) for e in ep.events if e.kind == "tokens"]
    return out


def _entry_ms(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _commands(client, keys, cmd: str) -> list:
    """The control commands of one kind sent so far (acks left out)."""
    return [c for _, c in control.read_after(client, keys, "0-0", 1000) if getattr(c, "cmd", "") == cmd]


def _sync_records(client, keys) -> list[dict]:
    return [rec for _, rec in metrics.read(client, keys, "sync")]


def _generating(client, keys, workers: set[str], version: int):
    return lambda: {w for _, w, v in _token_events(client, keys) if v == version} >= workers


def test_worker_killed_mid_sync_others_resume_and_versions_order(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    start_syncer()
    # workers go on generating while a sync's fetch phase waits (for C here): groups enough to outlast the syncs
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}+{i}=") for i in range(16)])
    # 30 ms per step (a sleep, no CPU): with one torch thread the engine is fast enough that 10 ms steps could
    # finish every group before the second sync, leaving a survivor nothing to generate with version 2
    procs = {w: _worker(redis_url, keys, tiny_model_dir, w, step_delay_ms=30) for w in ("A", "B", "C")}
    try:
        wait_until(_generating(client, keys, set(procs), 0), "all three generating", 90, procs.values())
        path, digest = nudged_weights(tiny_model_dir, tmp_path, 1)
        # C freezes (alive by its heartbeat key for up to HEARTBEAT_TTL, but silent), then dies with kill -9
        # once the sync's first command (fetch) is out
        os.kill(procs["C"].pid, signal.SIGSTOP)
        publish(client, keys, 1, path, digest, step=1)
        wait_until(lambda: _commands(client, keys, "fetch"), "the fetch", 10)
        kill9(procs["C"])
        wait_until(lambda: _sync_records(client, keys), "the sync record", 30)
        (rec,) = _sync_records(client, keys)
        assert rec["version"] == 1 and rec["workers"] == 3 and rec["missing"] == ["C"] and rec["refused"] == {}
        # C was let go when its heartbeat lapsed, not at sync_timeout
        assert rec["missing_why"] == {"C": "fetch: heartbeat lapsed"}
        acked = {
            (a["cmd"], a["worker"]) for _, a in control.read_after(client, keys, "0-0", 1000) if isinstance(a, dict)
        }
        assert acked == {(c, w) for c in ("fetch", "pause", "load", "resume") for w in ("A", "B")}
        # the others resumed: they generate again, with version 1, and say so in their heartbeats
        wait_until(
            _generating(client, keys, {"A", "B"}, 1), "A and B generating with version 1", 30, [procs["A"], procs["B"]]
        )
        alive = alive_of(client, keys, "rollout")
        assert set(alive) == {"A", "B"}
        assert all(info["version"] == "1" and info["paused"] == "0" for info in alive.values())
        # a second version goes through with only the live workers
        path2, digest2 = nudged_weights(tiny_model_dir, tmp_path, 2)
        publish(client, keys, 2, path2, digest2, step=2)
        wait_until(lambda: len(_sync_records(client, keys)) == 2, "the second sync", 30)
        rec2 = _sync_records(client, keys)[1]
        assert rec2["version"] == 2 and rec2["workers"] == 2 and rec2["missing"] == [] and rec2["missing_why"] == {}
        wait_until(
            _generating(client, keys, {"A", "B"}, 2), "A and B generating with version 2", 30, [procs["A"], procs["B"]]
        )
    finally:
        kill9(*procs.values())
    # versions strictly increase, and no token is from a version the trainer had not published when it was written
    versions = [(_entry_ms(v.entry_id), v.version) for v in pversions.read_all(client, keys)]
    assert [v for _, v in versions] == [1, 2]
    published = {v: at for at, v in versions}
    for entry_id, worker, policy in _token_events(client, keys):
        assert policy == 0 or _entry_ms(entry_id) > published[policy], (entry_id, worker, policy)
    log = EpisodeLog(client, keys, "reader")
    for key in client.scan_iter(match=keys.episode("*")):
        ep = log.replay(keys.episode_id(key))
        generated = [v for v, m in zip(ep.versions, ep.mask) if m]
        # within an episode, versions never go back
        assert generated == sorted(generated)


def test_a_silent_worker_is_left_out_after_sync_timeout_versions_published_meanwhile_sync_once_and_it_catches_up(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    """B is frozen (SIGSTOP) but its heartbeat key outlives the syncs: the syncer waits fetch_timeout for it (the
    sync's first phase), then goes on without it and says why. Versions 2 and 3 are published while it waits: the
    next sync goes straight to 3 (one sync, one load). Woken, B reads the commands it missed and ends at version 3,
    generating again."""
    start_syncer(sync_timeout=2.0, fetch_timeout=2.0)
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}*2=") for i in range(16)])
    procs = {w: _worker(redis_url, keys, tiny_model_dir, w, heartbeat_ttl=120) for w in ("A", "B")}
    files = {n: nudged_weights(tiny_model_dir, tmp_path, n) for n in (1, 2, 3)}
    try:
        wait_until(_generating(client, keys, set(procs), 0), "both generating", 90, procs.values())
        os.kill(procs["B"].pid, signal.SIGSTOP)
        publish(client, keys, 1, *files[1], step=1)
        # the sync's first phase: the syncer now waits up to fetch_timeout for B's fetch ack (after it B is left
        # out of that sync's other phases, which then end at once), so versions 2 and 3 come out during that wait
        wait_until(lambda: _commands(client, keys, "fetch"), "the fetch of version 1", 30)
        for n in (2, 3):
            publish(client, keys, n, *files[n], step=n)
        wait_until(lambda: len(_sync_records(client, keys)) == 2, "two sync records", 60)
        first, second = _sync_records(client, keys)
        assert (first["version"], second["version"]) == (1, 3)
        for rec in (first, second):
            assert rec["missing"] == ["B"] and rec["missing_why"] == {"B": "fetch: silent past fetch_timeout"}
        assert [c.version for c in _commands(client, keys, "load")] == [1, 3] and gate.opened_version(client, keys) == 3
        # still alive by its key, still on the old weights
        assert worker_info(client, keys, "B")["version"] == "0"
        wait_until(_generating(client, keys, {"A"}, 3), "A generating with version 3", 30, [procs["A"]])
        os.kill(procs["B"].pid, signal.SIGCONT)
        wait_until(
            lambda: worker_info(client, keys, "B").items() >= {"version": "3", "paused": "0"}.items(),
            "B at version 3 and resumed",
            60,
            procs.values(),
        )
        wait_until(_generating(client, keys, {"B"}, 3), "B generating with version 3", 30, procs.values())
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        kill9(*procs.values())


def test_a_worker_left_paused_by_a_lost_resume_is_synced_again_and_a_lost_gate_is_set_again(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    """What a Redis restart that lost its last second can leave: a pause obeyed whose resume never came, and
    the gate's update gone. The idle syncer notices both (a worker paused twice in a row between syncs, a gate
    behind the synced version) and repairs them."""
    start_syncer()
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}-1=") for i in range(8)])
    procs = [_worker(redis_url, keys, tiny_model_dir, "A")]
    try:
        path, digest = nudged_weights(tiny_model_dir, tmp_path, 1)
        wait_until(_generating(client, keys, {"A"}, 0), "A generating", 90, procs)
        publish(client, keys, 1, path, digest, step=1)
        wait_until(_generating(client, keys, {"A"}, 1), "A generating with version 1", 30, procs)
        control.send_command(client, keys, control.Command("pause", "lost-sync", 1, "", ""))
        wait_until(lambda: worker_info(client, keys, "A")["paused"] == "1", "A paused by the stray pause", 30, procs)
        client.delete(keys.gate)
        wait_until(lambda: len(_sync_records(client, keys)) == 2, "the repair sync", 30, procs)
        assert _sync_records(client, keys)[1]["version"] == 1 and _sync_records(client, keys)[1]["missing"] == []
        wait_until(lambda: worker_info(client, keys, "A")["paused"] == "0", "A resumed", 30, procs)
        assert gate.opened_version(client, keys) == 1
    finally:
        kill9(*procs)


def test_corrupt_weights_refused_sync_records_it_and_goes_on(
    client, keys, redis_url, tiny_model_dir, tmp_path, start_syncer
):
    start_syncer()
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}*3=") for i in range(8)])
    procs = [_worker(redis_url, keys, tiny_model_dir, "A")]
    try:
        wait_until(lambda: _token_events(client, keys), "A generating", 90, procs)
        path, digest = nudged_weights(tiny_model_dir, tmp_path, 1)
        # truncated after the checksum
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        publish(client, keys, 1, path, digest, step=1)
        wait_until(lambda: _sync_records(client, keys), "the sync record", 30, procs)
        (rec,) = _sync_records(client, keys)
        assert rec["missing"] == [] and set(rec["refused"]) == {"A"}
        assert rec["refused"]["A"].startswith("load: ") and "sha256" in rec["refused"]["A"]
        assert "corrupt or truncated" in rec["refused"]["A"]
        n_before = len(_token_events(client, keys))
        wait_until(lambda: len(_token_events(client, keys)) > n_before + 2, "A generating after the refusal", 30, procs)
        info = worker_info(client, keys, "A")
        # kept its old weights, and resumed
        assert info["version"] == "0" and info["paused"] == "0"
        assert {v for _, _, v in _token_events(client, keys)} == {0}
        # the next good version is loaded as usual
        path2, digest2 = nudged_weights(tiny_model_dir, tmp_path, 2)
        publish(client, keys, 2, path2, digest2, step=2)
        wait_until(lambda: len(_sync_records(client, keys)) == 2, "the second sync", 30, procs)
        assert _sync_records(client, keys)[1]["refused"] == {}
        wait_until(lambda: any(v == 2 for _, _, v in _token_events(client, keys)), "tokens of version 2", 30, procs)
    finally:
        kill9(*procs)


def test_a_worker_of_this_host_whose_process_is_gone_is_not_waited_for_nor_counted_live(client, keys):
    """Its heartbeat key has a minute left, yet the syncer lets it go on its first look (the ack wait's timeout is
    a minute too) and no longer lists it among the live workers; a named worker with a live key is still waited for
    (here: until the wait's short timeout)."""
    import time

    from services.syncer.syncer import Syncer
    from shared.runtime import logs
    from shared.runtime.config.keys import Config

    gone = gone_worker_id()
    for w in (gone, "A"):
        client.hset(keys.alive("rollout", w), "version", 0)
        client.expire(keys.alive("rollout", w), 60)
        client.sadd(keys.alive_registry("rollout"), w)
    syncer = Syncer(Config(run=keys.run), client, logs.get("syncer-test"))
    assert set(syncer.live_workers()) == {"A"}
    t0 = time.monotonic()
    acked, failed, silent, dead = syncer._wait_acks("s1", "fetch", {gone}, control.last_id(client, keys), 60.0)
    assert dead == {gone} and not (acked or failed or silent) and time.monotonic() - t0 < 5
    acked, failed, silent, dead = syncer._wait_acks("s1", "fetch", {"A"}, control.last_id(client, keys), 0.6)
    assert silent == {"A"} and not dead

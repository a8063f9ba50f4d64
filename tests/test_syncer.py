"""The syncer against real rollout worker processes: a worker killed mid-sync,
version order, and weights refused by checksum."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.syncer.syncer import Syncer
from services.trainer.publish import publish, write_weights
from shared.runtime import logs
from shared.runtime.config import Config
from shared.protocol.episode_log import EpisodeLog
from shared.protocol.fold import fold
from shared.protocol.prompts import PromptGroup, enqueue
from shared.protocol import control, metrics
from shared.protocol import versions as pversions

HEARTBEAT_TTL = 3.0


def _worker(redis_url, keys, model_dir, worker_id):
    args = [sys.executable, "-m", "services.rollout", "--worker-id", worker_id, "--run", keys.run,
            "--redis-url", redis_url, "--model-dir", model_dir, "--max-tokens", "400", "--tools", "",
            "--flush-tokens", "4", "--flush-ms", "20", "--heartbeat-ttl", str(HEARTBEAT_TTL),
            "--step-delay-ms", "10", "--max-groups-in-flight", "2", "--log-level", "warning"]
    return subprocess.Popen(args, start_new_session=True)


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _weights(model_dir: str, out: Path, version: int) -> tuple[Path, str]:
    """A real new version: the model with its weights nudged, written as the trainer writes it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * version)
    return write_weights(model, out, version)


def _alive(client, keys) -> dict[str, dict]:
    out = {}
    for key in client.scan_iter(match=keys.alive("rollout", "*")):
        out[key.decode().rsplit(":", 1)[1]] = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
    return out


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


def _wait(cond, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for p in procs:
            assert p.poll() is None, f"a worker process exited with {p.returncode} while waiting for {what}"
        time.sleep(0.05)


def _sync_records(client, keys) -> list[dict]:
    return [rec for _, rec in metrics.read(client, keys, "sync")]


@pytest.fixture
def syncer_thread(client, keys, tiny_model_dir):
    """A real Syncer.run loop in a thread, reading the versions stream like the process does."""
    cfg = Config(run=keys.run, model_dir=tiny_model_dir, sync_timeout=20.0, heartbeat_ttl=HEARTBEAT_TTL)
    stop = threading.Event()
    syncer = Syncer(cfg, client, logs.get("syncer-test"))
    thread = threading.Thread(target=syncer.run, kwargs={"should_stop": stop.is_set}, daemon=True)
    thread.start()
    yield syncer
    stop.set()
    thread.join(30)


def test_worker_killed_mid_sync_others_resume_and_versions_order(client, keys, redis_url, tiny_model_dir, tmp_path,
                                                                 syncer_thread):
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}+{i}=") for i in range(6)])
    procs = {w: _worker(redis_url, keys, tiny_model_dir, w) for w in ("A", "B", "C")}
    try:
        _wait(lambda: {w for _, w, _ in _token_events(client, keys)} == set(procs), 90, "all three generating",
              procs.values())
        path, digest = _weights(tiny_model_dir, tmp_path, 1)
        # C freezes (alive by its heartbeat key for up to HEARTBEAT_TTL, but silent), then dies with kill -9
        # once the pause is out
        os.kill(procs["C"].pid, signal.SIGSTOP)
        published_at = time.monotonic()
        publish(client, keys, 1, path, digest, step=1)
        _wait(lambda: any(getattr(c, "cmd", "") == "pause" for _, c in control.read_after(client, keys, "0-0", 1000)), 10,
              "the pause")
        os.killpg(procs["C"].pid, signal.SIGKILL)
        _wait(lambda: _sync_records(client, keys), 30, "the sync record")
        took = time.monotonic() - published_at
        (rec,) = _sync_records(client, keys)
        assert rec["version"] == 1 and rec["workers"] == 3 and rec["missing"] == ["C"] and rec["refused"] == {}
        assert rec["total_s"] < syncer_thread.cfg.sync_timeout and took < syncer_thread.cfg.sync_timeout
        assert rec["pause_s"] < 2 * HEARTBEAT_TTL + 2  # C was let go when its heartbeat lapsed, not at the timeout
        acked = {(a["cmd"], a["worker"]) for _, a in control.read_after(client, keys, "0-0", 1000)
                 if isinstance(a, dict)}
        assert acked == {(c, w) for c in ("pause", "load", "resume") for w in ("A", "B")}
        # the others resumed: they generate again, with version 1, and say so in their heartbeats
        _wait(lambda: {w for _, w, v in _token_events(client, keys) if v == 1} == {"A", "B"}, 30,
              "A and B generating with version 1", [procs["A"], procs["B"]])
        alive = _alive(client, keys)
        assert set(alive) == {"A", "B"}
        assert all(info["version"] == "1" and info["paused"] == "0" for info in alive.values())
        # a second version goes through with only the live workers and no waiting
        path2, digest2 = _weights(tiny_model_dir, tmp_path, 2)
        publish(client, keys, 2, path2, digest2, step=2)
        _wait(lambda: len(_sync_records(client, keys)) == 2, 30, "the second sync")
        rec2 = _sync_records(client, keys)[1]
        assert rec2["version"] == 2 and rec2["workers"] == 2 and rec2["missing"] == []
        assert rec2["total_s"] < 10  # nobody to wait for
        _wait(lambda: {w for _, w, v in _token_events(client, keys) if v == 2} == {"A", "B"}, 30,
              "A and B generating with version 2", [procs["A"], procs["B"]])
    finally:
        _stop(procs.values())
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
        assert generated == sorted(generated)  # within an episode, versions never go back


def test_corrupt_weights_refused_sync_records_it_and_goes_on(client, keys, redis_url, tiny_model_dir, tmp_path,
                                                             syncer_thread):
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}*3=") for i in range(3)])
    procs = [_worker(redis_url, keys, tiny_model_dir, "A")]
    try:
        _wait(lambda: _token_events(client, keys), 90, "A generating", procs)
        path, digest = _weights(tiny_model_dir, tmp_path, 1)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated after the checksum
        publish(client, keys, 1, path, digest, step=1)
        _wait(lambda: _sync_records(client, keys), 30, "the sync record", procs)
        (rec,) = _sync_records(client, keys)
        assert rec["missing"] == [] and set(rec["refused"]) == {"A"}
        assert rec["refused"]["A"].startswith("load: ") and "sha256" in rec["refused"]["A"]
        assert "corrupt or truncated" in rec["refused"]["A"]
        n_before = len(_token_events(client, keys))
        _wait(lambda: len(_token_events(client, keys)) > n_before + 2, 30, "A generating after the refusal", procs)
        info = _alive(client, keys)["A"]
        assert info["version"] == "0" and info["paused"] == "0"  # kept its old weights, and resumed
        assert {v for _, _, v in _token_events(client, keys)} == {0}
        # the next good version is loaded as usual
        path2, digest2 = _weights(tiny_model_dir, tmp_path, 2)
        publish(client, keys, 2, path2, digest2, step=2)
        _wait(lambda: len(_sync_records(client, keys)) == 2, 30, "the second sync", procs)
        assert _sync_records(client, keys)[1]["refused"] == {}
        _wait(lambda: any(v == 2 for _, _, v in _token_events(client, keys)), 30, "tokens of version 2", procs)
    finally:
        _stop(procs)

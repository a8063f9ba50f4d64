"""Weights over the wire with real processes: rollout worker processes, the real Syncer loop, the real weight server
over loopback HTTP, real Redis. One worker has a weights folder of its own and cannot read the trainer's
(tests/support/audited_rollout.py refuses and records every open under it); the other shares the trainer's folder."""

from __future__ import annotations

import socket
import threading

import pytest

from services.syncer.syncer import Syncer
from services.trainer.publish import publish
from shared.protocol.episode.fold import fold
from shared.protocol.streams import control, metrics
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime import logs
from shared.runtime.config.keys import Config
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import WeightServer, file_name
from tests.support.models import nudged_weights
from tests.support.procs import kill9, spawn, wait_until
from tests.support.rollout_harness import worker_info

# real rollout worker processes
pytestmark = pytest.mark.slow

HEARTBEAT_TTL = 3.0


def _worker_args(redis_url, keys, model_dir, worker_id) -> list:
    return [
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
    ]


def _remote_worker(redis_url, keys, model_dir, worker_id, trainer_dir, own_dir, audit_log):
    """A worker as on another host: the trainer's folder unreadable, its own folder for downloads."""
    return spawn(
        "tests.support.audited_rollout",
        trainer_dir,
        audit_log,
        *_worker_args(redis_url, keys, model_dir, worker_id),
        "--weights-fetch",
        "always",
        "--rollout-weights-dir",
        own_dir,
    )


@pytest.fixture
def wire(client, keys, tiny_model_dir, tmp_path):
    """The trainer's folder served by the weight server, and a real Syncer loop in a thread."""
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    server = WeightServer(trainer_dir).start()
    cfg = Config(
        run=keys.run, model_dir=tiny_model_dir, sync_timeout=20.0, fetch_timeout=20.0, heartbeat_ttl=HEARTBEAT_TTL
    )
    stop = threading.Event()
    thread = threading.Thread(
        target=Syncer(cfg, client, logs.get("syncer-test")).run, kwargs={"should_stop": stop.is_set}, daemon=True
    )
    thread.start()
    yield trainer_dir, server
    stop.set()
    thread.join(30)
    server.stop()


def _versions_in_streams(client, keys) -> dict[str, set[int]]:
    """worker -> the policy versions of the tokens it wrote."""
    out: dict[str, set[int]] = {}
    for key in client.scan_iter(match=keys.episode("*")):
        for e in fold(client.xrange(key)).events:
            if e.kind == "tokens":
                out.setdefault(e.worker, set()).add(e.policy)
    return out


def _token_events(client, keys) -> int:
    return sum(
        1
        for key in client.scan_iter(match=keys.episode("*"))
        for e in fold(client.xrange(key)).events
        if e.kind == "tokens"
    )


def _generating(client, keys, workers, version):
    return lambda: all(version in _versions_in_streams(client, keys).get(w, set()) for w in workers)


def _syncs(client, keys) -> list[dict]:
    return [rec for _, rec in metrics.read(client, keys, "sync")]


def test_a_worker_with_its_own_folder_syncs_over_http_never_opening_the_trainers_and_refuses_a_bad_digest(
    client, keys, redis_url, tiny_model_dir, tmp_path, wire
):
    """R (its own folder; the trainer's unreadable) and L (the trainer's folder) sync to version 1: R downloads it,
    L only checks it, and the pause is sent only once both acked the fetch. Version 2 is truncated after its
    checksum: both refuse it with one clear error, keep version 1 and generate on."""
    trainer_dir, server = wire
    own, audit = tmp_path / "worker-own", tmp_path / "audit.log"
    enqueue(client, keys, [PromptGroup(f"g{i}", 2, prompt=f"{i}+{i}=") for i in range(16)])
    procs = {
        "R": _remote_worker(redis_url, keys, tiny_model_dir, "R", trainer_dir, own, audit),
        # shares the folder
        "L": spawn("services.rollout", *_worker_args(redis_url, keys, tiny_model_dir, "L")),
    }
    try:
        wait_until(_generating(client, keys, set(procs), 0), "both workers generating", 90, procs.values())
        path, digest = nudged_weights(tiny_model_dir, trainer_dir, 1)
        publish(client, keys, 1, path, digest, step=1, url_base=server.url)
        wait_until(lambda: _syncs(client, keys), "the sync record", 60, procs.values())
        (rec,) = _syncs(client, keys)
        assert rec["workers"] == 2 and rec["missing"] == [] and rec["refused"] == {}, rec
        wait_until(_generating(client, keys, set(procs), 1), "both generating with version 1", 30, procs.values())
        assert worker_info(client, keys, "R")["version"] == "1"
        # R loaded its own copy, downloaded over HTTP and verified, and never opened the trainer's folder
        assert sha256_file(own / file_name(1)) == digest
        assert not audit.exists(), audit.read_text()
        # L, sharing the folder, downloaded nothing (no folder of downloads made)
        assert not Config(run=keys.run).rollout_weights_path.exists()
        # order of the control stream: fetch, every live worker's fetch ack, and only then the pause
        entries = [e for _, e in control.read_after(client, keys, "0-0", 1000)]
        kinds = [(e.cmd, "cmd") if isinstance(e, control.Command) else (e["cmd"], e["worker"]) for e in entries]
        pause_at = kinds.index(("pause", "cmd"))
        assert kinds[0] == ("fetch", "cmd")
        assert {("fetch", "R"), ("fetch", "L")} <= set(kinds[:pause_at])
        assert [k for k in kinds[pause_at:] if k[0] == "fetch"] == []
        assert all(a["ok"] == "1" for a in entries if isinstance(a, dict))

        # version 2 does not match its sha256: refused by both, each says which version, from where, what
        path2, digest2 = nudged_weights(tiny_model_dir, trainer_dir, 2)
        # truncated after the checksum
        path2.write_bytes(path2.read_bytes()[: path2.stat().st_size // 2])
        publish(client, keys, 2, path2, digest2, step=2, url_base=server.url)
        wait_until(lambda: len(_syncs(client, keys)) == 2, "the second sync record", 60, procs.values())
        rec2 = _syncs(client, keys)[1]
        assert rec2["missing"] == [] and set(rec2["refused"]) == {"R", "L"}, rec2
        assert rec2["refused"]["R"].startswith(f"load: weights v2 from {server.url_of(2)}: ")
        assert digest2[:12] in rec2["refused"]["R"]
        assert rec2["refused"]["L"].startswith(f"load: weights {path2}: sha256 ")
        assert "corrupt or truncated" in rec2["refused"]["L"]
        fetch_acks = {
            (a["worker"], a["ok"], a["version"])
            for _, a in control.read_after(client, keys, "0-0", 1000)
            if isinstance(a, dict) and a["cmd"] == "fetch" and a["sync"].startswith("v2-")
        }
        assert fetch_acks == {("R", "0", "1"), ("L", "0", "1")}
        wait_until(
            lambda: all(worker_info(client, keys, w).get("paused") == "0" for w in procs),
            "both resumed",
            30,
            procs.values(),
        )
        assert {w: worker_info(client, keys, w)["version"] for w in procs} == {"R": "1", "L": "1"}
        assert not (own / file_name(2)).exists() and not list(own.glob("*.part"))
        before = _token_events(client, keys)
        wait_until(
            lambda: _token_events(client, keys) > before + 2,
            "generation going on after the refusal",
            30,
            procs.values(),
        )
        assert all(2 not in v for v in _versions_in_streams(client, keys).values())
    finally:
        kill9(*procs.values())
    assert not audit.exists()


def test_the_trainer_process_serves_what_it_publishes_at_the_url_in_the_version_event(
    client, keys, redis_url, tiny_model_dir, tmp_path
):
    """A real trainer process with weights_port and weights_token: its version event carries the URL, and that URL
    (with the token; not without it) gives the file the event's sha256 names."""
    from shared.protocol.streams import versions
    from shared.runtime.weights.fetch import FetchError, fetch
    from tests.support.procs import stop
    from tests.trainer.test_trainer import _write_group

    # a free port for the server (bound again by the trainer at once)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = spawn(
        "services.trainer",
        "--run",
        keys.run,
        "--redis-url",
        redis_url,
        "--model-dir",
        tiny_model_dir,
        "--run-dir",
        tmp_path / "runs",
        "--weights-dir",
        tmp_path / "weights",
        "--batch-groups",
        "2",
        "--weights-port",
        port,
        "--weights-token",
        "s3cret",
        "--log-level",
        "warning",
    )
    try:
        for g in ("g0", "g1"):
            _write_group(client, keys, g)
        v = wait_until(lambda: versions.latest(client, keys), "version 1 published", 120, [proc])
        assert v.url == f"http://127.0.0.1:{port}/weights/{file_name(1)}"
        got = fetch(v.url, 1, v.sha256, tmp_path / "mine", token="s3cret")
        assert sha256_file(got.path) == v.sha256 and got.downloaded == got.bytes > 0
        with pytest.raises(FetchError, match="HTTP 401"):
            fetch(v.url, 1, v.sha256, tmp_path / "theirs")
    finally:
        assert stop(proc) == [0]

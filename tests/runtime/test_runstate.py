"""A run's identity: folder (run.json) and Redis (streamrl:<run>:meta) agree, or a process stops with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared.protocol.archive.ledger import append_ledger
from shared.runtime import runstate
from shared.runtime.runstate import RunStateError, bind
from tests.support.procs import spawn, wait_until


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_first_process_names_the_run_and_the_others_find_it(client, keys, redis_url, tmp_path):
    run_path = tmp_path / keys.run
    meta = bind(client, keys, run_path, redis_url)
    assert meta["run"] == keys.run and len(meta["id"]) == 12
    assert runstate.read_marker(run_path)["id"] == meta["id"]
    assert bind(client, keys, run_path, redis_url)["id"] == meta["id"]
    # another machine's process (its own, empty folder) adopts the run it finds in Redis
    assert bind(client, keys, tmp_path / "elsewhere" / keys.run, redis_url)["id"] == meta["id"]


def test_another_runs_data_is_refused_naming_both(client, keys, redis_url, tmp_path):
    run_path = tmp_path / keys.run
    bind(client, keys, run_path, redis_url)
    runstate.write_marker(
        run_path, {"run": keys.run, "id": "0123456789ab", "created": "2026-01-01T00:00:00Z"}, "redis://127.0.0.1:1/0"
    )
    with pytest.raises(RunStateError) as exc:
        bind(client, keys, run_path, redis_url)
    text = one_line(exc)
    assert "0123456789ab" in text and client.hget(keys.meta, "id").decode() in text
    assert "two different runs" in text and "move" in text and "streamrl redis" in text


def test_checkpoint_ahead_of_an_empty_redis_is_refused(client, keys, redis_url, tmp_path):
    """The issue's case: runs/demo holds version 1003, the Redis it connects to holds nothing of the run."""
    run_path = tmp_path / keys.run
    runstate.write_marker(
        run_path, {"run": keys.run, "id": "feedfacecafe", "created": "2026-01-01T00:00:00Z"}, "redis://127.0.0.1:1/0"
    )
    append_ledger(run_path / "trainer", {"version": 1003, "step": 1003, "groups": ["q1"], "skipped": []})
    with pytest.raises(RunStateError) as exc:
        bind(client, keys, run_path, redis_url)
    text = one_line(exc)
    assert "version 1003" in text and "has nothing of it" in text and str(run_path / "redis") in text
    # nothing created, nothing mixed
    assert not client.exists(keys.meta)
    # no marker at all (a folder from before markers): the checkpoint alone is refused the same way
    (run_path / runstate.MARKER).unlink()
    with pytest.raises(RunStateError, match="version 1003"):
        bind(client, keys, run_path, redis_url)
    assert not client.exists(keys.meta)


def test_a_run_named_before_markers_is_adopted_and_readers_create_nothing(client, keys, redis_url, tmp_path):
    run_path = tmp_path / keys.run
    assert bind(client, keys, run_path, redis_url, create=False) is None
    assert not client.exists(keys.meta) and not run_path.exists()
    # the run's data, no meta yet
    client.xadd(keys.versions, {"version": 1})
    runstate.write_marker(run_path, {"run": keys.run, "id": "abcabcabcabc", "created": "x"}, redis_url)
    assert bind(client, keys, run_path, redis_url)["id"] == "abcabcabcabc"
    assert client.hget(keys.meta, "id") == b"abcabcabcabc"


def test_ended_run_is_recorded(client, keys, redis_url, tmp_path):
    meta = bind(client, keys, tmp_path / keys.run, redis_url)
    assert runstate.ended(meta) is None
    runstate.mark_ended(client, keys, 7)
    assert runstate.ended(runstate.read_meta(client, keys)).startswith("at version 7 on ")


def test_service_and_check_stop_with_one_line(redis_url, keys, tmp_path):
    """As processes: a service (the syncer) and `streamrl check` on a folder whose Redis is gone."""
    run_dir = tmp_path / "runs"
    run_path = run_dir / keys.run
    runstate.write_marker(
        run_path, {"run": keys.run, "id": "feedfacecafe", "created": "2026-01-01T00:00:00Z"}, "redis://127.0.0.1:1/0"
    )
    append_ledger(run_path / "trainer", {"version": 12, "step": 12, "groups": ["q1"], "skipped": []})
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "STREAMRL_RUN": keys.run,
        "STREAMRL_RUN_DIR": str(run_dir),
        "STREAMRL_LOG_LEVEL": "warning",
    }
    for cmd, who in (
        ([sys.executable, "-m", "services.syncer"], "syncer"),
        ([sys.executable, "-m", "services.ops.cli.main", "check"], "streamrl check"),
    ):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith(f"{who}: run {keys.run!r}: ") and "version 12" in out.stderr
    assert json.loads((run_path / runstate.MARKER).read_text())["id"] == "feedfacecafe"


def test_a_service_says_in_one_line_when_redis_is_gone(tmp_path, keys):
    """redis_wait: a server that stays gone stops the service with one line, not minutes of silent retries."""
    from services.ops.launch.redis_server import EmbeddedRedis
    from shared.runtime.connection import connect

    server = EmbeddedRedis(tmp_path / "redis").start()
    env = {
        **os.environ,
        "REDIS_URL": server.url,
        "STREAMRL_RUN": keys.run,
        "STREAMRL_RUN_DIR": str(tmp_path),
        "STREAMRL_LOG_LEVEL": "warning",
        "STREAMRL_REDIS_WAIT": "3",
    }
    proc = spawn("services.syncer", env=env, stderr_pipe=True)
    try:
        client = connect(server.url)
        wait_until(lambda: list(client.scan_iter(match=keys.alive_pattern("syncer"))), "the syncer alive", 60, [proc])
        server.kill()
        # the old fixed retries took about two minutes
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        server.kill()
    assert proc.returncode != 0 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"syncer: Redis at {server.url} is gone: no answer within redis_wait = 3 s")

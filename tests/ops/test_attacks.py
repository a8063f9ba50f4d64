"""A live `streamrl run`, attacked from the same machine without its secrets: its Redis refuses
every command (no streams read, no job enqueued, nothing steered), no secret is on any process's command line
or in its environment, in the run's marker, in Redis or in the logs, and the secrets file and run folder are
the owner's only. (The parts attacked from inside, with Redis access, have their own tests: a queued os.system is
not run, tests/rollout/test_job_guard.py; a forged fetch sends no token, tests/sync/test_weight_origins.py;
poison is dead-lettered, tests/drills/test_faults.py and tests/protocol/test_poison.py; the gateway,
tests/gateway/test_gateway_fuzz.py.)"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from shared.protocol.keys import Keys
from shared.runtime import runstate, secrets
from shared.runtime.connection import connect
from tests.ops.test_operator_paths import base_env
from tests.support.procs import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _session(pid: int) -> list[int]:
    """The processes of ``pid``'s session (streamrl run, honcho, every service, the Redis server)."""
    sid = os.getsid(pid)
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


@pytest.mark.slow(seconds=50)
def test_a_live_run_gives_nothing_to_a_local_attacker_without_its_secrets(tmp_path, tiny_model_dir):
    name = f"atk{uuid.uuid4().hex[:8]}"
    run_path = tmp_path / "runs" / name
    env = {
        **base_env(tmp_path / "runs", name, tiny_model_dir),
        "STREAMRL_MAX_VERSIONS": "100000",
        "STREAMRL_MAX_MINUTES": "4",
        "STREAMRL_LOG_LEVEL": "warning",
    }
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.ops.cli.main", "run"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(
            lambda: (runstate.read_marker(run_path) or {}).get("id") or proc.poll() is not None,
            "the run's marker",
            timeout=120,
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        made = secrets.read(run_path)
        port = int(made["redis_server"].rsplit(":", 1)[1])
        owner = connect(f"redis://:{made['redis_password']}@127.0.0.1:{port}/0", wait=10)
        keys = Keys(name)
        wait_until(lambda: owner.xlen(keys.samples) > 0, "samples", timeout=120)

        # 1. the run's Redis, without the password: nothing read, nothing written, no job enqueued
        attacker = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        for attempt in (
            lambda: attacker.xrange(keys.prompts, count=1),
            lambda: attacker.xadd(keys.control, {"type": "cmd", "cmd": "pause", "sync": "x"}),
            lambda: Queue(keys.tool_queue, connection=attacker, serializer=JSONSerializer).enqueue_call(
                "os.system", args=("id",)
            ),
            lambda: attacker.config_set("requirepass", ""),
        ):
            with pytest.raises(redis.exceptions.AuthenticationError):
                attempt()
        # ... nor with a guess of the URL `streamrl run` printed (redacted) or run.json names
        marker = (run_path / runstate.MARKER).read_text()
        assert made["redis_password"] not in marker and ":***@" in marker

        # 2. no secret on a command line or in an environment of any process of the run
        values = [made[k].encode() for k in secrets.SECRETS]
        pids = _session(proc.pid)
        # streamrl run, honcho, the services, Redis
        assert len(pids) >= 6
        for pid in pids:
            for what in ("cmdline", "environ"):
                blob = _read(Path(f"/proc/{pid}/{what}"))
                assert not any(v in blob for v in values), (pid, what, blob[:300])

        # 3. files: the secrets file and the run folder are the owner's only; no secret in Redis or the logs
        assert stat.S_IMODE((run_path / secrets.FILE).stat().st_mode) == 0o600
        assert stat.S_IMODE(run_path.stat().st_mode) == 0o700
        assert stat.S_IMODE((run_path / "redis").stat().st_mode) == 0o700
        dump = b"".join(_read(p) for p in (run_path / "redis").rglob("*") if p.is_file())
        assert dump and not any(v in dump for v in values)
        # the run went on through all of it
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_bytes()
    assert not any(made[k].encode() in text for k in secrets.SECRETS)

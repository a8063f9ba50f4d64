"""`streamrl run` (honcho's manager over the Procfile, each line under `streamrl keep`): a service killed with
kill -9 mid-run, and the embedded Redis killed by `--chaos`, are started again and the run goes on to its end with
the check all zero; a process that keeps crashing stops the run with its own last line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.ops.launch import starter_client
from services.ops.launch.keep import processes
from shared.protocol.archive.ledger import read_ledger
from tests.support.procs import starter_pid

ROOT = Path(__file__).resolve().parents[2]
# whole runs
pytestmark = pytest.mark.slow(seconds=45)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _run_args(tmp_path, model_dir, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "services.ops.cli.main",
        "run",
        "--run",
        "kept",
        "--model-dir",
        model_dir,
        "--run-dir",
        str(tmp_path / "runs"),
        "--weights-dir",
        str(tmp_path / "weights"),
        "--max-minutes",
        "4",
        "--group-size",
        "4",
        "--batch-groups",
        "2",
        "--max-tokens",
        "8",
        "--val-every",
        "0",
        "--heartbeat-ttl",
        "2",
        *extra,
    ]


def _child(pid_dir: Path, name: str) -> int | None:
    return processes(pid_dir).get(name, (None, 0))[0]


def _parent(pid: int) -> tuple[int, str]:
    """(pid, command line) of a process's parent."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return ppid, Path(f"/proc/{ppid}/cmdline").read_text().replace("\0", " ")


def test_a_service_killed_mid_run_is_restarted_and_the_run_ends_with_the_check_all_zero(tmp_path, tiny_model_dir):
    # where each `streamrl keep` writes its process's pid
    pids = tmp_path / "runs" / "kept" / "procs"
    # and chaos kills the embedded Redis every 4 s (the runner starts it again on its port over its data)
    # 50 versions: the run outlasts chaos's first kill at 4 s (its start, the trainer's kill and restart alone take
    # longer than that; 12 versions with nothing killed could end sooner now that the processes start warm)
    # with no starter handed to it (the tests share one per worker): the run preloads its own, as a user's does
    env = {k: v for k, v in _env().items() if k != starter_client.ENV}
    proc = subprocess.Popen(
        _run_args(tmp_path, tiny_model_dir, "--max-versions", "50", "--chaos", "4", "--chaos-only", "redis"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        ledger = tmp_path / "runs" / "kept" / "trainer"
        # a version committed: mid-run
        while not (read_ledger(ledger) and _child(pids, "trainer")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never committed a version"
            time.sleep(0.2)
        # forked from the run's own starter
        parent, command = _parent(_child(pids, "trainer"))
        assert "-m services.ops.launch.starter" in command and parent != starter_pid(), command
        os.kill(_child(pids, "trainer"), signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"keep: trainer killed by SIGKILL; restart 1 in [\d.]+ s", out), out[-3000:]
    reached = re.search(r"driver: reached version (\d+); ending the run", out)
    assert reached and int(reached.group(1)) >= 50, out[-3000:]
    # the check: all 0
    assert re.search(r"\n  processes restarted: [^\n]*trainer 1[^\n]*\nok\n", out), out[-3000:]
    kills = re.search(r"chaos: (\d+) kills in \d+ s \(one every 4 s, seed 0\): redis (\d+)", out)
    assert kills and int(kills.group(1)) == int(kills.group(2)) >= 1, out[-3000:]
    assert re.search(r"keep: redis killed by SIGKILL; restart 1 in [\d.]+ s on port", out), out[-3000:]


def test_a_process_that_keeps_crashing_stops_the_run_with_its_last_line(tmp_path, tiny_model_dir):
    procfile = tmp_path / "Procfile"
    procfile.write_text(
        (ROOT / "Procfile").read_text() + "crasher: exec streamrl keep -- python -c "
        "\"import sys; print('crasher: config key x: expected y', flush=True); sys.exit(1)\"\n"
    )
    out = subprocess.run(
        _run_args(tmp_path, tiny_model_dir, "--max-versions", "100000", "--procfile", str(procfile)),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    assert (
        "crashed 6 times within 60 s (exit code 1); stopping the run. Its last line: crasher: config key x: "
        "expected y" in log
    ), log[-3000:]


def test_an_agent_run_that_cannot_train_stops_with_its_error_in_one_line_and_exit_1(tmp_path, tiny_model_dir):
    """An agent written against an API the gateway does not serve: every episode fails with the gateway's 404.
    The run does not go on failing episodes until max_minutes: once the first fail_fast_groups groups all failed
    for that one reason with nothing trained, the driver stops it with the error in one line, and `streamrl run`
    exits 1 (the driver is not started again)."""
    started = time.monotonic()
    out = subprocess.run(
        _run_args(
            tmp_path,
            tiny_model_dir,
            "--agent",
            "tests.support.gateway_agents:wrong_api_agent",
            "--agent-workers",
            "1",
            "--fail-fast-groups",
            "3",
            "--group-size",
            "2",
        ),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    # well before --max-minutes 4
    assert time.monotonic() - started < 150, text[-3000:]
    lines = [line for line in text.splitlines() if "episodes all failed and nothing trained" in line]
    assert len(lines) == 1, text[-3000:]
    line = lines[0]
    assert "the first 3 groups" in line and "NotFoundError" in line and "/v1/nonexistent" in line, line
    # the progress line counted the failures and showed the error
    assert re.search(
        r"failed (\d+)/\1 episodes \(recent \d+ of \d+, most: \d+x NotFoundError: Error code: 404", text
    ), text[-3000:]
    # the driver was not started again
    assert text.count("driver: run 'kept' started") == 1, text[-3000:]

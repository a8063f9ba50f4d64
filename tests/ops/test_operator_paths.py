"""docs/operations.md's sequence on one run name: `streamrl run` for a few versions, then the Procfile processes the way
`honcho start` runs them. One run, one folder (runs/<run>/ holds its Redis data too), one rule for an ended run
(moved aside, started afresh), and an end-of-run check with every count known."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services.ops.launch.keep import PID_DIR_ENV
from services.ops.launch.keep import processes as keep_processes
from services.ops.launch.redis_server import free_port
from shared.protocol.keys import Keys
from shared.runtime import runstate
from shared.runtime.config.keys import Config
from tests.support.procs import WARM, run_module, starter_pid, wait_until

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run in its own process group; on timeout, nothing of it survives."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} ran past {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def base_env(run_dir: Path, run_name: str, model_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "OMP_NUM_THREADS": "1",
            "STREAMRL_RUN": run_name,
            "STREAMRL_RUN_DIR": str(run_dir),
            "STREAMRL_MODEL_DIR": model_dir,
            "STREAMRL_MAX_VERSIONS": "3",
            "STREAMRL_MAX_MINUTES": "3",
            "STREAMRL_VAL_EVERY": "0",
            # honcho starts every Procfile line, the gateway's too: not on the default port another run may hold
            "STREAMRL_GATEWAY_PORT": str(free_port()),
        }
    )
    return env


@pytest.mark.slow(seconds=120)
def test_streamrl_run_then_honcho_start_on_one_run(tmp_path, tiny_model_dir):
    name = f"seq{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "runs"
    run_path = run_dir / name
    env = base_env(run_dir, name, tiny_model_dir)
    try:
        # 1. `streamrl run`: its embedded Redis keeps its data in the run's folder; the check at the end is complete
        first = run([sys.executable, "-m", "services.ops.cli.main", "run"], env, timeout=280)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        check = first.stderr[first.stderr.index("streamrl check at the end of the run") :]
        # known: every worker wrote its final record
        assert re.search(r"tokens generated again\s+\d+", check), check
        assert (
            "unknown" not in check and "workers_without_final_report" not in check and re.search(r"^ok$", check, re.M)
        )
        assert (run_path / "redis" / "appendonlydir").is_dir() and (run_path / "ENDED").exists()
        # found in the id-keyed weights folder
        assert "streamrl run: exported the last version to" in first.stderr
        first_id = runstate.read_marker(run_path)["id"]
        # the effective config
        assert runstate.read_marker(run_path)["config"]["model_dir"] == tiny_model_dir
        # keyed by the run's id
        first_weights = Config(run=name, run_id=first_id).weights_path
        assert sorted(first_weights.glob("v*.safetensors"))

        # 1b. the ended run read without starting it: its data served from a copy, its recorded config (no
        #     model_dir given), and its folder byte-identical afterwards
        reads_run(env, name, name, run_path, tmp_path / "export-ended", first_weights)

        # 2. the Procfile under honcho (its redis line is `streamrl redis`, on redis_url's port): the same folder,
        #    and the same rule as `streamrl run` for an ended run: moved aside, started afresh
        #    A kill -9 of the rollout worker as soon as it runs: its `streamrl keep` starts it again, the run goes on
        port = free_port()
        pids = tmp_path / "procs"
        honcho_env = {**env, "REDIS_URL": f"redis://127.0.0.1:{port}/0", PID_DIR_ENV: str(pids)}
        honcho = subprocess.Popen(
            [sys.executable, "-m", "honcho", "start", "-f", str(ROOT / "Procfile")],
            env=honcho_env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            wait_until(
                lambda: "rollout" in keep_processes(pids) or honcho.poll() is not None,
                timeout=120,
                what="the rollout worker started under honcho",
            )
            rollout = keep_processes(pids)["rollout"][0]
            # `streamrl keep` forks it from the starter it was handed: this test worker's
            if WARM:
                assert int(Path(f"/proc/{rollout}/stat").read_text().rsplit(")", 1)[1].split()[1]) == starter_pid()
            try:
                os.killpg(rollout, signal.SIGKILL)
            except ProcessLookupError:
                honcho.kill()
                print(honcho.communicate()[0][-6000:])
                raise
            out, _ = honcho.communicate(timeout=280)
        finally:
            if honcho.poll() is None:
                os.killpg(honcho.pid, signal.SIGKILL)
        assert honcho.returncode == 0, out[-4000:]
        assert re.search(r"keep: rollout killed by SIGKILL; restart 1 in [\d.]+ s", out), out[-4000:]
        assert f"streamrl redis: run {name!r} had ended; its files are now in" in out
        reached = re.search(r"driver: reached version (\d+); ending the run", out)
        # a step may publish past 3 before the check
        assert reached and int(reached.group(1)) >= 3, out[-4000:]
        archived = [p for p in run_dir.iterdir() if p.name.startswith(f"{name}.")]
        assert len(archived) == 1 and runstate.read_marker(archived[0])["id"] == first_id
        assert (archived[0] / "redis" / "appendonlydir").is_dir()
        # moved along
        assert sorted((archived[0] / "weights").glob("v*.safetensors")) and not first_weights.exists()
        # the archived run, by its folder
        reads_run(env, archived[0].name, name, archived[0], tmp_path / "export-archived", archived[0] / "weights")
        listed = run([sys.executable, "-m", "services.ops.cli.main", "runs", "--json"], env, timeout=60)
        states = {r["folder"]: (r["run"], r["state"]) for r in json.loads(listed.stdout)}
        assert states == {archived[0].name: (name, "archived"), name: (name, "ended")}, listed.stdout
        second_id = runstate.read_marker(run_path)["id"]
        assert second_id != first_id and (run_path / "redis" / "appendonlydir").is_dir()
        assert json.loads((run_path / "ENDED").read_text())["version"] >= 3
        assert "Traceback" not in out
    finally:
        for folder in Path("/dev/shm").glob(f"streamrl-{os.getuid()}/{name}-*"):
            shutil.rmtree(folder, ignore_errors=True)


def tree_hash(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def reads_run(env: dict, folder_name: str, run_name: str, run_path: Path, out: Path, weights: Path) -> None:
    """inspect, replay, check and export of a run no server serves, as `--run <folder name>`, with no model_dir
    given: each works and the run's folder is byte-for-byte what it was."""
    env = {k: v for k, v in env.items() if k not in ("STREAMRL_MODEL_DIR", "STREAMRL_RUN")}
    before = tree_hash(run_path)

    # each a `streamrl` process of its own (forked from the test worker's warm starter)
    def cli(*argv: str) -> subprocess.CompletedProcess:
        done = run_module("services.ops.cli.main", *argv, env=env, timeout=120)
        return subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode(), done.stderr.decode())

    inspect = cli("inspect", "--run", folder_name, "--json")
    assert inspect.returncode == 0 and "serving a copy of" in inspect.stderr, inspect.stderr
    episode = next(s["key"] for s in json.loads(inspect.stdout) if ":ep:" in s["key"])
    replay = cli("replay", "--run", folder_name, Keys(run_name).episode_id(episode))
    assert replay.returncode == 0 and "status finished" in replay.stdout, replay.stderr
    dbsize = cli("redis-cli", "--run", folder_name, "--", "DBSIZE")
    assert dbsize.returncode == 0 and int(dbsize.stdout.split()[-1]) > 0, dbsize.stdout + dbsize.stderr
    status = cli("status", "--run", folder_name)
    assert status.returncode == 0 and "reward" in status.stdout, status.stderr
    # the tiers: Redis memory, keys
    assert re.search(r"redis [\d.]+ MB.*, [\d,]+ keys", status.stdout), status.stdout
    check = cli("check", "--run", folder_name)
    assert check.returncode == 0 and re.search(r"^ok$", check.stdout, re.M), check.stdout + check.stderr
    # the oldest kept (the newest is exported)
    version = int(min(weights.glob("v*.safetensors")).name[1:7])
    export = cli("export", "--run", folder_name, "--version", str(version), "--out", str(out))
    assert export.returncode == 0, export.stderr
    assert json.loads((out / "streamrl.json").read_text())["version"] == version and (out / "config.json").exists()
    assert tree_hash(run_path) == before


def test_driver_on_an_ended_run_continues_nothing_in_one_line(redis_url, client, tmp_path):
    """With a Redis whose data is not in the run's folder (REDIS_URL), an ended run cannot be moved aside:
    the driver says so in one line and exits at once, starting nothing."""
    keys = Keys(f"ended{uuid.uuid4().hex[:8]}")
    runstate.bind(client, keys, tmp_path / keys.run, redis_url)
    runstate.mark_ended(client, keys, 5)
    env = {**os.environ, "REDIS_URL": redis_url, "STREAMRL_RUN": keys.run, "STREAMRL_RUN_DIR": str(tmp_path)}
    out = run([sys.executable, "-m", "services.ops.cli.main", "drive"], env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"driver: run {keys.run!r} ended at version 5 on ")
    assert "nothing to continue" in lines[0] and "--run NAME" in lines[0]
    assert not client.exists(keys.prompts)

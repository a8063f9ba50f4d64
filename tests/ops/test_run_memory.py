"""A run remembers itself: run.json records the effective config (never a secret), commands naming --run start from
it, an interrupted run continues only with its own model, archiving keeps the ended run's weights and touches no
other run's, and the default weights folders are private and keyed by the run's id."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from services.driver.driver import ENDED
from services.ops.cli.main import main
from services.ops.inspect import run_target
from services.ops.inspect.runs import format_runs, list_runs
from services.ops.launch.runner import archive_ended_run
from shared.protocol.keys import Keys
from shared.runtime import folders, runstate
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.connection import connect


def test_the_record_holds_the_effective_config_and_no_secret(client, redis_url, tmp_path):
    cfg = Config(
        run="r",
        run_dir=str(tmp_path),
        model_dir="some/model",
        gateway_api_key="gw-s3cret",
        weights_token="wt-s3cret",
        redis_url="redis://:pw-s3cret@127.0.0.1:6390/0",
        max_tokens=48,
    )
    record = runstate.recordable(cfg)
    assert record["model_dir"] == "some/model" and record["max_tokens"] == 48 and record["prompt_key"] == "prompt"
    assert "gateway_api_key" not in record and "weights_token" not in record
    assert "s3cret" not in json.dumps(record) and record["redis_url"] == "redis://:***@127.0.0.1:6390/0"
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    meta = runstate.bind(client, keys, tmp_path / keys.run, redis_url, config=record)
    on_disk = (tmp_path / keys.run / runstate.MARKER).read_text()
    assert "s3cret" not in on_disk and json.loads(on_disk)["config"] == record
    assert runstate.recorded_config(meta) == record == runstate.recorded_config(runstate.read_meta(client, keys))


def test_a_command_starts_from_the_recorded_config_and_says_when_a_setting_differs():
    recorded = {
        "model_dir": "models/mine",
        "max_tokens": 48,
        "lr": 1,
        "redis_url": "redis://elsewhere:1/0",
        "run": "other",
        "unknown_key": 1,
    }
    cfg, notes = run_target.with_recorded(Config(), {}, recorded, "runs/demo/run.json")
    assert (cfg.model_dir, cfg.max_tokens, cfg.lr) == ("models/mine", 48, 1.0)
    # where it runs: the command's
    assert (cfg.redis_url, cfg.run) == (Config().redis_url, "demo") and notes == []
    cfg, notes = run_target.with_recorded(
        Config(model_dir="models/x"), {"model_dir": "flag --model-dir"}, recorded, "runs/demo/run.json"
    )
    assert cfg.model_dir == "models/x" and cfg.max_tokens == 48
    assert notes == [
        "model_dir 'models/x' (flag --model-dir) is not what run 'demo' was made with: 'models/mine' "
        "(runs/demo/run.json); using 'models/x'"
    ]


def test_continuing_an_interrupted_run_with_another_model_is_one_line_exit_2(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    monkeypatch.delenv("REDIS_URL", raising=False)
    run_path = tmp_path / "runs" / "demo"
    runstate.write_marker(
        run_path,
        {"run": "demo", "id": "abc", "created": "t", "config": json.dumps({"model_dir": "models/qwen3"})},
        "redis://127.0.0.1:1/0",
    )
    before = sorted(p.name for p in run_path.iterdir())
    rc = main(["run", "--run", "demo", "--run-dir", str(tmp_path / "runs"), "--model-dir", tiny_model_dir])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"streamrl run: config key 'model_dir': run 'demo' was interrupted; it was made with "
        f"model_dir 'models/qwen3' ({run_path / 'run.json'}), not {tiny_model_dir!r}: continue "
        f"it with --model-dir models/qwen3, or start another with --run NAME"
    ]
    assert sorted(p.name for p in run_path.iterdir()) == before


def ended_run(run_dir, name: str, run_id: str) -> Config:
    """A run folder of ``name`` that its driver ended, with its weights in the default folder of id ``run_id``."""
    cfg = Config(run=name, run_dir=str(run_dir), run_id=run_id)
    runstate.write_marker(cfg.run_path, {"run": name, "id": run_id, "created": "t"}, "redis://127.0.0.1:1/0")
    (cfg.run_path / ENDED).write_text("{}")
    cfg.weights_path.mkdir(parents=True)
    (cfg.weights_path / "v000001.safetensors").write_bytes(b"w-" + run_id.encode())
    return cfg


def test_two_checkouts_keep_separate_weights_and_archiving_one_moves_only_its_own(tmp_path):
    name = f"same{uuid.uuid4().hex[:8]}"
    mine = ended_run(tmp_path / "checkout-a" / "runs", name, uuid.uuid4().hex[:12])
    theirs = ended_run(tmp_path / "checkout-b" / "runs", name, uuid.uuid4().hex[:12])
    try:
        # same name, two runs: two folders
        assert mine.weights_path != theirs.weights_path
        # as `streamrl run` / `streamrl redis` call it
        dest = archive_ended_run(mine.replace(run_id=""))
        assert (dest / "weights" / "v000001.safetensors").read_bytes() == b"w-" + mine.run_id.encode()
        assert not mine.weights_path.exists() and not mine.run_path.exists()
        assert (theirs.weights_path / "v000001.safetensors").read_bytes() == b"w-" + theirs.run_id.encode()
        assert (theirs.run_path / ENDED).exists()
    finally:
        for cfg in (mine, theirs):
            if cfg.weights_path.is_relative_to("/dev/shm"):
                import shutil

                shutil.rmtree(cfg.weights_path, ignore_errors=True)


def test_the_default_weights_folder_is_private_and_refused_when_another_user_owns_it(tmp_path, monkeypatch):
    monkeypatch.setattr(folders, "SHM", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    cfg = Config(run="demo", run_id="abc123")
    assert cfg.weights_path == tmp_path / "shm" / f"streamrl-{os.getuid()}" / "demo-abc123"
    folders.private_folder(cfg.weights_path, "weights_dir")
    assert cfg.weights_path.stat().st_mode & 0o777 == 0o700
    assert cfg.weights_path.parent.stat().st_mode & 0o777 == 0o700
    # now the folder is another's
    monkeypatch.setattr(folders.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    other = tmp_path / "shm" / f"streamrl-{os.stat(tmp_path).st_uid + 1}"
    other.mkdir()
    with pytest.raises(ConfigError, match=f"config key 'weights_dir': {other} belongs to another user"):
        folders.private_folder(other / "demo-abc123", "weights_dir")


def test_runs_lists_ended_archived_and_interrupted_runs(tmp_path):
    run_dir = tmp_path / "runs"
    ended = Config(run="a", run_dir=str(run_dir))
    runstate.write_marker(
        ended.run_path,
        {"run": "a", "id": "1", "created": "2026-01-01T00:00:00Z", "config": json.dumps({"model_dir": "models/m"})},
        "redis://127.0.0.1:1/0",
    )
    (ended.run_path / "metrics.jsonl").write_text(json.dumps({"version": 7, "reward_mean": 0.5}) + "\n")
    (ended.run_path / ENDED).write_text("{}")
    runstate.write_marker(
        run_dir / "a.20260101-000000",
        {"run": "a", "id": "0", "created": "2025-12-31T00:00:00Z"},
        "redis://127.0.0.1:1/0",
    )
    runstate.write_marker(
        run_dir / "b", {"run": "b", "id": "2", "created": "2026-01-02T00:00:00Z"}, "redis://127.0.0.1:1/0"
    )
    (run_dir / "not-a-run").mkdir()
    rows = list_runs(run_dir, live=lambda folder, marker: folder.name == "b")
    assert [(r.folder, r.run, r.state) for r in rows] == [
        ("a.20260101-000000", "a", "archived"),
        ("a", "a", "ended"),
        ("b", "b", "live"),
    ]
    assert (rows[1].model, rows[1].version, rows[1].reward) == ("models/m", 7, 0.5)
    assert list_runs(run_dir, live=lambda *_: False)[2].state == "interrupted"


def test_runs_shows_the_mean_reward_of_the_last_steps_not_the_last_one_alone(tmp_path):
    run_dir = tmp_path / "runs"
    cfg = Config(run="a", run_dir=str(run_dir))
    runstate.write_marker(cfg.run_path, {"run": "a", "id": "1", "created": "2026-01-01T00:00:00Z"}, "redis://x:1/0")
    steps = [{"version": v, "reward_mean": 0.0 if v < 10 else 1.0, "loss": 0.1} for v in range(1, 31)]
    # the newest step is a poor one, and the file ends half written (a trainer killed mid-line)
    steps[-1]["reward_mean"] = 0.2
    text = "".join(json.dumps(m) + "\n" for m in steps) + '{"version": 31, "rew'
    (cfg.run_path / "metrics.jsonl").write_text(text)
    (row,) = list_runs(run_dir, live=lambda *_: False)
    # versions 11-30: nineteen steps at 1.0 and the last at 0.2
    assert row.version == 30 and row.reward == pytest.approx((19 * 1.0 + 0.2) / 20)
    assert "reward: the mean of each run's last 20 trainer steps" in format_runs([row], str(run_dir))


def test_the_readme_order_default_agent_default_gets_each_run_its_recipes_model(tmp_path, monkeypatch, capsys):
    """README's order of commands: `./dev run`, `./dev run --agent examples.calc:agent`, `./dev run` again: each run
    starts on the default model made for its own recipe (remade with one line when the last run wanted another)."""
    from services.ops.launch import default_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(default_model, "DEFAULT_WARM_STEPS", 0)
    monkeypatch.setattr(default_model, "AGENT_WARM_STEPS", 0)
    context = lambda: json.loads((tmp_path / "models" / "tiny" / "config.json").read_text())["max_position_embeddings"]
    for cfg, want in [
        (Config(), 256),
        (Config(agent="examples.calc:agent"), default_model.AGENT_CONTEXT),
        (Config(), 256),
    ]:
        default_model.ensure_model(cfg)
        assert context() == want
    assert capsys.readouterr().err.count("remaking it") == 2


def test_an_interrupted_run_on_the_default_model_is_not_remade_under_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    runstate.write_marker(
        tmp_path / "runs" / "demo",
        {"run": "demo", "id": "abc", "created": "t", "config": json.dumps(runstate.recordable(Config()))},
        "redis://127.0.0.1:1/0",
    )
    assert main(["run", "--run-dir", "runs", "--agent", "examples.calc:agent"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was interrupted; it was made on the default model for" in err[0]
    assert not (tmp_path / "models").exists()


def test_run_outside_the_checkout_finds_its_procfile(tmp_path, monkeypatch):
    from services.ops.launch.runner import PACKAGE_ROOT, find_procfile

    monkeypatch.chdir(tmp_path)
    assert find_procfile("Procfile") == PACKAGE_ROOT / "Procfile"
    (tmp_path / "Procfile").write_text("driver: exec true\n")
    # one here wins
    assert find_procfile("Procfile").resolve() == tmp_path / "Procfile"


def test_the_venvs_streamrl_runs_its_lines_without_the_venv_on_path(tmp_path, redis_url, tiny_model_dir):
    """`.venv/bin/streamrl run` with the venv not activated: the Procfile's `streamrl` lines still find it."""
    import subprocess
    import sys

    (tmp_path / "Procfile").write_text("driver: exec streamrl schema\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    env.update({"PATH": "/usr/bin:/bin", "REDIS_URL": redis_url, "STREAMRL_RUN_DIR": str(tmp_path / "runs")})
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "run", "--model-dir", tiny_model_dir],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the schema was printed
    assert "not found" not in out.stdout + out.stderr and "samples" in out.stdout


def test_a_live_run_on_its_embedded_password_protected_redis_is_found_by_runs_and_status(tmp_path):
    """run.json records the embedded server's URL with its password masked: commands find the live run there with
    the password from the run's secrets file (not a copy of its files served instead)."""
    from services.ops.inspect.run_target import is_live, resolve, serving_url
    from services.ops.launch.redis_server import EmbeddedRedis
    from shared.runtime import secrets

    cfg = Config(run="live", run_dir=str(tmp_path / "runs"))
    server = EmbeddedRedis(tmp_path / "redis", password="s3cret-pw").start()
    try:
        client = connect(server.url)
        meta = runstate.bind(client, Keys("live"), cfg.run_path, server.url, config={"model_dir": "m"})
        secrets.write(cfg.run_path, {"redis_password": "s3cret-pw", "redis_server": secrets.server_of(server.url)})
        marker = runstate.read_marker(cfg.run_path)
        assert "s3cret-pw" not in json.dumps(marker) and marker["id"] == meta["id"]
        assert is_live(cfg, cfg.run_path, marker)
        target, _ = resolve(cfg, {})
        assert serving_url(target, {}) == server.url
        secrets.write(cfg.run_path, {"redis_password": "wrong", "redis_server": secrets.server_of(server.url)})
        # a refused password: not live (no traceback)
        assert not is_live(cfg, cfg.run_path, marker)
    finally:
        server.stop()

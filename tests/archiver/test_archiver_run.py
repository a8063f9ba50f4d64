"""A whole `streamrl run` with a retention window: the archiver moves trained episodes out of Redis while the run
goes, the end-of-run check is all zero across both tiers, and a moved episode replays from its segment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.protocol.archive import segments

ROOT = Path(__file__).resolve().parents[2]
# a whole run
pytestmark = pytest.mark.slow


def test_a_run_with_a_retention_window_moves_episodes_and_checks_clean(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    common = ["--run", "tiers", "--run-dir", str(tmp_path / "runs")]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.ops.cli.main",
            "run",
            *common,
            "--model-dir",
            tiny_model_dir,
            "--weights-dir",
            str(tmp_path / "weights"),
            "--max-versions",
            "24",
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
            "--log-retention-versions",
            "4",
            "--archive-every-s",
            "0.5",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # the end-of-run check counts both tiers
    assert "ok" in out.stderr.splitlines(), out.stderr[-3000:]
    folder = segments.folder_of(tmp_path / "runs" / "tiers")
    sizes = segments.SegmentStore(folder).sizes()
    assert sizes["segments"] >= 1 and sizes["episodes"] >= 8, (sizes, out.stderr[-2000:])
    moved = sorted(segments.SegmentStore(folder).ids())[0]
    replay = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "replay", moved, "--no-text", *common],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replay.returncode == 0, replay.stderr[-2000:]
    assert moved in replay.stdout

"""bench/staleness.py trains at staleness fixed exactly: every batch trained at version v was sampled by v − η."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_staleness", ROOT / "bench" / "staleness.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_staleness", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_behaviour_version_is_exact():
    b = _bench()
    assert [b.behaviour_version(v, 3) for v in range(6)] == [0, 0, 0, 0, 1, 2]
    assert [b.behaviour_version(v, 0) for v in range(4)] == [0, 1, 2, 3]


def test_unknown_correction_is_named():
    with pytest.raises(ValueError, match="unknown 'nope'"):
        _bench().step_config("nope")


def test_trained_batches_come_from_version_v_minus_eta(tmp_path):
    from services.driver.tasks import builtin
    from services.ops.tiny_model import make_default_model

    b = _bench()
    model_dir = make_default_model(tmp_path / "m", warm_steps=20, seed=0)
    setup = b.Setup.from_defaults(steps=6, batch_groups=2, group_size=4, max_tokens=4)
    cell = b.run_cell(model_dir, 2, "default", 0, setup, builtin("arithmetic", 8, seed=5))
    assert cell["behaviour_versions"] == [0, 0, 0, 1, 2, 3]  # v − 2 once version v − 2 exists
    assert cell["snapshots_kept"] == 3  # η + 1
    # at η = 0 every token is the trainer's current version's: the engine mismatch is 0 on torch
    fresh = b.run_cell(model_dir, 0, "default", 0, setup, builtin("arithmetic", 8, seed=5))
    assert fresh["behaviour_versions"] == list(range(6))
    assert all(k is not None and abs(k) < 1e-6 for k in fresh["mismatch_kl_current"])

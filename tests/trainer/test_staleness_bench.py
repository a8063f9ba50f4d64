"""bench/staleness.py trains at staleness fixed exactly: every batch trained at version v was sampled by v − η."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_staleness", ROOT / "bench" / "staleness.py")
    mod = importlib.util.module_from_spec(spec)
    # dataclasses look their module up
    sys.modules.setdefault("bench_staleness", mod)
    spec.loader.exec_module(mod)
    return mod


def test_behaviour_version_is_exact():
    b = _bench()
    assert [b.behaviour_version(v, 3) for v in range(6)] == [0, 0, 0, 0, 1, 2]
    assert [b.behaviour_version(v, 0) for v in range(4)] == [0, 1, 2, 3]


def test_unknown_correction_is_named():
    with pytest.raises(ValueError, match="unknown 'nope'"):
        _bench().step_config("nope")


def test_held_out_problems_are_distinct_and_never_trained():
    b = _bench()
    pool, held = b.split_task(3, 100)
    assert len({r["prompt"] for r in held}) == 100 and len(pool) == 900
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in pool}
    assert held[0]["answer"] == str(sum(int(t) for t in held[0]["prompt"].rstrip("=").split("+")))
    with pytest.raises(ValueError, match="--eval-size 600: expected 1..500"):
        b.split_task(3, 600)


def test_correction_with_changes():
    b = _bench()
    assert b.step_config("m2po:m2po_tau=0.02").m2po_tau == 0.02
    assert b.step_config("token-truncate:is_cap=2").is_cap == 2.0
    with pytest.raises(ValueError, match="field=value"):
        b.step_config("m2po:tau=1")


def test_paired_parity_stops_at_the_first_failure():
    b = _bench()
    cells = [
        {"seed": s, "correction": c, "eta": e, "eval": v}
        for s in (0, 1)
        for c, e, v in (("a", 0, 0.8), ("a", 2, 0.79), ("a", 8, 0.7), ("a", 32, 0.8))
    ]
    _, summary = b.table(cells, [0, 2, 8, 32], ["a"])
    # η = 32's parity after η = 8's failure does not count
    assert summary["a"]["parity_eta"] == 2
    assert summary["a"]["diff"]["8"][0] == pytest.approx(-0.1)
    # no spread over the seeds: -0.1 is clearly below -0.02
    assert summary["a"]["clearly_worse_eta"] == 8


def test_trained_batches_come_from_version_v_minus_eta(tmp_path):
    b = _bench()
    pool, held = b.split_task(2, 8)
    model_dir = b.make_model(tmp_path / "m", pool, warm_steps=20, seed=0)
    setup = b.Setup.from_defaults(steps=6, batch_groups=2, group_size=4, max_tokens=4, eval_every=2, eval_last=2)
    cell = b.run_cell(model_dir, 2, "default", 0, setup, held, pool)
    # the eval: the mean of the last 2 evaluated versions
    assert [v for v, _ in cell["eval_curve"]] == [4, 6]
    # v − 2 once version v − 2 exists
    assert cell["behaviour_versions"] == [0, 0, 0, 1, 2, 3]
    # η + 1
    assert cell["snapshots_kept"] == 3
    # at η = 0 every token is the trainer's current version's: the engine mismatch is 0 on torch
    fresh = b.run_cell(model_dir, 0, "default", 0, setup, held, pool)
    assert fresh["behaviour_versions"] == list(range(6))
    assert all(k is not None and abs(k) < 1e-6 for k in fresh["mismatch_kl_current"])


def test_grid_from_a_first_seed_trains_eta_0_once_per_seed():
    cells = _bench().grid([0, 8], ["a", "b"], seeds=2, first_seed=3)
    assert cells == [(3, "a", 0), (3, "a", 8), (3, "b", 8), (4, "a", 0), (4, "a", 8), (4, "b", 8)]


def test_merge_reads_a_record_and_new_cells_and_refuses_a_cell_twice(tmp_path):
    import json

    b = _bench()
    old = [
        {
            "seed": s,
            "correction": "default",
            "eta": e,
            "eval": 0.8 + 0.03 * (s == 2) - 0.01 * e,
            "curve": [0.5],
            "masked_fraction_mean": 0.0,
        }
        for s in (0, 1, 2)
        for e in (0, 2)
    ]
    (tmp_path / "record.json").write_text(json.dumps({"name": "staleness", "extra": {"cells": old}}))
    new = [
        {
            "seed": s,
            "correction": "m2po",
            "eta": 8,
            "eval": 0.79,
            "curve": [0.5],
            "masked_fraction": [0.1],
            "mismatch_kl_current": [0.0],
            "behaviour_versions": [0],
        }
        for s in (0, 1)
    ]
    (tmp_path / "new.json").write_text(json.dumps(new))
    cells = b.merge_cells([str(tmp_path / "record.json"), str(tmp_path / "new.json")])
    assert len(cells) == 8 and b.slim(cells[0]) == old[0] and "masked_fraction" not in b.slim(cells[-1])
    md, summary = b.table(cells, [0, 2, 8], ["default", "m2po"])
    assert summary["m2po"]["seeds"] == 2 and summary["default"]["seeds"] == 3
    # η = 2 not trained: skipped
    assert "2" not in summary["m2po"]["diff"] and summary["m2po"]["parity_eta"] == 8
    # paired with seeds 0 and 1's η = 0 only
    assert summary["m2po"]["diff"]["8"][0] == pytest.approx(-0.01)
    # η = 0: seeds 0 and 1
    assert "| m2po | 2 | 0.800 ± 0.000<br>+0.000 ± 0.000 | – |" in md
    (tmp_path / "again.json").write_text(json.dumps(new[:1]))
    with pytest.raises(ValueError, match="seed 0 m2po η=8 is in both .*new.json and .*again.json"):
        b.merge_cells([str(tmp_path / "new.json"), str(tmp_path / "again.json")])
    (tmp_path / "other.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="other.json: expected a list of cells or a record with extra.cells"):
        b.merge_cells([str(tmp_path / "other.json")])

"""bench/learning/defaults_reach.py's pure parts: when a run's 20-step mean reward first reaches 0.9, and the
candidate's config keys (the bench itself runs whole `streamrl run`s: not in the suite)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_defaults_reach", ROOT / "bench" / "learning" / "defaults_reach.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_reached_is_the_first_version_whose_trailing_20_step_mean_reaches_the_target():
    records = [{"version": v, "reward_mean": 0.5} for v in range(1, 31)]
    records += [{"version": v, "reward_mean": 1.0} for v in range(31, 60)]
    # other records are not steps
    records.insert(5, {"version": 3, "kind": "rollout"})
    # the window [v-19, v] holds k ones and 20-k halves: mean >= 0.9 once k >= 16, first at v = 46
    assert bench.reached(records) == 46
    assert bench.reached(records, target=1.0) == 50
    # never got there
    assert bench.reached(records[:25]) is None


def test_a_candidate_is_key_value_pairs_and_a_bad_part_is_named():
    assert bench.parse_candidate("lr=5e-5, is_mode=truncate,") == {"lr": "5e-5", "is_mode": "truncate"}
    with pytest.raises(SystemExit, match="got 'max_staleness'"):
        bench.parse_candidate("lr=5e-5,max_staleness")


def test_reached_at_also_says_how_many_seconds_after_the_first_step():
    records = [{"version": v, "time": 100.0 + v / 2, "reward_mean": 0.5 if v <= 30 else 1.0} for v in range(1, 60)]
    assert bench.reached_at(records) == (46, 22.5)
    # records without times: the version alone
    assert bench.reached_at([{k: v for k, v in r.items() if k != "time"} for r in records]) == (46, None)
    assert bench.reached_at(records[:25]) is None

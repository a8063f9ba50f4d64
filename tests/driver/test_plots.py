"""The run's plots from its metrics file: written without a warning when the trust region never bound."""

from __future__ import annotations

import json
import warnings

from services.driver.plots import write_plots
from shared.runtime.config.keys import Config


def test_plots_of_a_run_whose_clip_never_bound_raise_no_warning(tmp_path, redis_url, keys):
    cfg = Config(run=keys.run, run_dir=str(tmp_path), redis_url=redis_url)
    cfg.run_path.mkdir(parents=True)
    steps = [
        {
            "time": 100.0 + i,
            "step": i,
            "version": i,
            "samples": 64,
            "tokens": 300,
            "reward_mean": 0.1 * i,
            "staleness": {"0": 300},
            "train_s": 0.5,
            "wait_s": 0.1,
            "clip_fraction": 0.0,
        }
        for i in range(1, 6)
    ]
    (cfg.run_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    with warnings.catch_warnings():
        # matplotlib's "No artists with labels found to put in legend" was one
        warnings.simplefilter("error")
        written = write_plots(cfg)
    assert [p.name for p in written] == ["training.png", "utilization.png", "trust_region.png"]
    assert all(p.stat().st_size > 0 for p in written)

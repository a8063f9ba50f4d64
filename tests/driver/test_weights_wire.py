"""Weights on the wire in `streamrl status` and the plots: pure summaries of the trainer's ``publish``
records and the rollout workers' counters."""

from __future__ import annotations

from services.driver.plots import plot_weights_wire
from services.driver.status import format_line, weights_wire

PUBLISHED = [
    {"version": 1, "snapshot": True, "full_bytes": 1000, "delta_bytes": 0},
    {"version": 2, "snapshot": False, "full_bytes": 1000, "delta_bytes": 30, "floor_bytes": 25},
    {"version": 3, "snapshot": False, "full_bytes": 1000, "delta_bytes": 20, "floor_bytes": 16},
]
ROLLOUT = [
    {
        "worker": "a",
        "fetched_bytes": 1030,
        "delta_bytes": 30,
        "delta_full_bytes": 1000,
        "delta_versions": 1,
        "delta_chain_max": 1,
    },
    {
        "worker": "a",
        "fetched_bytes": 1050,
        "delta_bytes": 50,
        "delta_full_bytes": 2000,
        "delta_versions": 2,
        # a's newest record replaces its first
        "delta_chain_max": 1,
    },
    {"worker": "b", "fetched_bytes": 2000, "delta_fallbacks": 1, "delta_chain_max": 0},
]


def test_the_summary_takes_each_workers_newest_record_and_the_newest_delta():
    w = weights_wire(PUBLISHED, ROLLOUT)
    assert (w["versions"], w["deltas"], w["last_version"]) == (3, 2, 3)
    assert w["last_fraction"] == 0.02 and w["last_over_floor"] == 1.25
    assert (w["fetched_bytes"], w["delta_bytes"], w["delta_full_bytes"]) == (3050, 50, 2000)
    assert (w["delta_versions"], w["delta_fallbacks"], w["delta_chain_max"]) == (2, 1, 1)
    snap = {
        "version": 3,
        "train": {},
        "validation": None,
        "sync": None,
        "samples_per_s": 0.0,
        "alive": {},
        "dead_letters": 0,
        "weights": w,
    }
    assert "weights as deltas: v3 2.00% of the file, 1.25x the floor" in format_line(snap)
    assert "1 fallbacks" in format_line(snap)
    # no deltas: not shown
    assert "deltas" not in format_line({**snap, "weights": weights_wire(PUBLISHED[:1], [])})


def test_the_plot_is_written_only_with_deltas(tmp_path):
    assert plot_weights_wire(PUBLISHED[:1], tmp_path / "none.png") is None
    path = plot_weights_wire(PUBLISHED, tmp_path / "wire.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_status_line_says_the_trainers_last_snapshot_and_what_a_crash_would_re_train():
    from services.driver.status import snapshot_words

    assert snapshot_words(None, 7, 100.0) == ""
    snap = {"version": 25, "time": 59.0}
    assert snapshot_words(snap, 28, 100.0) == "snapshot v25 41 s ago, a crash re-trains 3 versions"
    assert snapshot_words(snap, 26, 100.0).endswith("re-trains 1 version")

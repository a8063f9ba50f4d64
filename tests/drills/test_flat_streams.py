"""The streams that grew with a run's length stay bounded in Redis while every reader still sees every record
``metrics`` (a time window; older records in ``<run>/streams/metrics.jsonl``, the trainer's in its
``metrics.jsonl``), ``versions`` (the newest few and a time window), ``prompts:val`` / ``samples:val`` (below what
the rollout group and the validator need). A live run with ``stream_keep_s`` 0 to version 30, validating every 4
versions: at the end Redis holds a few entries of each (it held every entry before), and `streamrl check`, the
plots, the UI, `streamrl status` and a restarted validator read them all, once."""

from __future__ import annotations

import time

import pytest

from services.driver.plots import read_metrics
from services.driver.status import snapshot
from services.driver.validation import Validator
from services.ops.check.checker import check
from services.ops.check.data import read_run
from services.ops.ui.run_view import read_run_view
from shared.protocol.streams import metrics, versions
from tests.support.fault_run import LiveRun

pytestmark = pytest.mark.slow(seconds=20)

VERSIONS = 30


def test_metrics_versions_and_validation_streams_stay_bounded_while_readers_see_every_record(tmp_path, tiny_model_dir):
    run = LiveRun(
        tmp_path,
        run="heads",
        model_dir=tiny_model_dir,
        max_tokens=8,
        group_size=2,
        batch_groups=2,
        val_every=4,
        val_size=2,
        max_versions=200,
        max_minutes=4.0,
        step_delay_ms=0.0,
        heartbeat_ttl=2.0,
        stream_keep_s=0.0,
        log_level="warning",
    ).start(rollout_workers=1)
    try:
        run.wait_version(VERSIONS, timeout=240)
        run.wait(
            lambda: (
                len(metrics.history(run.client, run.keys, run.cfg.run_path, ("validation",))["validation"])
                >= VERSIONS // 4 - 1
            ),
            "validation rounds reported",
            timeout=60,
        )
        # the fewest entries each stream held over 3 s of the live run: a trim every 0.5 s brings a bounded stream
        # back down (one sample alone may fall just before a trim the driver's loop ran late); an unbounded one
        # never comes down
        lengths: dict[str, int] = {}
        for _ in range(30):
            for name in ("metrics", "versions", "val_prompts", "val_samples"):
                n = run.client.xlen(getattr(run.keys, name))
                lengths[name] = min(lengths.get(name, n), n)
            time.sleep(0.1)
        run.stop()
        cfg, client, keys = run.cfg, run.client, run.keys
        found = metrics.history(client, keys, cfg.run_path)
        report = check(read_run(client, keys, cfg.run_path))
        train, rollout, validation, published = read_metrics(cfg)
        view = read_run_view(client, keys, cfg.run_path)
        status = snapshot(client, keys, cfg.run_path)
        restarted = Validator(client, keys, [], 4, 2, run_path=cfg.run_path)
        newest = versions.latest_number(client, keys)
        every_version = [v.version for v in versions.read_all(client, keys, cfg.run_path)]
    finally:
        run.stop()
        run.close()
    rounds = [r["version"] for r in found["validation"]]
    entries = sum(len(v) for v in found.values())
    # a train and a sync per version...
    assert entries >= 2 * VERSIONS, {k: len(v) for k, v in found.items()}
    # ... of which Redis held a few (before: every one)
    assert lengths["metrics"] <= 20, (lengths, entries)
    assert lengths["versions"] <= versions.KEEP_LAST + 8 and every_version == list(range(1, newest + 1)), lengths
    # a round's entries, the next one's, and what arrived since the last trim (every 0.5 s here: a fast run can
    # start a third round in between); without the trim they hold every round's (~28 at version 30)
    assert lengths["val_prompts"] <= 3 * 4 and lengths["val_samples"] <= 3 * 4, lengths
    # each round reported once
    assert len(rounds) >= VERSIONS // 4 - 1 and rounds == sorted(set(rounds)), rounds
    assert (
        report.versions_missing,
        report.versions_repeated,
        report.groups_lost,
        report.groups_enqueued_twice,
        report.samples_trained_twice,
    ) == (0, 0, 0, 0, 0), report
    assert [r["step"] for r in train] == [r["step"] for r in found["train"]] and len(train) >= VERSIONS
    assert [r["version"] for r in validation] == rounds and len(published) == len(found["publish"])
    assert {r["worker"] for r in rollout} == {r["worker"] for r in found["rollout"]} != set()
    assert view["validation"]["version"] == rounds and len(view["train"]["step"]) == len(train)
    assert status["validation"] is not None and status["validation"]["version"] == rounds[-1]
    # a restarted driver reports no round twice
    assert set(rounds) <= restarted.reported

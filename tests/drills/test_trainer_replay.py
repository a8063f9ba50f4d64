"""The trainer killed at random places between its snapshots, again and again on one run: each restart loads the
newest snapshot and re-trains the ledger's commits after it from the episode log; every re-trained version must hash
as it was published, no group may be lost or trained twice, and every version is published once.

By default 3 kills with a snapshot every 5 versions; ``DRILL_FULL=1`` (.ci/run) runs the drill docs/faults.md names:
20 kills with a snapshot every 25 versions.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from services.ops.check.checker import check, read_run
from shared.protocol.archive.ledger import last_commit, read_ledger, read_replays
from shared.protocol.streams import versions as pversions
from tests.support.procs import kill9
from tests.trainer.test_trainer import _cfg, _finish, _trainer_proc, _write_group

FULL = bool(os.environ.get("DRILL_FULL"))
KILLS, SNAPSHOT_EVERY = (20, 25) if FULL else (3, 5)
# where a kill lands: mid-step, each point of the commit path, the publisher's thread (a version in a commit: 1 step)
POINTS = ("stepped", "before_ledger", "after_ledger", "after_ack", "after_publish")

pytestmark = [pytest.mark.slow(seconds=150 if FULL else 25), pytest.mark.timeout(1800)]


def test_the_trainer_killed_at_random_versions_re_derives_every_published_version(
    client, keys, redis_url, tiny_model_dir, tmp_path
):
    rng = random.Random(47)
    cfg = _cfg(keys, tiny_model_dir, tmp_path)
    ledger_dir = cfg.run_path / "trainer"
    # kills land at random versions, most between two snapshots: up to two snapshot periods into each process
    plan = [(rng.choice(POINTS), rng.randint(1, 2 * SNAPSHOT_EVERY - 1)) for _ in range(KILLS)]
    groups = [f"d{i:04d}" for i in range(sum(n for _, n in plan) + 2 * SNAPSHOT_EVERY)]
    for g in groups:
        _write_group(client, keys, g)
    flags = dict(snapshot_every=SNAPSHOT_EVERY, batch_groups=1, steps_per_version=1)
    killed_at = []
    for point, nth in plan:
        proc = _trainer_proc(redis_url, cfg, crash_at=point, nth=nth, **flags)
        try:
            assert proc.wait(300) == -signal.SIGKILL, (point, nth)
        finally:
            if proc.poll() is None:
                kill9(proc)
        killed_at.append(last_commit(read_ledger(ledger_dir)))
        trained = [g for rec in read_ledger(ledger_dir) for g in rec["groups"]]
        assert len(trained) == len(set(trained)), (point, nth)
    last = _finish(client, keys, ledger_dir, groups, _trainer_proc(redis_url, cfg, **flags), 600)
    replays = read_replays(ledger_dir)
    print(
        f"drill: {KILLS} kills (snapshot every {SNAPSHOT_EVERY}) at versions {killed_at}; "
        f"{sum(1 for r in replays if r['replayed'])} restores re-trained "
        f"{sum(len(r['replayed']) for r in replays)} versions, published {sum(len(r['published']) for r in replays)},"
        f" {sum(len(r['differing']) for r in replays)} differing; {len(groups)} groups, last version {last}"
    )
    # most kills landed between snapshots, so their restart re-trained versions; each one hashed as published
    assert sum(1 for r in replays if r["replayed"]) >= KILLS // 2, (killed_at, replays)
    assert [v for r in replays for v in r["differing"]] == []
    assert sum(r["missing_episodes"] for r in replays) == 0
    assert [v.version for v in pversions.read_all(client, keys)] == list(range(1, last + 1))
    report = check(read_run(client, keys, cfg.run_path))
    assert report.groups_lost == 0 and report.samples_trained_twice == 0 and report.groups_trained == len(groups)
    assert report.versions_rederived_differently == 0 and report.versions_replayed > 0
    assert report.ok, report.details

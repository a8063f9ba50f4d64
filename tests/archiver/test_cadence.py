"""The archiver steps every ``archive_every_versions`` published versions, woken by the versions stream, and at the
latest ``archive_every_s`` after its last step: what Redis holds is bounded in versions, not in seconds."""

from __future__ import annotations

from pathlib import Path

from services.archiver import cadence
from shared.protocol.archive import segments
from shared.protocol.archive.ledger import append_ledger
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams import samples, versions
from tests.archiver.tiers_support import make_run, write_episode
from tests.support.procs import spawn, stop, wait_until


def test_a_step_is_due_after_every_versions_or_at_the_latest_every_s():
    assert not cadence.due(newest=59, stepped_at_version=10, waited_s=1.0, every_versions=50, every_s=30)
    assert cadence.due(newest=60, stepped_at_version=10, waited_s=1.0, every_versions=50, every_s=30)
    # slow run
    assert cadence.due(newest=11, stepped_at_version=10, waited_s=30.0, every_versions=50, every_s=30)
    # time only
    assert not cadence.due(newest=500, stepped_at_version=10, waited_s=1.0, every_versions=0, every_s=30)


def test_a_blocking_read_waits_until_the_time_is_up_within_its_bounds():
    # the stop flag is looked at
    assert cadence.block_ms(waited_s=0.0, every_s=30) == cadence.MAX_BLOCK_MS
    assert cadence.block_ms(waited_s=29.5, every_s=30) == 500
    # never a short poll
    assert cadence.block_ms(waited_s=29.99, every_s=30) == cadence.MIN_BLOCK_MS


def test_the_rest_after_a_step_is_most_of_the_time_its_versions_took_last_time():
    # 10 versions/s
    assert cadence.rest_s(versions=50, seconds=5.0, every_versions=50, every_s=30) == 4.0
    # faster: shorter
    assert cadence.rest_s(versions=100, seconds=5.0, every_versions=50, every_s=30) == 2.0
    # slow run: every_s
    assert cadence.rest_s(versions=1, seconds=30.0, every_versions=50, every_s=30) == 30
    # no rate: no rest
    assert cadence.rest_s(versions=0, seconds=30.0, every_versions=50, every_s=30) == 0
    # time only: no rest
    assert cadence.rest_s(versions=50, seconds=5.0, every_versions=0, every_s=30) == 0


def _commit(client, keys, run_path: Path, log: EpisodeLog, v: int) -> None:
    """Group g<v> written, published, committed in the ledger at version v, and version v published."""
    eids = [f"g{v}-0", f"g{v}-1"]
    for eid in eids:
        write_episode(log, eid, f"g{v}", v)
    client.xadd(keys.samples, samples.encode(samples.Sample(f"g{v}", eids, "w1")))
    append_ledger(run_path / "trainer", {"commit": v, "version": v, "step": v, "groups": [f"g{v}"], "skipped": []})
    versions.publish(client, keys, versions.Version(v, f"/weights/v{v}.safetensors"))


def test_the_archiver_steps_when_enough_versions_are_published_not_after_its_longest_wait(
    client, keys, cli_env, tmp_path
):
    run_path = tmp_path / "runs" / keys.run
    make_run(client, keys, run_path, versions=6)
    versions.publish(client, keys, versions.Version(6, "/weights/v6.safetensors"))
    env = {
        **cli_env,
        "STREAMRL_LOG_RETENTION_VERSIONS": "2",
        "STREAMRL_ARCHIVE_EVERY_VERSIONS": "3",
        # by time, it would not step again during the test
        "STREAMRL_ARCHIVE_EVERY_S": "600",
    }
    store = segments.SegmentStore(run_path / "episodes")
    archiver = spawn("services.archiver", env=env)
    try:
        wait_until(lambda: store.sizes()["episodes"] == 8, "the first step: groups 1..4 moved", procs=[archiver])
        log = EpisodeLog(client, keys, "w1")
        # the third version published since the first step wakes the archiver
        for v in (7, 8, 9):
            _commit(client, keys, run_path, log, v)
        wait_until(
            lambda: store.sizes()["episodes"] == 14,
            "groups 5..7 moved after 3 more versions",
            timeout=60,
            procs=[archiver],
        )
        # one step for the three versions, not one per version
        assert store.sizes()["segments"] == 2
    finally:
        assert stop(archiver) == [0]

"""A live run's Redis holds a bounded number of keys besides its episode streams, however many versions it runs
nothing is left per group or per command that outlives a retry (gate outcomes and control markers
expire within minutes; heartbeats within seconds). Counted at two points of one run: the lasting keys (no TTL,
or one longer than 10 minutes) are the same few at version 16 as at version 4. The prompts and samples streams'
heads move to files (``stream_keep_s`` 0 here), and the checker, reading both, counts every group once."""

from __future__ import annotations

from collections import Counter

import pytest

from services.driver.driver import queue_depth
from services.ops.check.checker import check
from services.ops.check.data import read_run
from shared.protocol.streams import stream_head
from tests.support.fault_run import LiveRun

pytestmark = pytest.mark.slow(seconds=60)

# a key that expires within this is bounded by time (rate x TTL), not by the run's length
SHORT_TTL_S = 600


def lasting_keys(client, keys) -> Counter:
    """{family: keys} of the run's coordination keys that do not expire within SHORT_TTL_S (episode streams
    have another prefix and are not counted: the archiver's)."""
    out: Counter = Counter()
    for key in client.scan_iter(match=f"{keys.base}*", count=1000):
        ttl = client.ttl(key)
        if ttl == -1 or ttl > SHORT_TTL_S:
            rest = key.decode().removeprefix(keys.base)
            out[rest.split(":")[0] + (":*" if ":" in rest else "")] += 1
    return out


def test_the_keys_besides_episode_streams_stay_bounded_while_versions_grow(tmp_path, tiny_model_dir):
    run = LiveRun(
        tmp_path,
        run="flat",
        model_dir=tiny_model_dir,
        max_tokens=8,
        group_size=2,
        batch_groups=2,
        val_every=0,
        max_versions=200,
        max_minutes=4.0,
        step_delay_ms=0.0,
        heartbeat_ttl=2.0,
        stream_keep_s=0.0,
        log_level="warning",
    ).start(rollout_workers=1)
    try:
        run.wait_version(4, timeout=180)
        early = lasting_keys(run.client, run.keys)
        # 24 more groups trained (batch_groups 2 a version), more enqueued
        run.wait_version(16, timeout=180)
        late = lasting_keys(run.client, run.keys)
        run.stop()
        heads = {
            name: stream_head.read_head(stream_head.path_of(run.cfg.run_path, name)) for name in ("prompts", "samples")
        }
        report = check(read_run(run.client, run.keys, run.cfg.run_path))
        enqueued = int(run.client.get(run.keys.driver_enqueued))
    finally:
        run.stop()
        run.close()
    assert len(heads["prompts"]) >= 8 and len(heads["samples"]) >= 8, {k: len(v) for k, v in heads.items()}
    # the driver enqueues a top-up, then records its counter: a stop between the two leaves the counter behind by
    # that top-up (at most the queue's depth), whose groups keep their enqueue markers, so a restarted driver
    # enqueues none of them twice
    depth = queue_depth(run.cfg, 1)
    assert enqueued <= report.groups_enqueued <= enqueued + depth and report.groups_published >= 16 * 2, report
    assert (
        report.groups_enqueued_twice,
        report.episodes_finished_twice,
        report.samples_trained_twice,
        report.groups_lost,
    ) == (0, 0, 0, 0), report
    grown = {f: late[f] - early[f] for f in late if late[f] > early[f]}
    assert sum(late.values()) <= sum(early.values()) + 3, f"grew: {grown}; at version 16: {dict(late)}"
    assert not {"sampled:*", "enqueued:*", "control:*"} & set(late), dict(late)

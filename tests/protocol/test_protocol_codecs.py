"""Codecs of the versions and samples streams and the staleness gate's Redis side, on a real server."""

from __future__ import annotations

import pytest

from shared.protocol import gate
from shared.protocol.episode.errors import EventError
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams import samples, versions


def test_version_round_trip_and_errors(client, keys):

    assert versions.latest(client, keys) is None and versions.latest_number(client, keys) == 0
    for n in (1, 2):
        versions.publish(client, keys, versions.Version(n, f"/w/v{n}", "ab" * 32, 10 * n))
    got = versions.latest(client, keys)
    assert (got.version, got.path, got.sha256, got.step) == (2, "/w/v2", "ab" * 32, 20) and got.entry_id
    assert [v.version for v in versions.read_all(client, keys)] == [1, 2]
    assert [v.version for v in versions.read_after(client, keys, versions.read_all(client, keys)[0].entry_id)] == [2]
    with pytest.raises(EventError, match="version"):
        versions.decode("1-0", {b"version": b"x", b"path": b"/p"})
    with pytest.raises(EventError, match="path"):
        versions.decode("1-0", {b"version": b"3"})


def test_sample_round_trip_and_idempotent_publish(client, keys):

    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0", mkstream=True)
    entry = client.xadd(keys.prompts, {"group_id": "g1"}).decode()
    client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"})
    pub = samples.Publisher(client, keys)
    s = samples.Sample("g1", ["g1-0", "g1-1"], "w1", 2)
    pub.publish(s, keys.samples, keys.prompts, entry)
    # a second publish of the same group is a no-op
    pub.publish(s, keys.samples, keys.prompts, entry)
    good, bad = samples.decode_all(client.xrange(keys.samples))
    assert [(g.group_id, g.episodes, g.worker, g.n) for g in good] == [("g1", ["g1-0", "g1-1"], "w1", 2)] and not bad
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    _, bad = samples.decode_all([(b"5-0", {b"group_id": b"g2"})])
    assert bad and "episodes" in bad[0][1]


def test_gate_reserve_never_passes_the_limit_and_refunds(client, keys):

    async_gate, sync_gate = gate.Gate(client, keys, sync_mode=False), gate.Gate(client, keys, sync_mode=True)
    # no gate yet: async starts freely
    assert async_gate.reserve(3) == gate.Grant(3, False, None)
    # ... sync starts nothing
    assert sync_gate.reserve(3) == gate.Grant(0, False, None)
    gate.open(client, keys, version=4, limit=5, max_staleness=1)
    assert async_gate.reserve(3) == gate.Grant(3, True, 4)
    # 5 in total
    assert async_gate.reserve(3) == gate.Grant(2, True, 4)
    assert async_gate.reserve(1).granted == 0 and gate.started(client, keys) == 5
    # two reserved slots not used
    async_gate.refund(2)
    # a group the trainer will never train
    gate.refund(client, keys)
    assert gate.started(client, keys) == 2 and async_gate.reserve(10).granted == 3
    assert gate.peek(client, keys) == (4, 5) and gate.opened_version(client, keys) == 4

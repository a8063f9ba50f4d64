"""Markers that guard a retry or a race go as soon as no retry can come (one per group or command, they
grew with the run): a publish is guarded by its prompt entry's XACK (no marker at all), control markers are one hash
per sync round that lives ``once.RETRY_MARKER_TTL_S``, which config_checks keeps above any retry. On a real server."""

from __future__ import annotations

import pytest

from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams import control, once, samples
from shared.runtime.config.checks import validate
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config


def _delivered(client, keys, group_id: str, consumer: str = "w1") -> str:
    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="$", mkstream=True)
    entry = client.xadd(keys.prompts, {"group_id": group_id}).decode()
    client.xreadgroup(ROLLOUT_GROUP, consumer, {keys.prompts: ">"})
    return entry


def test_a_publish_leaves_no_marker_and_is_written_once(client, keys):
    entry = _delivered(client, keys, "g1")
    pub, s = samples.Publisher(client, keys), samples.Sample("g1", ["g1-0", "g1-1"], "w1", 2)
    assert pub.publish(s, keys.samples, keys.prompts, entry) is True
    # the retry of a lost reply: a no-op
    assert pub.publish(s, keys.samples, keys.prompts, entry) is False
    assert client.xlen(keys.samples) == 1 and client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    # nothing left per group
    assert list(client.scan_iter(match=keys.sampled("*"))) == []


def test_a_zombie_publishing_a_group_taken_over_and_published_writes_nothing(client, keys):
    """w1 stalls with the group; w2 takes it over (XCLAIM) and publishes it; w1 wakes, days later for all it knows,
    and publishes the same group: no second samples entry, with no marker to remember the first."""
    entry = _delivered(client, keys, "g1", consumer="w1")
    client.xclaim(keys.prompts, ROLLOUT_GROUP, "w2", 0, [entry])
    w1, w2 = samples.Publisher(client, keys), samples.Publisher(client, keys)
    assert w2.publish(samples.Sample("g1", ["g1-0"], "w2", 1), keys.samples, keys.prompts, entry) is True
    assert w1.publish(samples.Sample("g1", ["g1-0"], "w1", 1), keys.samples, keys.prompts, entry) is False
    # the pipelined publish (a worker's writer thread) likewise
    pipe = client.pipeline(transaction=False)
    w1.add(pipe, samples.Sample("g1", ["g1-0"], "w1", 1), keys.samples, keys.prompts, entry)
    assert pipe.execute() == [0]
    assert [(s.group_id, s.worker) for s in samples.read_all(client, keys.samples)[0]] == [("g1", "w2")]


def test_control_markers_outlive_a_retry_only(client, keys):
    pause = control.Command("pause", "v1-abc")
    control.send_command(client, keys, pause)
    control.send_ack(client, keys, pause, "w1", True, 0)
    assert 0 < client.ttl(keys.control_sent("v1-abc")) <= once.RETRY_MARKER_TTL_S
    assert once.RETRY_MARKER_TTL_S < once.MARKER_TTL_S


def test_a_sync_round_s_commands_and_acks_are_marked_in_one_hash_and_each_written_once(client, keys):
    """a key per command and ack (control:sent:<sync>:<cmd>:<worker>, ~100 B each) piled up at the rate
    of syncs x workers; a round is one hash now (a listpack: a few bytes a field), and each write still happens once."""
    workers = [f"w{i}" for i in range(4)]
    for sync in ("v1-abc", "v2-def"):
        for cmd in control.COMMANDS:
            c = control.Command(cmd, sync, 1, "/w.safetensors" if cmd in control.WITH_WEIGHTS else "")
            assert control.send_command(client, keys, c) is not None
            # a retry: a no-op
            assert control.send_command(client, keys, c) is None
            for w in workers:
                assert control.send_ack(client, keys, c, w, True, 1) is not None
                assert control.send_ack(client, keys, c, w, True, 1) is None
    assert client.xlen(keys.control) == 2 * len(control.COMMANDS) * (1 + len(workers))
    markers = sorted(k.decode() for k in client.scan_iter(match=keys.control_sent("*")))
    # 40 keys in the old layout
    assert markers == [keys.control_sent("v1-abc"), keys.control_sent("v2-def")]
    assert client.hlen(keys.control_sent("v1-abc")) == len(control.COMMANDS) * (1 + len(workers))
    assert client.object("encoding", keys.control_sent("v1-abc")) == b"listpack"


def test_redis_wait_longer_than_half_the_retry_markers_life_is_refused():
    validate(Config(redis_wait=once.RETRY_MARKER_TTL_S / 2))
    with pytest.raises(ConfigError, match=r"config key 'redis_wait': expected at most 60 seconds .* got 61"):
        validate(Config(redis_wait=61))

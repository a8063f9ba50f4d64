"""The heartbeat policy (shared/runtime/heartbeat.py) and the registry the syncer lists workers from."""

from __future__ import annotations

from shared.runtime.heartbeat import Heartbeat, alive_of


def test_the_rollout_registry_lists_live_workers_and_forgets_dead_ones(client, keys):
    """The syncer's list of workers comes from the registry set, not a SCAN: a worker that stopped warm leaves
    it at once; one whose key expired (kill -9) is dropped the next time the list is read."""
    a, b, c = (Heartbeat(client, keys, "rollout", w, ttl=30) for w in ("A", "B", "C"))
    for hb, version in ((a, 1), (b, 2), (c, 3)):
        hb.beat(version=version)
    assert {w: f["version"] for w, f in alive_of(client, keys, "rollout").items()} == {"A": "1", "B": "2", "C": "3"}
    # warm stop
    b.stop()
    # what the TTL does after a kill -9
    client.delete(keys.alive("rollout", "C"))
    assert set(alive_of(client, keys, "rollout")) == {"A"}
    # C's stale member removed
    assert client.smembers(keys.alive_registry("rollout")) == {b"A"}
    assert alive_of(client, keys, "trainer") == {}

"""sync_mode pull, its parts one at a time with real parts: the load policy (pure), the relay tree rule the syncer
and the workers share, the load lease on a real Redis (its record on the pulls stream, expiry of a dead holder's
lease), and a relay that waits for a copy it is still fetching (real weight servers over loopback HTTP, real
``LocalWeights`` fetches checked by sha256)."""

from __future__ import annotations

import threading

import httpx
import pytest

from services.rollout.weights.load_policy import State, decide
from services.rollout.weights.local import LocalWeights
from shared.protocol.streams import pulls
from shared.protocol.weights import relay_tree
from shared.runtime import logs
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.config.sources import load
from shared.runtime.weights.server import WeightServer
from tests.support.models import nudged_weights
from tests.support.procs import wait_until

TOKEN = "pull-s3cret"


@pytest.mark.parametrize(
    "state, reason",
    [
        (State(gated=True, busy_slots=4, slots=4, waited_s=0), "gated"),
        (State(gated=False, busy_slots=0, slots=4, waited_s=0), "idle"),
        (State(gated=False, busy_slots=1, slots=4, waited_s=0), "quiet"),
        # half busy: not below 0.5
        (State(gated=False, busy_slots=2, slots=4, waited_s=0), None),
        (State(gated=False, busy_slots=4, slots=4, waited_s=9.9), None),
        (State(gated=False, busy_slots=4, slots=4, waited_s=10.0), "overdue"),
        (State(gated=False, busy_slots=4, slots=4, waited_s=0, behind=True), "behind"),
    ],
)
def test_the_load_policy_loads_at_a_cheap_point_or_when_overdue(state, reason):
    assert decide(state, below=0.5, max_wait_s=10.0) == reason


def test_below_zero_never_loads_a_busy_worker_early():
    assert decide(State(gated=False, busy_slots=0.5, slots=4, waited_s=0), below=0.0, max_wait_s=5) is None


def test_the_relay_tree_hangs_each_worker_under_a_relaying_one_with_a_smaller_place():
    chain = relay_tree.parents(["C", "A", "B"], ["A", "B", "C"], 1)
    assert chain == {"A": None, "B": "A", "C": "B"} and relay_tree.depths(chain) == {"A": 1, "B": 2, "C": 3}
    wide = relay_tree.parents([f"w{i}" for i in range(7)], [f"w{i}" for i in range(7)], 2)
    assert [wide[f"w{i}"] for i in range(7)] == [None, None, "w0", "w0", "w1", "w1", "w2"]
    # workers that do not relay come last and never serve; under a non-relaying node one fetches from the trainer
    mixed = relay_tree.parents(["A", "x", "y", "z"], ["A"], 1)
    assert mixed == {"A": None, "x": "A", "y": None, "z": None}
    with pytest.raises(ValueError, match="fanout must be >= 1"):
        relay_tree.parents(["A"], ["A"], 0)


def test_workers_sharing_a_download_folder_are_one_node_and_never_fetch_from_each_other():
    """Workers on one host downloading into one folder share each download under the folder's lock: a worker holding
    it while it asks a sibling would wait for a copy that waits for the lock (stalls of the relay's whole wait)."""
    one_host = relay_tree.parents(list("ABCDEFGH"), list("ABCDEFGH"), 2, {w: "h1:/dev/shm/x" for w in "ABCDEFGH"})
    # one node under the trainer: one download, taken by the first to lock
    assert set(one_host.values()) == {None}
    # F: no folder given, a node of its own
    hosts = {"A": "h1", "B": "h1", "C": "h2", "D": "h2", "E": "h3", "F": ""}
    tree = relay_tree.parents(list("ABCDEF"), list("BCDEF"), 1, hosts)
    # h1 serves through B, h2 through C
    assert tree == {"A": None, "B": None, "C": "B", "D": "B", "E": "C", "F": "E"}
    assert all(hosts[w] != hosts[p] for w, p in tree.items() if p is not None and hosts[w])


def test_the_load_lease_grants_max_loading_records_each_holder_and_expires_a_dead_ones(client, keys):
    first = pulls.acquire(client, keys, "A", 1, max_loading=2, lease_s=60, reason="idle")
    assert first.granted and first.holders == 1
    # asked again: renewed
    assert pulls.acquire(client, keys, "A", 1, max_loading=2, lease_s=60).granted
    assert pulls.acquire(client, keys, "B", 1, max_loading=2, lease_s=60).holders == 2
    refused = pulls.acquire(client, keys, "C", 1, max_loading=2, lease_s=60)
    assert not refused.granted and refused.holders == 2 and 0 < refused.retry_s <= 60
    assert pulls.release(client, keys, "A", 1, paused_s="0.1") and not pulls.release(client, keys, "A", 1)
    assert pulls.acquire(client, keys, "C", 1, max_loading=2, lease_s=60).granted
    assert pulls.holders(client, keys) == ["B", "C"]
    # B dies holding its lease: a short one runs out, and the next acquire drops it
    pulls.release(client, keys, "C", 1)
    pulls.acquire(client, keys, "B", 2, max_loading=1, lease_s=60)
    # its expiry time has passed (what a dead worker's lease comes to)
    client.zadd(keys.load_lease, {"B": 0})
    assert pulls.acquire(client, keys, "D", 2, max_loading=1, lease_s=60).granted
    records = pulls.read_all(client, keys)
    assert [(p.event, p.worker) for p in records] == [
        ("acquired", "A"),
        ("acquired", "B"),
        ("released", "A"),
        ("acquired", "C"),
        ("released", "C"),
        ("expired", "B"),
        ("acquired", "D"),
    ]
    assert records[0].extra == {"reason": "idle"} and records[2].extra == {"paused_s": "0.1"}
    assert pulls.most_holders(records) == 2


def _weights(keys, folder) -> LocalWeights:
    cfg = Config(run=keys.run, rollout_weights_dir=str(folder), weights_fetch="always", weights_token=TOKEN)
    return LocalWeights(cfg, logs.get("pull-test"))


def _fetch_in_thread(weights: LocalWeights, version, path, digest, url, relay=""):
    done, out = threading.Event(), []
    weights.prefetch(
        version, str(path), digest, url, lambda ok, error: (out.append((ok, error)), done.set()), relay=relay
    )
    return done, out


def test_a_relay_asked_for_a_version_it_has_not_fetched_yet_waits_for_its_verified_copy(keys, tmp_path, tiny_model_dir):
    """B asks A's relay for version 1 before A has even started fetching it (A has just been told of it): the
    relay holds the request (on a condition, no polling) until A's copy is verified, and B's copy comes from A, so
    the trainer sends one. A version older than A's newest that A does not hold is a 404 at once."""
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    trainer = WeightServer(trainer_dir, token=TOKEN).start()
    path, digest = nudged_weights(tiny_model_dir, trainer_dir, 1)
    a, b = _weights(keys, tmp_path / "a"), _weights(keys, tmp_path / "b")
    relay = WeightServer(tmp_path / "unused", token=TOKEN, resolve=lambda name: a.served(name, 30.0)).start()
    try:
        done_b, out_b = _fetch_in_thread(b, 1, path, digest, trainer.url_of(1), relay=relay.url_of(1))
        wait_until(lambda: a.stats["relay_waits"] == 1, "B's request waiting at A's relay", 30)
        assert not done_b.is_set() and trainer.sent_bytes == 0
        done_a, out_a = _fetch_in_thread(a, 1, path, digest, trainer.url_of(1))
        assert done_a.wait(60) and out_a == [(True, "")]
        assert done_b.wait(60) and out_b == [(True, "")]
        assert b.stats["relay_fetches"] == 1 and b.stats["trainer_fetches"] == 0 and b.sources[1] == "relay"
        assert trainer.sent_bytes == path.stat().st_size == relay.sent_bytes
        # A moves on to version 3: version 2, which it never fetched, is not coming; asked for, a 404 at once
        a.loaded(3)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.head(relay.url_of(2), headers=auth).status_code == 404
        assert a.stats["relay_waits"] == 1
    finally:
        relay.stop()
        trainer.stop()


def test_a_relay_that_never_gets_the_version_answers_404_after_its_bound_and_the_child_takes_the_trainers(
    keys, tmp_path, tiny_model_dir
):
    trainer_dir = tmp_path / "trainer"
    trainer_dir.mkdir()
    trainer = WeightServer(trainer_dir, token=TOKEN).start()
    path, digest = nudged_weights(tiny_model_dir, trainer_dir, 1)
    a, b = _weights(keys, tmp_path / "a"), _weights(keys, tmp_path / "b")
    relay = WeightServer(tmp_path / "unused", token=TOKEN, resolve=lambda name: a.served(name, 0.3)).start()
    try:
        done_b, out_b = _fetch_in_thread(b, 1, path, digest, trainer.url_of(1), relay=relay.url_of(1))
        assert done_b.wait(60) and out_b == [(True, "")]
        assert a.stats["relay_waits"] == 1 and b.stats["relay_failures"] == 1 and b.stats["trainer_fetches"] == 1
        assert b.sources[1] == "trainer"
    finally:
        relay.stop()
        trainer.stop()


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"sync_mode": "push"}, "config key 'sync_mode': expected 'global', 'rolling' or 'pull', got 'push'"),
        ({"pull_load_below": "1.5"}, "config key 'pull_load_below': expected a fraction 0-1"),
        ({"pull_max_wait_s": "0"}, "config key 'pull_max_wait_s': expected seconds > 0, got 0.0"),
        ({"load_lease_s": "-1"}, "config key 'load_lease_s': expected seconds > 0, got -1.0"),
    ],
)
def test_bad_pull_keys_name_the_key(flags, words):
    with pytest.raises(ConfigError) as err:
        load(env={}, overrides=flags)
    assert words in str(err.value)
    assert load(env={}, overrides={"sync_mode": "pull"}).sync_mode == "pull"

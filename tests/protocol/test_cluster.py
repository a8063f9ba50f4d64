"""Redis Cluster: the core protocol tests again on a real 3-master cluster, and what is cluster-only.

The tests named in ``CORE`` run on the session's single server in their own modules; here each runs once more
with a client of the session's cluster (tests/support/redis_cluster.py) and the cluster's URL. The rest checks the
layout (a run's coordination keys in one slot, its episode streams over every shard), the connection (a
``redis+cluster://`` URL with a password), the SCANs that must cover every primary, and the config rule that rq
gets a single server of its own.
"""

from __future__ import annotations

import inspect

import pytest
import redis

from services.gateway.asks import Ask, Asks
from services.ops.check.data import read_run
from services.ops.inspect.views import run_streams
from shared.protocol import gate
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import PREFIX, ROLLOUT_GROUP, Keys
from shared.protocol.streams import calls, control, dead_letters, prompts, samples, versions
from shared.runtime.config import keys as configmod
from shared.runtime.config import sources as config_sources
from shared.runtime.config.errors import ConfigError
from shared.runtime.connection import connect, is_cluster, is_cluster_client, redact
from shared.runtime.heartbeat import Heartbeat, alive, alive_of
from tests.ops import test_checker
from tests.protocol import test_episode_log, test_gate, test_idempotent_writes, test_protocol_codecs
from tests.runtime import test_heartbeat, test_runstate

CORE_MODULES = (
    test_episode_log,
    test_protocol_codecs,
    test_idempotent_writes,
    test_gate,
    test_heartbeat,
    test_runstate,
    test_checker,
)
# what a core test may ask for to be run here
FIXTURES = {"client", "keys", "redis_url", "tmp_path"}


def _core_tests():
    for module in CORE_MODULES:
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not callable(fn) or getattr(fn, "pytestmark", None):
                continue
            params = set(inspect.signature(fn).parameters)
            if params <= FIXTURES and params & {"client", "redis_url"}:
                yield pytest.param(fn, id=f"{module.__name__.rsplit('.', 1)[-1]}::{name}")


CORE = list(_core_tests())


@pytest.mark.parametrize("test", CORE)
def test_core_protocol_on_a_cluster(test, cluster_client, redis_cluster, redis_url, keys, tmp_path, monkeypatch):
    # processes a test starts: rq on the single server
    monkeypatch.setenv("STREAMRL_RQ_REDIS_URL", redis_url)
    given = {"client": cluster_client, "keys": keys, "redis_url": redis_cluster.url, "tmp_path": tmp_path}
    test(**{name: given[name] for name in inspect.signature(test).parameters})


def test_the_core_list_holds_every_protocol_write():
    """The parametrised list is built by introspection: it must not silently shrink."""
    names = " ".join(p.id for p in CORE)
    for part in (
        "second_writer_is_fenced",
        "replay_equals_what_was_written",
        "server_forgets_its_scripts",
        "prompt_group_enqueued_twice",
        "version_published_twice",
        "control_command_and_ack_written_once",
        "one_dead_letter_per_stream_entry",
        "metrics_record_written_twice",
        "gate_refund_of_a_group",
        "sample_round_trip_and_idempotent_publish",
        "reserve_grants_up_to_the_limit",
        "registry_lists_live_workers",
        "first_process_names_the_run",
    ):
        assert part in names, part
    assert len(CORE) >= 25


def test_a_cluster_url_gives_a_cluster_client_with_the_password(redis_cluster, cluster_client):
    assert is_cluster(redis_cluster.url) and not is_cluster("redis://127.0.0.1:6379/0")
    assert is_cluster_client(cluster_client) and len(cluster_client.get_primaries()) == 3
    assert redact(redis_cluster.url) == redis_cluster.url.replace(":cluster-secret@", ":***@")
    with pytest.raises(redis.exceptions.AuthenticationError):
        connect(redis_cluster.url.replace("cluster-secret", "wrong"), wait=2)
    nobody = redis_cluster.url.replace(f":{redis_cluster.nodes[0].port}", ":1")
    with pytest.raises(redis.exceptions.ConnectionError, match=r"no Redis answering at .*:\*\*\*@127.0.0.1:1 after"):
        connect(nobody, wait=1)


def test_a_runs_coordination_keys_share_one_slot_and_its_episodes_spread_over_every_shard(cluster_client, keys):
    coordination = [
        keys.prompts,
        keys.samples,
        keys.val_prompts,
        keys.val_samples,
        keys.versions,
        keys.control,
        keys.metrics,
        keys.gate,
        keys.gate_started,
        keys.gate_request("t"),
        keys.dead_letters,
        keys.dead_lettered(keys.prompts, "1-0"),
        keys.enqueued("g"),
        keys.sampled("g"),
        keys.control_sent("s"),
        keys.alive("rollout", "w"),
        keys.alive_registry("rollout"),
        keys.calls,
        keys.call_index("e1"),
        keys.agents_running,
        keys.agents_done("g"),
        keys.meta,
        keys.driver_enqueued,
        keys.val_requested,
        keys.agent_groups,
    ]
    assert len({cluster_client.keyslot(k) for k in coordination}) == 1
    log = EpisodeLog(cluster_client, keys, "w1")
    ids = [f"g{i:02d}-{j}" for i in range(20) for j in range(2)]
    for eid in ids:
        log.open(eid)
        log.append(
            eid,
            "started",
            {"episode_id": eid, "group_id": eid[:3], "index": 0, "prompt_ids": [1], "sampling": {}, "task": {}},
            0,
        )
        log.append_tokens(eid, [1, 2, 3], [-0.1] * 3, 0)
    # one pipeline over every shard
    assert log.flush() == {}
    shards = {cluster_client.get_node_from_key(keys.episode(eid)).name for eid in ids}
    assert len(shards) == 3
    assert [ep.tokens for ep in map(log.replay, ids)] == [[1, 2, 3]] * len(ids)
    assert cluster_client.keyslot(keys.episode("a")) != cluster_client.keyslot(keys.prompts) or cluster_client.keyslot(
        keys.episode("b")
    ) != cluster_client.keyslot(keys.prompts)
    # the scans of `streamrl inspect` and `streamrl check` walk every primary
    streams = run_streams(cluster_client, keys)
    assert sum(keys.is_episode(s["key"]) for s in streams) == len(ids)
    data = read_run(cluster_client, keys, "/nonexistent")
    assert sorted(data.episodes) == sorted(ids)
    assert all(keys.episode_id(keys.episode(e)) == e for e in ids)


def test_every_script_runs_on_a_cluster_once_per_write(cluster_client, keys):
    """Each script in shared/protocol on the cluster, twice: the second call writes nothing."""
    c = cluster_client
    assert prompts.enqueue(c, keys, [prompts.PromptGroup("g1", 2, prompt="1+1=")])[0]
    assert prompts.enqueue(c, keys, [prompts.PromptGroup("g1", 2, prompt="1+1=")]) == [None]
    c.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
    ((_, [(entry, _)]),) = c.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"})
    pub = samples.Publisher(c, keys)
    for _ in range(2):
        pub.publish(samples.Sample("g1", ["g1-0", "g1-1"], "w1", 2), keys.samples, keys.prompts, entry.decode())
    assert [s.group_id for s in samples.read_all(c, keys.samples)[0]] == ["g1"]
    cmd = control.Command("pause", "s1")
    assert control.send_command(c, keys, cmd) and control.send_command(c, keys, cmd) is None
    assert control.send_ack(c, keys, cmd, "w1", True, 0) and control.send_ack(c, keys, cmd, "w1", True, 0) is None
    assert dead_letters.send(c, keys, keys.prompts, "1-0", "bad", "t") is True
    assert dead_letters.send(c, keys, keys.prompts, "1-0", "bad", "t") is False
    first = versions.publish(c, keys, versions.Version(1, "/w/v1"))
    assert versions.publish(c, keys, versions.Version(1, "/w/v1")) == first
    gate.open(c, keys, 1, 3, 1)
    g = gate.Gate(c, keys, sync_mode=True)
    assert g.reserve(5).granted == 3 and g.reserve(1).granted == 0
    assert gate.refund_group(c, keys, "g1") and not gate.refund_group(c, keys, "g1")
    req = calls.Requester(c, keys)
    r = calls.CallRequest("e1", "digest-1", -1, [1, 2], {"max_tokens": 4})
    assert req.request(r) == (0, True) and req.request(r) == (0, False) and c.xlen(keys.calls) == 1
    # the gateway's ask rides in one pipeline with the read of the episode's stream (another shard)
    asks = Asks(c, keys)
    pipe = c.pipeline(transaction=False)
    pipe.xrange(keys.episode("e1"))
    read = asks.ask_on(pipe, "e1", "d", Ask())
    entries, reply = pipe.execute()
    assert entries == [] and read(reply) == ("d:0", None)
    assert req.request(calls.CallRequest("e1", "d:0", -1, [1, 2], {"max_tokens": 4})) == (1, True)
    assert asks.identity("e1", "d", Ask(retry=True)) == ("d:0", 1)


def test_heartbeats_are_listed_from_every_shard(cluster_client, keys):
    beats = [Heartbeat(cluster_client, keys, "rollout", f"w{i}", ttl=30) for i in range(3)]
    for hb in beats:
        hb.beat(force=True, paused=0)
    assert sorted(alive_of(cluster_client, keys, "rollout")) == ["w0", "w1", "w2"]
    assert sorted(alive(cluster_client, keys)) == ["rollout:w0", "rollout:w1", "rollout:w2"]


def test_rq_gets_a_single_server_of_its_own_when_the_run_is_on_a_cluster(redis_cluster, redis_url):
    with pytest.raises(ConfigError, match="rq_redis_url.*Redis Cluster.*set rq_redis_url"):
        config_sources.load(env={"REDIS_URL": redis_cluster.url})
    with pytest.raises(ConfigError, match="rq_redis_url.*single Redis server"):
        config_sources.load(env={"REDIS_URL": redis_cluster.url, "STREAMRL_RQ_REDIS_URL": redis_cluster.url})
    cfg = config_sources.load(env={"REDIS_URL": redis_cluster.url, "STREAMRL_RQ_REDIS_URL": redis_url})
    assert configmod.rq_url(cfg) == redis_url and "cluster-secret" not in str(
        pytest.raises(ConfigError, config_sources.load, env={"REDIS_URL": redis_cluster.url}).value
    )
    assert configmod.rq_url(config_sources.load(env={"REDIS_URL": redis_url})) == redis_url


def test_keys_stay_readable_and_name_their_hash_tags():
    k = Keys("demo")
    assert k.prompts.split(":") == [PREFIX, "{demo}", "prompts"]
    assert k.episode("q000-000003-0").split(":") == [PREFIX, "demo", "ep", "{q000-000003-0}"]
    assert [p.split(":") for p in k.patterns] == [[PREFIX, "{demo}", "*"], [PREFIX, "demo", "ep", "{*}"]]
    with pytest.raises(ConfigError, match="run.*braces"):
        config_sources.load(env={"STREAMRL_RUN": "a{b}"})

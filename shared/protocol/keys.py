"""Every Redis key streamrl uses, namespaced by run, laid out for Redis Cluster.

Coordination keys (streams, markers, the gate, heartbeats, ...) are ``streamrl:{<run>}:<name>``: the hash tag
``{<run>}`` puts all of a run's coordination keys in one slot, so every script, MULTI and multi-stream read
that touches several of them is cluster-safe. Episode streams are ``streamrl:<run>:ep:{<episode id>}``: each
has a tag of its own, so a cluster spreads them over its shards (no script touches an episode stream together
with another key). On a single server the braces are just characters of the name.
"""

from __future__ import annotations

PREFIX = "streamrl"

# consumer groups and rq queues: the one place their names are written
# rollout workers on the prompts streams (training and validation)
ROLLOUT_GROUP = "rollout"
# the trainer on the samples stream
TRAINER_GROUP = "trainer"
# rq queue of tool calls, per run: Keys.tool_queue
TOOL_QUEUE = "tools"
# rq queue of user agent episodes, per run: Keys.agent_queue
AGENT_QUEUE = "agents"


class Keys:
    def __init__(self, run: str):
        self.run = run
        # coordination keys: the run's one hash tag
        self.base = f"{PREFIX}:{{{run}}}:"
        # episode streams: a hash tag per episode
        self.episode_prefix = f"{PREFIX}:{run}:ep:{{"

    def episode(self, episode_id: str) -> str:
        """The episode's event stream (its own hash tag: episodes spread over a cluster's shards)."""
        return f"{self.episode_prefix}{episode_id}}}"

    def episode_id(self, key: str | bytes) -> str:
        key = key.decode() if isinstance(key, bytes) else key
        return key.removeprefix(self.episode_prefix).removesuffix("}")

    def is_episode(self, key: str | bytes) -> bool:
        return (key.decode() if isinstance(key, bytes) else key).startswith(self.episode_prefix)

    def alive(self, service: str, worker_id: str) -> str:
        """Heartbeat key: exists while the process is alive (TTL)."""
        return f"{self.base}alive:{service}:{worker_id}"

    def sampled(self, group_id: str) -> str:
        """Set once when an agent group's samples entry is written (a second publish is a no-op); a rollout worker's
        publish is guarded by its prompts entry's XACK instead (shared/protocol/streams/samples.py)."""
        return f"{self.base}sampled:{group_id}"

    def enqueued(self, group_id: str) -> str:
        """Set once when a prompt group is enqueued: a second enqueue of the same group id is a no-op."""
        return f"{self.base}enqueued:{group_id}"

    def control_sent(self, sync: str) -> str:
        """Hash of a sync round's control writes: a field ``<cmd>:<worker>`` set once when a command (worker empty)
        or a worker's ack is written (shared/protocol/streams/control.py)."""
        return f"{self.base}control:sent:{sync}"

    def dead_lettered(self, stream: str, entry_id: str) -> str:
        """Set once when a dead letter names (stream, entry): one dead letter per bad entry."""
        return f"{self.base}dead:seen:{stream}:{entry_id}"

    def gate_request(self, token: str) -> str:
        """The outcome of one gate reservation or refund, kept a while so a retried call returns it again."""
        return f"{self.base}gate:req:{token}"

    def alive_name(self, key: str | bytes) -> str:
        """``<service>:<worker id>`` of a heartbeat key (the inverse of ``alive``)."""
        key = key.decode() if isinstance(key, bytes) else key
        return key.removeprefix(f"{self.base}alive:")

    def alive_registry(self, service: str) -> str:
        """Set of the worker ids of ``service`` that have beaten at least once (their keys say who is alive)."""
        return f"{self.base}alive-registry:{service}"

    def alive_pattern(self, service: str = "*") -> str:
        return f"{self.base}alive:{service}:*"

    # groups the driver has enqueued so far
    driver_enqueued = property(lambda self: f"{self.base}driver:enqueued")
    # the newest validation round asked for
    val_requested = property(lambda self: f"{self.base}validation:requested")

    def call_index(self, episode_id: str) -> str:
        """Hash of an agent episode's calls: request digest -> call index, '#n' -> calls so far (the gateway's
        idempotency record: a request with a digest already there is answered from that call)."""
        return f"{self.base}calls:{episode_id}"

    def agents_done(self, group_id: str) -> str:
        """Set of a group's agent episodes that have ended (the last one in publishes the group)."""
        return f"{self.base}agents:done:{group_id}"

    # LLM call requests from the gateway (rollout group)
    calls = property(lambda self: f"{self.base}calls")
    # episode -> JSON {worker, job args}
    agents_running = property(lambda self: f"{self.base}agents:running")
    # agent episodes ended so far, by how: finished, failed (the progress line's count)
    agents_ended = property(lambda self: f"{self.base}agents:ended")

    @property
    def agent_queue(self) -> str:
        return f"{AGENT_QUEUE}-{self.run}"

    @property
    def tool_queue(self) -> str:
        return f"{TOOL_QUEUE}-{self.run}"

    @property
    def patterns(self) -> tuple[str, str]:
        """SCAN patterns that together match every key of the run: coordination keys, episode streams."""
        return f"{self.base}*", self.episode("*")

    prompts = property(lambda self: f"{self.base}prompts")
    samples = property(lambda self: f"{self.base}samples")
    # agent runs: groups handed to agent jobs
    agent_groups = property(lambda self: f"{self.base}prompts:agents")
    # held-out prompt groups, served first, never trained
    val_prompts = property(lambda self: f"{self.base}prompts:val")
    # their finished groups (read by the driver)
    val_samples = property(lambda self: f"{self.base}samples:val")
    versions = property(lambda self: f"{self.base}versions")
    control = property(lambda self: f"{self.base}control")
    metrics = property(lambda self: f"{self.base}metrics")
    gate = property(lambda self: f"{self.base}gate")
    gate_started = property(lambda self: f"{self.base}gate:started")
    dead_letters = property(lambda self: f"{self.base}dead")
    # long-tail repacks: groups handed from a worker to another
    repacks = property(lambda self: f"{self.base}repacks")
    # sync_mode pull: each worker's fetched / leased / loaded
    pulls = property(lambda self: f"{self.base}pulls")
    # sync_mode pull: workers loading now -> lease expiry
    load_lease = property(lambda self: f"{self.base}load-lease")
    # the run's identity: run, id, created, ended (shared/runtime/runstate.py)
    meta = property(lambda self: f"{self.base}meta")


# Every key the code builds, for `streamrl schema` (shared/protocol/schema.py) and the test that keeps this table
# whole (tests/protocol/test_schema.py: every builder of Keys is here, and every key here is one a builder makes):
# (Keys builder, its example arguments, Redis type, the module that owns what it holds, what it holds).
CATALOG = (
    ("episode", ("<episode id>",), "stream", "shared/protocol/episode/events.py", "an episode's events (own hash tag)"),
    (
        "prompts",
        (),
        "stream",
        "shared/protocol/streams/prompts.py",
        "prompt groups to roll out (consumer group rollout)",
    ),
    ("val_prompts", (), "stream", "shared/protocol/streams/prompts.py", "held-out prompt groups, served first"),
    ("agent_groups", (), "stream", "shared/protocol/streams/prompts.py", "agent runs: groups handed to agent jobs"),
    ("samples", (), "stream", "shared/protocol/streams/samples.py", "finished groups (consumer group trainer)"),
    (
        "val_samples",
        (),
        "stream",
        "shared/protocol/streams/samples.py",
        "finished validation groups (read by the driver)",
    ),
    ("versions", (), "stream", "shared/protocol/streams/versions.py", "published policy versions"),
    ("control", (), "stream", "shared/protocol/streams/control.py", "fetch / pause / load / resume and their acks"),
    ("metrics", (), "stream", "shared/protocol/streams/metrics.py", "every process's metrics records"),
    ("dead_letters", (), "stream", "shared/protocol/streams/dead_letters.py", "entries no reader could use, with why"),
    ("repacks", (), "stream", "shared/protocol/streams/repacks.py", "long-tail repack notices"),
    (
        "pulls",
        (),
        "stream",
        "shared/protocol/streams/pulls.py",
        "sync_mode pull: fetched / acquired / released / expired",
    ),
    (
        "calls",
        (),
        "stream",
        "shared/protocol/streams/calls.py",
        "LLM call requests from the gateway (consumer group rollout)",
    ),
    ("gate", (), "hash", "shared/protocol/gate.py", "the staleness gate: version, limit, complete"),
    ("gate_started", (), "string", "shared/protocol/gate.py", "groups started under the gate (a counter)"),
    (
        "gate_request",
        ("<token>",),
        "string",
        "shared/protocol/gate.py",
        "one reservation's or refund's outcome (TTL: 120 s, a group's 600 s)",
    ),
    (
        "load_lease",
        (),
        "zset",
        "shared/protocol/streams/pulls.py",
        "sync_mode pull: workers loading now -> lease expiry",
    ),
    ("meta", (), "hash", "shared/runtime/runstate.py", "the run's identity: run, id, created, ended"),
    ("alive", ("<service>", "<worker id>"), "hash", "shared/runtime/heartbeat.py", "a process's heartbeat (TTL)"),
    ("alive_registry", ("<service>",), "set", "shared/runtime/heartbeat.py", "workers that have beaten once"),
    (
        "sampled",
        ("<group id>",),
        "string",
        "shared/protocol/streams/once.py",
        "an agent group's samples entry written (once)",
    ),
    (
        "enqueued",
        ("<group id>",),
        "string",
        "shared/protocol/streams/once.py",
        "a prompt group enqueued (once; gone once the driver is past it)",
    ),
    (
        "control_sent",
        ("<sync>",),
        "hash",
        "shared/protocol/streams/control.py",
        "a sync round's commands and acks written: field <cmd>:<worker> (once; TTL 120 s)",
    ),
    (
        "dead_lettered",
        ("<stream>", "<entry id>"),
        "string",
        "shared/protocol/streams/once.py",
        "a dead letter written (once)",
    ),
    ("driver_enqueued", (), "string", "services/driver/driver.py", "prompt groups the driver has enqueued so far"),
    (
        "val_requested",
        (),
        "set",
        "services/driver/validation.py",
        "the newest validation round asked for (a version; it stands for every round before it)",
    ),
    (
        "call_index",
        ("<episode id>",),
        "hash",
        "shared/protocol/streams/calls.py",
        "an agent episode's calls: request digest -> call index",
    ),
    ("agents_done", ("<group id>",), "set", "services/gateway/runner.py", "a group's agent episodes that ended"),
    ("agents_running", (), "hash", "services/gateway/agents_worker.py", "agent episode -> JSON {worker, job args}"),
    (
        "agents_ended",
        (),
        "hash",
        "services/gateway/runner.py",
        "agent episodes ended so far: finished, failed -> count",
    ),
    (
        "tool_queue",
        (),
        "rq queue",
        "services/rollout/jobs/tool_jobs.py",
        "tool calls and rewards (rq: rq:queue:<name>, jobs rq:job:<run>-<episode>-<call or kind>)",
    ),
    (
        "agent_queue",
        (),
        "rq queue",
        "services/driver/agents.py",
        "agent episodes (rq: rq:queue:<name>, jobs rq:job:<run>-<episode>[-r<attempt>])",
    ),
)

"""Every Redis key streamrl uses, namespaced by run: ``streamrl:<run>:<name>``."""

from __future__ import annotations

PREFIX = "streamrl"

# consumer groups and rq queues: the one place their names are written
ROLLOUT_GROUP = "rollout"  # rollout workers on the prompts streams (training and validation)
TRAINER_GROUP = "trainer"  # the trainer on the samples stream
TOOL_QUEUE = "tools"  # rq queue of tool calls, per run: Keys.tool_queue
AGENT_QUEUE = "agents"  # rq queue of user agent episodes, per run: Keys.agent_queue


class Keys:
    def __init__(self, run: str):
        self.run = run
        self.base = f"{PREFIX}:{run}:"

    def episode(self, episode_id: str) -> str:
        return f"{self.base}ep:{episode_id}"

    def episode_id(self, key: str | bytes) -> str:
        key = key.decode() if isinstance(key, bytes) else key
        return key.removeprefix(f"{self.base}ep:")

    def alive(self, service: str, worker_id: str) -> str:
        """Heartbeat key: exists while the process is alive (TTL)."""
        return f"{self.base}alive:{service}:{worker_id}"

    def sampled(self, group_id: str) -> str:
        """Set once when a group's samples entry is written: a second publish of the same group is a no-op."""
        return f"{self.base}sampled:{group_id}"

    def enqueued(self, group_id: str) -> str:
        """Set once when a prompt group is enqueued: a second enqueue of the same group id is a no-op."""
        return f"{self.base}enqueued:{group_id}"

    def control_sent(self, sync: str, cmd: str, worker: str = "") -> str:
        """Set once when a control command (or, with ``worker``, that worker's ack) is written."""
        return f"{self.base}control:sent:{sync}:{cmd}:{worker}"

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

    driver_enqueued = property(lambda self: f"{self.base}driver:enqueued")  # groups the driver has enqueued so far
    val_requested = property(lambda self: f"{self.base}validation:requested")  # validation rounds asked for

    def call_index(self, episode_id: str) -> str:
        """Hash of an agent episode's calls: request digest -> call index, '#n' -> calls so far (the gateway's
        idempotency record: a request with a digest already there is answered from that call)."""
        return f"{self.base}calls:{episode_id}"

    def agents_done(self, group_id: str) -> str:
        """Set of a group's agent episodes that have ended (the last one in publishes the group)."""
        return f"{self.base}agents:done:{group_id}"

    calls = property(lambda self: f"{self.base}calls")  # LLM call requests from the gateway (rollout group)
    agents_running = property(lambda self: f"{self.base}agents:running")  # episode -> JSON {worker, job args}

    @property
    def agent_queue(self) -> str:
        return f"{AGENT_QUEUE}-{self.run}"

    @property
    def tool_queue(self) -> str:
        return f"{TOOL_QUEUE}-{self.run}"

    @property
    def pattern(self) -> str:
        return f"{self.base}*"

    prompts = property(lambda self: f"{self.base}prompts")
    samples = property(lambda self: f"{self.base}samples")
    agent_groups = property(lambda self: f"{self.base}prompts:agents")  # agent runs: groups handed to agent jobs
    val_prompts = property(lambda self: f"{self.base}prompts:val")  # held-out prompt groups, served first, never trained
    val_samples = property(lambda self: f"{self.base}samples:val")  # their finished groups (read by the driver)
    versions = property(lambda self: f"{self.base}versions")
    control = property(lambda self: f"{self.base}control")
    metrics = property(lambda self: f"{self.base}metrics")
    gate = property(lambda self: f"{self.base}gate")
    gate_started = property(lambda self: f"{self.base}gate:started")
    dead_letters = property(lambda self: f"{self.base}dead")
    meta = property(lambda self: f"{self.base}meta")  # the run's identity: run, id, created, ended (shared/runtime/runstate.py)

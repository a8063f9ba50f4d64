"""Reading a run back for `streamrl check`: every stream through its codec, the consumer groups, the ledger,
into ``RunData`` (plain data, hand-built in unit tests)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.protocol.archive.ledger import read_ledger, read_replays
from shared.protocol.archive.segments import SegmentStore, folder_of
from shared.protocol.episode.errors import EventError
from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from shared.protocol.streams import codec, dead_letters, metrics, pulls, stream_head, versions


def _entries(raw) -> list[tuple[str, dict]]:
    """XRANGE reply -> [(entry id, {str field: bytes value})]."""
    return [(codec.text(i), {codec.text(k): v for k, v in f.items()}) for i, f in raw]


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class ConsumerGroup:
    last_delivered: str = "0-0"
    pending: set[str] = field(default_factory=set)

    def delivered(self, entry_id: str) -> bool:
        return id_key(entry_id) <= id_key(self.last_delivered)


@dataclass
class RunData:
    """Everything the checker reads, as plain data (hand-built in unit tests)."""

    prompts: list[tuple[str, dict]] = field(default_factory=list)
    rollout: ConsumerGroup = field(default_factory=ConsumerGroup)
    samples: list[tuple[str, dict]] = field(default_factory=list)
    trainer: ConsumerGroup = field(default_factory=ConsumerGroup)
    control: list[tuple[str, dict]] = field(default_factory=list)
    # episode id -> entries
    episodes: dict[str, list[tuple[str, dict]]] = field(default_factory=dict)
    ledger: list[dict] = field(default_factory=list)
    # the trainer's restores that re-trained versions (services/trainer/state/replay.py): one record each
    replays: list[dict] = field(default_factory=list)
    # {stream, entry, reason, by}
    dead: list[dict] = field(default_factory=list)
    # worker -> its last rollout metrics record
    reports: dict[str, dict] = field(default_factory=dict)
    # validation rounds (never trained)
    val_prompts: list[tuple[str, dict]] = field(default_factory=list)
    val_rollout: ConsumerGroup = field(default_factory=ConsumerGroup)
    val_samples: list[tuple[str, dict]] = field(default_factory=list)
    prompts_key: str = "prompts"
    samples_key: str = "samples"
    control_key: str = "control"
    episode_key_prefix: str = "ep:"
    # an episode's key is prefix + id + suffix (the suffix closes its hash tag)
    episode_key_suffix: str = ""
    # version numbers in the versions stream, in stream order
    versions: list[int] = field(default_factory=list)
    # agent runs: groups handed to agent jobs
    agent_groups: list[tuple[str, dict]] = field(default_factory=list)
    # agent episodes whose job waits in the queue or runs
    agents_busy: set[str] = field(default_factory=set)
    # sync_mode pull: (worker, version) loaded, in order
    pull_loads: list[tuple[str, int]] = field(default_factory=list)
    # a whole run's check (read with its config: `streamrl check`, the end of `streamrl run`), whose trainer was
    # to train; a component's streams read alone (a test's rollout worker with no trainer) are not held to it
    expect_training: bool = False
    # versions a trained token may lag (staleness_bound(cfg)); None: no bound
    staleness_bound: int | None = None
    # the trainer's count of tokens it masked out as past hard_max_staleness
    stale_tokens_masked: int = 0


def staleness_bound(cfg) -> int | None:
    """The staleness no trained token may exceed under this config: 0 in mode sync, else hard_max_staleness (the
    trainer masks what is older) when set, else None (the admission gate bounds groups in start order only)."""
    if cfg is None:
        return None
    if cfg.mode == "sync":
        return 0
    return cfg.hard_max_staleness or None


def _consumer_group(client, stream: str, name: str) -> ConsumerGroup:
    if not client.exists(stream):
        return ConsumerGroup()
    info = {codec.text(g["name"]): g for g in client.xinfo_groups(stream)}
    if name not in info:
        return ConsumerGroup()
    pending = set()
    start = "-"
    while True:
        batch = client.xpending_range(stream, name, min=start, max="+", count=1000)
        pending |= {codec.text(p["message_id"]) for p in batch}
        if len(batch) < 1000:
            break
        ms, seq = id_key(codec.text(batch[-1]["message_id"]))
        start = f"{ms}-{seq + 1}"
    return ConsumerGroup(codec.text(info[name]["last-delivered-id"]), pending)


def _agents_busy(client, keys: Keys, rq_client=None) -> set[str]:
    """Agent episodes in hand: a job waiting in the agents queue (job id ``<run>-<episode>[-r<attempt>]``) or
    running (the ``agents:running`` hash; a dead worker's entry stays until the reaper runs the job again)."""
    import re

    from rq import Queue

    busy = {codec.text(e) for e in client.hkeys(keys.agents_running)}
    prefix = f"{keys.run}-"
    for job_id in Queue(keys.agent_queue, connection=rq_client or client).get_job_ids():
        if job_id.startswith(prefix):
            busy.add(re.sub(r"-r\d+$", "", job_id[len(prefix) :]))
    return busy


def _head(run_path: Path, stream: str) -> Path:
    return stream_head.path_of(run_path, stream_head.NAMES[stream])


def read_run(client, keys: Keys, run_path: Path, rq_client=None, cfg=None) -> RunData:
    """Everything the checker counts. ``rq_client``: the rq queues' server when it is not ``client``'s; ``cfg``:
    the run's config (its staleness bound; without it, trained tokens are not checked against one)."""
    data = RunData(
        prompts_key=keys.prompts,
        samples_key=keys.samples,
        control_key=keys.control,
        episode_key_prefix=keys.episode_prefix,
        episode_key_suffix=keys.episode("").removeprefix(keys.episode_prefix),
        staleness_bound=staleness_bound(cfg),
        expect_training=cfg is not None,
    )
    data.prompts = _entries(stream_head.read_all(client, keys.prompts, stream_head.path_of(run_path, "prompts")))
    data.rollout = _consumer_group(client, keys.prompts, ROLLOUT_GROUP)
    data.samples = _entries(stream_head.read_all(client, keys.samples, stream_head.path_of(run_path, "samples")))
    data.trainer = _consumer_group(client, keys.samples, TRAINER_GROUP)
    data.control = _entries(client.xrange(keys.control))
    if hasattr(keys, "val_prompts"):
        data.val_prompts = _entries(stream_head.read_all(client, keys.val_prompts, _head(run_path, "prompts:val")))
        data.val_rollout = _consumer_group(client, keys.val_prompts, ROLLOUT_GROUP)
        data.val_samples = _entries(stream_head.read_all(client, keys.val_samples, _head(run_path, "samples:val")))
    data.agent_groups = _entries(client.xrange(keys.agent_groups))
    if data.agent_groups:
        data.agents_busy = _agents_busy(client, keys, rq_client)
    for key in client.scan_iter(match=keys.episode("*"), count=1000, _type="stream"):
        data.episodes[keys.episode_id(key)] = _entries(client.xrange(key))
    # the episodes moved out of Redis
    for episode_id, entries in SegmentStore(folder_of(run_path)).iter_all():
        # in both tiers only for a moment mid-move (Redis is deleted last)
        if episode_id not in data.episodes:
            data.episodes[episode_id] = _entries(entries)
    data.ledger = read_ledger(Path(run_path) / "trainer")
    data.replays = read_replays(Path(run_path) / "trainer")
    data.dead = [asdict(d) for d in dead_letters.read_all(client, keys)]
    # the run folder's files, then Redis
    records = metrics.history(client, keys, run_path, ("rollout", "train"))
    for rec in records["rollout"]:
        data.reports[rec.get("worker", "")] = rec
    # cumulative: the last record has the total
    for rec in records["train"]:
        data.stale_tokens_masked = int(rec.get("stale_tokens_masked", 0))
    data.pull_loads = [
        (p.worker, p.version)
        for p in pulls.read_all(client, keys)
        if p.event == "released" and not p.extra.get("error")
    ]
    for entry_id, fields in stream_head.read_all(client, keys.versions, versions.head_path(run_path)):
        try:
            data.versions.append(versions.decode(entry_id, fields).version)
        except EventError:
            # the trainer writes every entry through the codec: a malformed one is not a version
            continue
    return data

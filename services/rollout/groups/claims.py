"""Prompt groups a rollout worker holds: claiming them (validation first; training through the staleness
gate), taking over the groups of dead workers (and re-opening its own orphans), and publishing a finished
group (samples entry + acknowledgement, once). The episodes of a group are driven by ``episodes.Episodes``.

Other request sources (e.g. gateway calls) add their claims to ``claim``'s result the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from shared.protocol import gate
from shared.protocol.episode.errors import EventError
from shared.protocol.gate import Gate
from shared.protocol.keys import ROLLOUT_GROUP as GROUP
from shared.protocol.keys import Keys
from shared.protocol.streams import codec, dead_letters
from shared.protocol.streams.prompts import PromptGroup, decode_group
from shared.protocol.streams.samples import Publisher, Sample
from shared.runtime import heartbeat
from shared.runtime.faults import crash_point

# a gone owner's entries are claimed once idle this long: a live worker's claim of the same entry a moment before
# resets its idle time, so the second claim finds it taken
GONE_MIN_IDLE_MS = 200


@dataclass
class GroupRun:
    group: PromptGroup
    episodes: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    # their end recorded, its write maybe still in flight
    ended: set[str] = field(default_factory=set)

    @property
    def generating(self) -> bool:
        """Some episode of it may still use the engine (a group whose every episode ended frees its slot while its
        last writes and its publish are in flight)."""
        return len(self.done | self.ended) < len(self.episodes)

    # the prompts stream the group came from (training or validation)
    source: str = ""
    # the dead worker it was claimed from
    takeover_from: str | None = None
    # the notice (shared/protocol/repacks.Repack) when another worker handed it here
    repack: object | None = None

    @property
    def complete(self) -> bool:
        return len(self.done) >= len(self.episodes)


class Groups:
    def __init__(self, cfg, client, keys: Keys, worker_id: str, log):
        self.cfg, self.client, self.keys, self.worker_id, self.log = cfg, client, keys, worker_id, log
        self.gate = Gate(client, keys, sync_mode=cfg.mode == "sync")
        self.publisher = Publisher(client, keys)
        self.held: dict[str, GroupRun] = {}
        self.published = 0
        # complete, to publish with the next step's writes (maybe_publish)
        self.queued: list[GroupRun] = []
        # prompt entries of groups queued or in flight: not orphans
        self.publishing: set[str] = set()
        # worker -> when its heartbeat key was first seen missing
        self._missing_since: dict[str, float] = {}
        # slots new claims may fill (a long-tail worker's share: repacker)
        self.claim_cap = cfg.max_groups_in_flight
        # entry id -> repack notice: handed here, not re-opened yet
        self.repacked: dict[str, object] = {}
        # a long-tail worker's: reads the repack notices written so far (repacker.py)
        self.read_notices = None
        # the last claim got nothing: the gate's limit for the worker's version is spent
        self.gated = False

    def create_consumer_groups(self) -> None:
        for stream in (self.keys.val_prompts, self.keys.prompts):
            codec.ensure_group(self.client, stream, GROUP)

    def slots_used(self, also=()) -> float:
        """In-flight capacity is ``max_groups_in_flight`` training groups; a validation group (one or ``val_k``
        episodes) takes its episodes' share of a slot, not a whole one, so a round is claimed at once."""
        val = self.keys.val_prompts
        return sum(
            run.group.n / self.cfg.group_size if run.source == val else 1
            for run in (*self.held.values(), *also)
            if run.generating
        )

    def room(self, also=(), cap: int | None = None) -> int:
        """Training groups that may still start (beside ``also``: claimed, not held yet), of ``cap`` slots
        (default: all, max_groups_in_flight)."""
        cap = self.cfg.max_groups_in_flight if cap is None else cap
        return max(0, int(cap - self.slots_used(also) + 1e-9))

    def val_room(self) -> int:
        """Validation groups that may still start (each of at most ``val_k`` episodes)."""
        free = self.claim_cap - self.slots_used()
        return max(0, int(free * self.cfg.group_size / max(1, self.cfg.val_k) + 1e-9))

    def get(self, group_id: str) -> GroupRun | None:
        return self.held.get(group_id)

    # --- claiming
    def claim(self, version: int) -> list[GroupRun]:
        """New groups: validation ones first (no gate: never trained), then training ones as far as the gate
        allows for a worker at ``version``. Not yet held: the caller opens each (``hold``)."""
        runs = self._read(self.keys.val_prompts, self.val_room())
        slots = self._reserve(self.room(also=runs, cap=self.claim_cap), version)
        # the gate's limit for this version is spent (pull policy)
        self.gated = slots.gated and slots.granted == 0
        if slots.granted > 0:
            entries = self._read(self.keys.prompts, slots.granted)
            if slots.gated:
                # fewer waiting, or dead-lettered: slots back
                self.gate.refund(slots.granted - len(entries))
            runs += entries
        return runs

    def _reserve(self, want: int, version: int) -> gate.Grant:
        if want <= 0:
            return gate.Grant(0, False, None)
        # a group starts only under the very version the gate admits it for
        if self.cfg.mode == "sync":
            if gate.peek(self.client, self.keys)[0] != version:
                return gate.Grant(0, False, None)
            grant = self.gate.reserve(want)
            # the gate moved on between the look and the reservation
            if grant.gated and grant.version != version:
                self.gate.refund(grant.granted)
                return gate.Grant(0, False, None)
            return grant
        # behind the gate (rolling): its own version's limit
        return self.gate.reserve(want, version=version)

    def _read(self, stream: str, count: int) -> list[GroupRun]:
        if count <= 0:
            return []
        reply = self.client.xreadgroup(GROUP, self.worker_id, {stream: ">"}, count=count)
        return [
            run
            for entry_id, fields in (e for _, es in reply or [] for e in es)
            if (run := self.decode(stream, entry_id, fields)) is not None
        ]

    def decode(self, stream: str, entry_id, fields, takeover_from: str | None = None) -> GroupRun | None:
        """The entry as a group to open; None (dead-lettered and acknowledged) when malformed."""
        try:
            group = decode_group(entry_id, fields)
        except EventError as exc:
            self.dead_letter(stream, entry_id, str(exc))
            self.client.xack(stream, GROUP, entry_id)
            return None
        return GroupRun(group, group.episode_ids(), source=stream, takeover_from=takeover_from)

    def hold(self, run: GroupRun) -> None:
        self.held[run.group.group_id] = run
        self.log.info("group claimed", group=run.group.group_id, n=run.group.n, takeover_from=run.takeover_from)

    def holds(self, run: GroupRun) -> bool:
        return self.held.get(run.group.group_id) is run

    def drop(self, group_id: str) -> None:
        self.held.pop(group_id, None)

    # --- crash takeover
    def take_over(self) -> list[GroupRun]:
        """Groups to re-open: pending under this worker but no longer held (dropped after a fence, or a
        publish Redis forgot), then those of dead workers (``_dead_owners``: a process of this host that is gone, at
        once; else a heartbeat missing for heartbeat_ttl)."""
        free, runs = self.room(), []
        self._forget_revived()
        min_idle = int(self.cfg.heartbeat_ttl * 1000)
        for stream in (self.keys.val_prompts, self.keys.prompts):
            if free <= 0:
                break
            pending = self.client.xpending_range(stream, GROUP, min="-", max="+", count=100)
            held = {run.group.entry_id for run in self.held.values()} | self.publishing
            mine = pending
            # all of this worker's, not the first 100
            if any(n.stream == stream for n in self.repacked.values()):
                mine = self.client.xpending_range(
                    stream, GROUP, min="-", max="+", count=10_000, consumername=self.worker_id
                )
            orphans = [
                p["message_id"]
                for p in mine
                if p["consumer"].decode() == self.worker_id and p["message_id"].decode() not in held
            ]
            if self.read_notices and any(o.decode() not in self.repacked for o in orphans):
                # a hand-over moves the entry and writes its notice at once: read it first
                self.read_notices()
            self._forget_stale_repacks(
                stream, {p["message_id"].decode() for p in mine if p["consumer"].decode() == self.worker_id}
            )
            for entry_id, fields in (
                self.client.xclaim(stream, GROUP, self.worker_id, 0, orphans[:free]) if orphans else []
            ):
                if fields and (run := self.decode(stream, entry_id, fields)) is not None:
                    run.repack = self.repacked.pop(entry_id.decode(), None)
                    if run.repack is None:
                        self.log.warning("re-opening a group this worker no longer held", entry=entry_id.decode())
                    runs.append(run)
                    free -= 1
            for owner, (idle_ms, ids) in self._dead_owners(pending, min_idle).items():
                if free <= 0:
                    break
                for entry_id, fields in self.client.xclaim(stream, GROUP, self.worker_id, idle_ms, ids[:free]):
                    if fields and (run := self.decode(stream, entry_id, fields, takeover_from=owner)) is not None:
                        runs.append(run)
                        free -= 1
        return runs

    def _forget_stale_repacks(self, stream: str, mine: set[str]) -> None:
        """A repack notice whose entry is no longer pending here (another worker took it over) is dropped."""
        for entry in [e for e, n in self.repacked.items() if n.stream == stream and e not in mine]:
            del self.repacked[entry]

    def _forget_revived(self) -> None:
        """Drop the heartbeat-miss record of every owner alive again, on every take-over pass (room or not): a
        record of a stall that ended must not make the owner dead on first look at the next mass lapse."""
        if self._missing_since:
            owners = list(self._missing_since)
            pipe = self.client.pipeline(transaction=False)
            for owner in owners:
                pipe.exists(self.keys.alive("rollout", owner))
            for owner, alive in zip(owners, pipe.execute()):
                if alive:
                    del self._missing_since[owner]

    def _dead_owners(self, pending, min_idle: int) -> dict[str, tuple[int, list]]:
        """{owner: (the idle time its entries are claimed with, their ids)} of the dead owners of pending entries.
        Dead: a worker of this host whose process is gone (``heartbeat.gone``: certain at once; its entries idle
        ``GONE_MIN_IDLE_MS``, so that of two workers claiming at once only the first wins), or one whose heartbeat has
        been missing for a whole heartbeat_ttl and whose entries are idle that long (after a Redis restart every
        heartbeat key lapses at once, and live workers write theirs again within heartbeat_ttl / 3)."""
        idle: dict[str, list] = {}
        for p in pending:
            owner = p["consumer"].decode()
            if owner != self.worker_id:
                idle.setdefault(owner, []).append((p["time_since_delivered"], p["message_id"]))
        dead = {}
        for owner, entries in idle.items():
            if heartbeat.gone(owner):
                ids = [entry for ms, entry in entries if ms >= GONE_MIN_IDLE_MS]
                if ids:
                    dead[owner] = (GONE_MIN_IDLE_MS, ids)
                continue
            ids = [entry for ms, entry in entries if ms >= min_idle]
            if not ids:
                continue
            if self.client.exists(self.keys.alive("rollout", owner)):
                self._missing_since.pop(owner, None)
                continue
            if time.monotonic() - self._missing_since.setdefault(owner, time.monotonic()) >= self.cfg.heartbeat_ttl:
                dead[owner] = (min_idle, ids)
        return dead

    # --- publishing
    def maybe_publish(self, run: GroupRun, later: bool = False) -> bool:
        """Publish a complete group (every episode's end is in its stream): now, or with ``later`` queued for the
        next step's pipeline (``add_queued``; ``publish_queued`` sends what is left now)."""
        if not run.complete or not self.holds(run):
            return False
        g = run.group
        # tests only (shared/runtime/faults.py)
        crash_point("rollout", "finished")
        if later:
            self.queued.append(run)
            self.publishing.add(g.entry_id)
        else:
            self.publisher.publish(self._sample(run), *self._where(run))
        del self.held[g.group_id]
        self.published += 1
        self.log.info("group finished", group=g.group_id, queued=later)
        return True

    def take_queued(self) -> list[GroupRun]:
        runs, self.queued = self.queued, []
        return runs

    def add(self, pipe, runs: list[GroupRun]) -> None:
        """The publishes of ``runs`` as commands of a pipeline (built on the writer thread: reads only ``runs``)."""
        for run in runs:
            self.publisher.add(pipe, self._sample(run), *self._where(run))

    def settle(self, runs: list[GroupRun], results: list) -> None:
        """``add``'s results: a server that did not have the script gets each of those publishes again (loading
        it); any other error raises (the groups stay pending: a takeover publishes them, once)."""
        for run, result in zip(runs, results):
            if isinstance(result, redis.exceptions.NoScriptError):
                self.publisher.publish(self._sample(run), *self._where(run))
            elif isinstance(result, Exception):
                raise result
            self.publishing.discard(run.group.entry_id)

    def publish_queued(self) -> None:
        """Whatever is queued, published now (pause, shutdown, a worker going idle)."""
        for run in self.take_queued():
            self.publisher.publish(self._sample(run), *self._where(run))
            self.publishing.discard(run.group.entry_id)

    def _sample(self, run: GroupRun) -> Sample:
        g = run.group
        return Sample(g.group_id, run.episodes, self.worker_id, g.n)

    def _where(self, run: GroupRun) -> tuple[str, str, str]:
        samples = self.keys.val_samples if run.source == self.keys.val_prompts else self.keys.samples
        return samples, run.source, run.group.entry_id

    def dead_letter(self, stream: str, entry_id, reason: str) -> None:
        entry_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self.log.error("bad input sent to dead letters", stream=stream, entry=entry_id, reason=reason)
        dead_letters.send(self.client, self.keys, stream, entry_id, reason, self.worker_id)

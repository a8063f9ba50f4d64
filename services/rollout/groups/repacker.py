"""Long-tail repack through the log: both ends of it in a rollout worker (the policy is ``repack_policy``).

Source (a normal worker, ``repack_below`` > 0), after each tick's flushes: when the policy picks groups and a
live long-tail worker has room, for each group: abort its generating episodes (an ``aborted`` event each,
reason 'repack'), flush them, hand its pending prompt entry to the target and append a notice
(``shared/protocol/repacks.handoff``: one script, fenced on the entry's owner), then forget the group here. A
group that was partly finished keeps its finished episodes (they are in their streams).

Target (a long-tail worker): the ``repacks`` stream is one of the streams its idle blocking read waits on, so
a notice wakes it at once; the group is pending under it already, so its next take-over pass re-opens it
from its streams like any orphan (before claiming anything new): each episode gets a ``resumed`` event with
``repacked: <source>`` and continues from prompt + tokens so far, the same tokens under fixed seeds.

Crashes: killed after the abort's flush and before the handoff, the source still owns the entry, and it is
taken over when its heartbeat lapses; killed after the handoff, the target owns it (the notice or the
target's own orphan check re-opens it). A target that dies is taken over like any worker.
"""

from __future__ import annotations

import time

from services.rollout.episodes.live import State
from services.rollout.groups import repack_policy as repack
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold
from shared.protocol.streams import repacks
from shared.runtime.faults import crash_point
from shared.runtime.heartbeat import alive_of

# weight of the newest engine step in the source's step-time average
STEP_EMA = 0.2


class Repacker:
    def __init__(self, cfg, client, keys, worker_id: str, episodes, claims, log):
        self.cfg, self.client, self.keys, self.worker_id = cfg, client, keys, worker_id
        self.episodes, self.claims, self.log = episodes, claims, log
        self.longtail = cfg.rollout_role == "longtail"
        self.enabled = cfg.repack_below > 0 and not self.longtail
        self.capacity = repack.capacity(cfg.max_batch_size, cfg.max_groups_in_flight, cfg.group_size)
        claims.claim_cap = repack.claim_cap(cfg.rollout_role, cfg.max_groups_in_flight, cfg.longtail_claim_share)
        self.cursor = "$"
        self.stats = {
            "repacks": 0,
            "repacked_groups": 0,
            "repacked_episodes": 0,
            "repacked_tokens": 0,
            "repacked_in": 0,
            "repack_saved_steps": 0,
            "repack_saved_s": 0.0,
        }
        self._step_s, self._busy_s = 0.0, 0.0
        self._targets: dict[str, dict[str, str]] = {}
        self._targets_until = 0.0
        # group id -> (notice, episode ids): repacked groups held here
        self._incoming: dict[str, tuple] = {}

    # --- target side
    def start(self) -> None:
        if self.longtail:
            self.cursor = repacks.last_id(self.client, self.keys)
            self.claims.read_notices = self.read_notices

    def read_notices(self) -> None:
        """The notices written since the last read, now: the take-over pass calls it before it would re-open an
        entry pending here as an orphan (the timer may run before the idle read has brought the notice)."""
        for stream, entries in self.client.xread({self.keys.repacks: self.cursor}, count=1000) or []:
            self.saw(stream.decode() if isinstance(stream, bytes) else stream, entries)

    def wake_streams(self) -> dict[str, str]:
        """Streams the idle blocking read adds: a long-tail worker wakes on a notice."""
        return {self.keys.repacks: self.cursor} if self.longtail else {}

    def saw(self, stream: str, entries) -> bool:
        """True when ``entries`` came from the repacks stream (consumed here): notices for this worker mark their
        entries so the take-over pass re-opens them as repacked groups."""
        if stream != self.keys.repacks:
            return False
        for entry_id, fields in entries:
            self.cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            try:
                notice = repacks.decode(entry_id, fields)
            except EventError as exc:
                self.claims.dead_letter(self.keys.repacks, entry_id, str(exc))
                continue
            if notice.target == self.worker_id:
                self.claims.repacked[notice.entry] = notice
                self.log.info("repack notice", group=notice.group, source=notice.source, episodes=notice.episodes)
        return True

    def waiting(self) -> bool:
        """A repacked group is pending here, not opened yet: run the take-over pass now (before new claims)."""
        return bool(self.claims.repacked) and self.claims.room() > 0

    def opened(self, run) -> None:
        if run.repack is not None:
            self._incoming[run.group.group_id] = (run.repack, list(run.episodes))
            self.stats["repacked_in"] += 1

    def _count_saved(self) -> None:
        """For each repacked group that has left this worker (published): the engine steps its tail took here,
        the most tokens any of its episodes generated after the repack, are steps the source no longer ran on a
        near-empty batch; times the source's step time, the time saved (an estimate: the source might have
        refilled its batch meanwhile)."""
        for gid in [gid for gid in self._incoming if gid not in self.claims.held]:
            notice, episode_ids = self._incoming.pop(gid)
            steps = 0
            for entries in self.episodes.events.read_many(episode_ids):
                try:
                    ep = fold(entries)
                except EventError:
                    continue
                at = [r["num_tokens"] for r in ep.resumes if r.get("repacked") == notice.source]
                if at:
                    steps = max(steps, sum(ep.mask[at[-1] :]))
            self.stats["repack_saved_steps"] += steps
            self.stats["repack_saved_s"] += steps * notice.step_ms / 1000

    # --- source side
    def after_tick(self, busy_s: float) -> None:
        """Once per tick, after its flushes: the step-time average, repacked groups finished here, then the policy."""
        if busy_s > self._busy_s:
            step = busy_s - self._busy_s
            self._step_s = step if not self._step_s else (1 - STEP_EMA) * self._step_s + STEP_EMA * step
        self._busy_s = busy_s
        if self._incoming:
            self._count_saved()
        if self.enabled and not self.episodes.paused:
            self._maybe_repack()

    def _maybe_repack(self) -> None:
        tails = self._tails()
        if not repack.choose(tails, self.capacity, self.cfg.repack_below, self.cfg.repack_min_tokens, room=1 << 30):
            return
        target = self._target()
        if target is None:
            return
        name, room = target
        chosen = repack.choose(tails, self.capacity, self.cfg.repack_below, self.cfg.repack_min_tokens, room)
        moved = [gid for gid in chosen if self._move(gid, name)]
        if moved:
            # until its next heartbeat says otherwise
            self._targets[name]["room"] = str(room - len(moved))
            self.stats["repacks"] += 1

    def _tails(self) -> list[repack.GroupTail]:
        by_group: dict[str, list] = {gid: [] for gid in self.claims.held}
        for live in self.episodes.live.values():
            if live.group_id in by_group:
                by_group[live.group_id].append(live)
        return [
            repack.GroupTail(
                gid,
                tuple(l.num_generated for l in lives if l.state is State.GENERATING),
                sum(l.state in (State.TOOL, State.SCORING) for l in lives),
            )
            for gid, lives in by_group.items()
        ]

    def _target(self) -> tuple[str, int] | None:
        now = time.monotonic()
        # the heartbeats, read at most every heartbeat_ttl / 3
        if now >= self._targets_until:
            self._targets = alive_of(self.client, self.keys, "rollout")
            self._targets_until = now + self.cfg.heartbeat_ttl / 3
        return repack.pick_target(self._targets, self.worker_id)

    def _move(self, group_id: str, target: str) -> bool:
        run = self.claims.get(group_id)
        stopped = self.episodes.stop_group(group_id, "repack")
        if run is None or stopped is None:
            # fenced while flushing: another worker owns the group (flush dropped it)
            return False
        # tests only (shared/runtime/faults.py)
        crash_point("rollout", "repack_stopped")
        notice = repacks.Repack(
            run.source,
            run.group.entry_id,
            group_id,
            self.worker_id,
            target,
            len(stopped),
            sum(l.num_generated for l in stopped),
            self._step_s * 1000,
        )
        handed = repacks.handoff(self.client, self.keys, notice)
        crash_point("rollout", "repack_handed")
        self.episodes.forget_group(group_id)
        if handed is None:
            self.log.warning("repack: the group's entry was no longer pending here; dropping it", group=group_id)
            return False
        self.stats["repacked_groups"] += 1
        self.stats["repacked_episodes"] += len(stopped)
        self.stats["repacked_tokens"] += notice.tokens
        self.log.info("group repacked", group=group_id, target=target, episodes=len(stopped), tokens=notice.tokens)
        return True

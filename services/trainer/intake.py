"""Sample intake: the ``samples`` stream read exactly once, and each group's episodes replayed for training.

The trainer's consumer (one per run, a stable name) reads entries; a group already trained or judged untrainable
(``consumed``: the ledger's lines, rebuilt at restore) or already in hand (``taken``) is acknowledged and dropped,
anything else waits in ``buffer``. ``replay`` folds a group's episode streams (one round trip; once ``read_ahead``
is on, new entries come with their streams already read and folded, by a thread that runs while the trainer trains:
services/trainer/read_ahead.py); a group with no
finished episode, or a constant reward under ``filter_constant_groups``, is not trained: it gives its gate slot
back and is acknowledged with the next commit. ``uncommitted`` holds every group read since the last commit with
whether it trained; the commit (services/trainer/trainer.py) writes them to the ledger, then acknowledges them.
``refold`` reads a committed step's groups again, from either tier of the log, for a restore's re-training
(services/trainer/state/replay.py): the same episodes, with no count and no dead letter a second time.
"""

from __future__ import annotations

from services.trainer.batch import trained_reward
from services.trainer.read_ahead import Fetched, ReadAhead, fold_all, fold_checked
from shared.protocol import gate
from shared.protocol.archive import ledger
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import Episode
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import TRAINER_GROUP as GROUP
from shared.protocol.streams import dead_letters

# one trainer per run: a stable name gets its own pending entries back after a restart
CONSUMER = "trainer"


class Intake:
    def __init__(self, client, keys, counts: dict, filter_constant_groups: bool, log, archive=None, route_shape=None):
        self.client, self.keys, self.counts, self.log = client, keys, counts, log
        # routing replay: the shape every logged route must have (shared/protocol/episode/routes.py), else None
        self.route_shape = route_shape
        self.filter_constant_groups = filter_constant_groups
        # ``archive``: the run's segments (a SegmentStore), where a committed group's streams may have moved
        self.episodes = EpisodeLog(client, keys, "trainer", archive=archive)
        # group ids trained or judged untrainable (the ledger's)
        self.consumed: set[str] = set()
        # (samples entry, group id, trained?) since the last commit
        self.uncommitted: list[tuple[str, str, bool]] = []
        # (entry id, group id, episode ids) not yet trained
        self.buffer: list[tuple[str, str, list[str]]] = []
        # entry id -> its group's folded streams, for a buffered entry read ahead
        self.folded: dict[str, list] = {}
        # group id -> samples entry, for groups read but not yet committed
        self.taken: dict[str, str] = {}
        # episodes a re-training found in neither tier of the log
        self.missing: list[str] = []
        # new entries read and folded on a thread while the trainer trains (``read_ahead``), else None
        self.ahead: ReadAhead | None = None

    def read_ahead(self, depth: int) -> None:
        """From now on new entries, and their groups' streams, are read on a thread (services/trainer/read_ahead.py):
        call after ``read_pending``."""
        known = lambda group_id: group_id in self.consumed or group_id in self.taken  # noqa: E731
        archive = self.episodes.archive
        self.ahead = ReadAhead(self.client, self.keys, CONSUMER, known, self.route_shape, archive, depth)
        self.ahead.start()

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()

    def read_pending(self) -> int:
        """Entries delivered before a crash come back first: all of them, page by page; the pages read."""
        start, pages = "0", 0
        while (last := self.read(start=start)) is not None:
            start, pages = last, pages + 1
        return pages

    def read(self, start: str = ">", block_ms: int | None = None) -> str | None:
        """Read one page (new entries, or this consumer's pending ones after ``start``); the last entry id read."""
        reply = self.client.xreadgroup(GROUP, CONSUMER, {self.keys.samples: start}, count=100, block=block_ms)
        fetched = [
            Fetched(entry_id.decode(), fields or {}) for _, entries in reply or [] for entry_id, fields in entries
        ]
        self._accept(fetched)
        return fetched[-1].entry_id if fetched else None

    def _accept(self, fetched: list[Fetched]) -> None:
        """Entries read: a bad one to the dead letters, a group already trained or in hand acknowledged and dropped
        (exactly once), any other into ``buffer``."""
        acks = []
        for item in fetched:
            entry_id = item.entry_id
            try:
                sample = item.decoded()
            except EventError as exc:
                self.log.error("bad samples entry sent to dead letters", entry=entry_id, reason=str(exc))
                dead_letters.send(self.client, self.keys, self.keys.samples, entry_id, str(exc), "trainer")
                acks.append(entry_id)
                continue
            group_id = sample.group_id
            if group_id in self.consumed or group_id in self.taken:
                # already trained, or in hand since the last commit: exactly once. The very entry in hand
                # can come again when Redis restarts and forgets its delivery: it stays unacknowledged
                if self.taken.get(group_id) != entry_id:
                    acks.append(entry_id)
            else:
                self.buffer.append((entry_id, group_id, sample.episodes))
                self.taken[group_id] = entry_id
                if item.folds is not None:
                    self.folded[entry_id] = item.folds
        if acks:
            self.client.xack(self.keys.samples, GROUP, *acks)

    def collect(self, batch_groups: int, should_stop, on_idle) -> list[tuple[str, str, list[Episode]]] | None:
        """Block until ``batch_groups`` trainable groups are ready (their streams replayed); None: stopped.
        ``on_idle`` runs after each read that found nothing (up to 200 ms)."""
        ready: list[tuple[str, str, list[Episode]]] = []
        while len(ready) < batch_groups:
            if not self.buffer:
                if should_stop():
                    return None
                if not self._read_more():
                    on_idle()
                continue
            entry_id, group_id, eids = self.buffer.pop(0)
            group = self.replay(entry_id, group_id, eids, self.folded.pop(entry_id, None))
            if group is not None:
                ready.append((entry_id, group_id, group))
        return ready

    def _read_more(self) -> bool:
        """New entries into ``buffer`` (up to 200 ms waited for the first); whether any came."""
        if self.ahead is None:
            return self.read(block_ms=200) is not None
        fetched = self.ahead.take(timeout=0.2)
        self._accept(fetched)
        return bool(fetched)

    def replay(self, entry_id: str, group_id: str, eids: list[str], folds: list | None = None) -> list[Episode] | None:
        """The group's finished episodes, or None when it is not trained (no finished episode, or a constant
        reward with ``filter_constant_groups``): then it gives its gate slot back and is counted. ``folds``: the
        streams already read and folded (read ahead), else they are read now, in one round trip."""
        episodes = []
        for eid, ep in zip(eids, fold_all(self.episodes, eids, self.route_shape) if folds is None else folds):
            # set aside with its reason (loses nothing); the group trains without it
            if isinstance(ep, EventError):
                self.log.error("episode stream unreadable; episode skipped", episode=eid, error=str(ep))
                dead_letters.send(self.client, self.keys, self.keys.episode(eid), ep.entry_id, str(ep), "trainer")
                self.counts["episodes_failed"] += 1
                continue
            if ep.status == "finished":
                episodes.append(ep)
            # failed: the engine or the reward function, not the policy
            else:
                self.counts["episodes_failed"] += 1
        rewards = {trained_reward(ep)[0] for ep in episodes}
        constant = self.filter_constant_groups and len(rewards) == 1
        if not episodes or constant:
            reason = "constant reward" if episodes else "no finished episodes"
            self.counts["constant_groups_filtered" if episodes else "groups_dropped"] += 1
            self.counts["tokens_wasted"] += sum(ep.num_generated for ep in episodes)
            self.log.info("group not trained", group=group_id, reason=reason)
            # acknowledged with the next commit, never trained
            self.uncommitted.append((entry_id, group_id, False))
            # give its start back to the staleness gate (which counts starts): a replacement group may start.
            # Without it a synchronous run (exactly batch_groups starts per version) would wait forever.
            gate.refund_group(self.client, self.keys, group_id)
            return None
        return episodes

    def refold(self, step: list[tuple[str, list[str]]]) -> list[tuple[str, str, list[Episode]]]:
        """A committed step's groups ((group id, episode ids), in the order they trained) as the step had them: each
        group's finished episodes; an unreadable stream is left out as it was then. Episodes not in the log at all
        are left out too, and counted in ``missing``."""
        out = []
        # the whole step's streams in one round trip (a restore reads many steps, one after another)
        read = iter(self.episodes.read_many([eid for _, eids in step for eid in eids]))
        for group_id, eids in step:
            episodes = []
            for eid, entries in zip(eids, read):
                if not entries:
                    self.missing.append(eid)
                    continue
                try:
                    ep = fold_checked(entries, self.route_shape)
                except EventError:
                    continue
                if ep.status == "finished":
                    episodes.append(ep)
            if episodes:
                out.append(("", group_id, episodes))
        return out

    def trained(self, groups, trained: bool) -> None:
        """A training step took ``groups`` ((entry, group id, episodes)); acknowledged with the next commit."""
        self.uncommitted += [(e, g, trained) for e, g, _ in groups]

    def to_commit(self) -> tuple[list[str], list[str]]:
        """The group ids the next commit records: (trained, skipped)."""
        return ([g for _, g, t in self.uncommitted if t], [g for _, g, t in self.uncommitted if not t])

    def committed(self, groups: list[str]) -> None:
        """``groups`` are in a ledger line (or about to be, in the checkpoint): never read again."""
        self.consumed.update(groups)
        for g in groups:
            self.taken.pop(g, None)

    def acknowledge(self) -> None:
        """After the ledger line: the samples entries of every group since the last commit leave the pending list."""
        if self.uncommitted:
            self.client.xack(self.keys.samples, GROUP, *[e for e, _, _ in self.uncommitted])
        self.uncommitted = []

    def settle_skipped(self, ckpt_dir, version: int, step: int) -> None:
        """Acknowledge groups judged untrainable when no training step is pending to carry them: a
        skipped group is never trained, so its acknowledgement needs no checkpoint; it stays in its stream."""
        if not self.uncommitted or any(trained for _, _, trained in self.uncommitted):
            return
        skipped = [g for _, g, _ in self.uncommitted]
        ledger.append_ledger(ckpt_dir, {"version": version, "step": step, "groups": [], "skipped": skipped})
        self.committed(skipped)
        self.acknowledge()

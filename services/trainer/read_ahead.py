"""Reading ahead: the samples stream's next entries, and their groups' episode streams read and folded, on a thread
while the trainer trains, so that the next batch is in memory when the trainer asks for it.

The thread only reads: one ``XREADGROUP`` page of new entries (they become pending under the trainer's consumer, as
the trainer's own read would make them), then each new group's streams in one round trip, folded. Everything that
changes state is left to the trainer's thread (``Intake``): which entries are duplicates and acknowledged, dead
letters, counts, gate refunds, the ledger. A crash loses nothing: an entry read here and not yet trained is pending
and comes back with ``Intake.read_pending`` at the next start, as any entry read before a crash does.

A group's streams are final once it is in the samples stream (a worker publishes a group only after every episode's
end is in its stream), so reading them early reads what the trainer would have read later. ``depth`` bounds how many
entries wait here: the thread stops reading when that many are read and not yet taken; a stop is seen within one
blocking read (200 ms).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shared.protocol.episode import routes
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import Episode, fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import TRAINER_GROUP
from shared.protocol.streams import samples


@dataclass
class Fetched:
    """One samples entry as read ahead: the decoded sample (or why it did not decode) and, for a group not known to
    be consumed, each episode's fold (an ``Episode``, or the ``EventError`` its stream raised), in episode order."""

    entry_id: str
    fields: dict
    sample: samples.Sample | None = None
    error: EventError | None = None
    folds: list[Episode | EventError] | None = None

    def decoded(self) -> samples.Sample:
        """The sample (decoded once); raises the ``EventError`` of an entry that does not decode."""
        if self.sample is None and self.error is None:
            try:
                self.sample = samples.decode(self.entry_id, self.fields)
            except EventError as exc:
                self.error = exc
        if self.error is not None:
            raise self.error
        return self.sample


def fold_checked(entries, route_shape) -> Episode:
    """The stream folded, its routes checked against the policy's shape (routing replay); raises ``EventError``."""
    ep = fold(entries)
    if route_shape is not None:
        for ev in ep.events:
            held = ev.data.get("routes") if ev.kind == "tokens" else None
            if held is not None and (problem := routes.mismatch(ev.entry_id, "data.routes", held, route_shape)):
                raise problem
    return ep


def fold_all(log: EpisodeLog, episode_ids: list[str], route_shape) -> list[Episode | EventError]:
    """Each episode's stream (one round trip, either tier of the log) folded and checked, or the error it raised."""
    out: list[Episode | EventError] = []
    for entries in log.read_many(episode_ids) if episode_ids else []:
        try:
            out.append(fold_checked(entries, route_shape))
        except EventError as exc:
            out.append(exc)
    return out


class ReadAhead:
    def __init__(self, client, keys, consumer: str, known, route_shape=None, archive=None, depth: int = 64):
        self.client, self.keys, self.consumer, self.route_shape = client, keys, consumer, route_shape
        # group id -> already trained or in hand: its streams are not read (a stale answer only wastes a read)
        self.known = known
        self.depth = depth
        self._log = EpisodeLog(client, keys, consumer, archive=archive)
        self._out: list[Fetched] = []
        self._changed = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainer-read-ahead", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self, timeout: float) -> list[Fetched]:
        """Every entry read ahead so far, waiting up to ``timeout`` seconds for the first; [] when none came. A read
        that failed on the thread (Redis gone past its retries) raises here."""
        with self._changed:
            self._changed.wait_for(lambda: self._out or self._error is not None, timeout=timeout)
            if not self._out and self._error is not None:
                raise self._error
            out, self._out = self._out, []
            self._changed.notify_all()
        return out

    def close(self) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    # room for more: at most ``depth`` entries read and not taken
                    self._changed.wait_for(lambda: self._stop or len(self._out) < self.depth)
                    if self._stop:
                        return
                    room = self.depth - len(self._out)
                fetched = self._read_page(room)
                with self._changed:
                    self._out += fetched
                    self._changed.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self._changed:
                self._error = exc
                self._changed.notify_all()

    def _read_page(self, count: int) -> list[Fetched]:
        # blocks up to 200 ms: a stop is seen within that
        reply = self.client.xreadgroup(TRAINER_GROUP, self.consumer, {self.keys.samples: ">"}, count=count, block=200)
        fetched = [
            Fetched(entry_id.decode(), fields or {}) for _, entries in reply or [] for entry_id, fields in entries
        ]
        for item in fetched:
            try:
                item.decoded()
            except EventError:
                # the trainer's thread dead-letters it
                pass
        reading = [item for item in fetched if item.sample is not None and not self.known(item.sample.group_id)]
        folds = iter(fold_all(self._log, [eid for item in reading for eid in item.sample.episodes], self.route_shape))
        for item in reading:
            item.folds = [next(folds) for _ in item.sample.episodes]
        return fetched

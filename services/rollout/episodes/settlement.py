"""When a rollout worker's episode writes travel, and what their results do.

Two ways out of the episode log's buffers:
- ``flush``: now, on the worker's thread. Used where a write must be durable before what follows it: a tool call
  before its job exists, a response before it is scored, a group before it leaves on a repack, a pause.
- ``send_step``: after an engine step, on the step writer's thread (``step_writer.py``) while the next step runs. Inside
  ``one_flush``, an episode that ends is not written at once: its last events go with the step's batch.

What the results do: an episode whose end is in its stream is closed (``closed``, given by the caller: forget it,
publish its group when complete); a fenced append means another worker owns the group now (``fenced``, given by the
caller: drop the group); any other error is raised. The publishes of complete groups ride in the same pipelines.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from services.rollout.episodes.live import LiveEpisode, State
from services.rollout.episodes.step_writer import StepWriter
from services.rollout.groups.claims import Groups
from shared.protocol.episode.log import Batch, EpisodeLog, Fenced
from shared.runtime.faults import crash_point


class Writes:
    def __init__(
        self,
        events: EpisodeLog,
        groups: Groups,
        closed: Callable[[LiveEpisode, bool], None],
        fenced: Callable[[list[str]], None],
    ):
        self.events, self.groups = events, groups
        # closed(live, publish_later); fenced(episode ids)
        self._closed, self._fenced = closed, fenced
        # inside one_flush(): episodes ended in this step
        self._closing: list[LiveEpisode] | None = None
        # ended in a step; closed once their last events are in Redis
        self.ending: list[LiveEpisode] = []
        # the step's round trip, beside the next step
        self.writer = StepWriter(f"step-writer-{events.worker}")
        # what the worker's wake read sent with a batch returned (``send_step``)
        self.replies: list = []
        # episodes with events in the batch in flight
        self._sent: set[str] = set()

    def close(self, live: LiveEpisode) -> None:
        """The episode has its last event (buffered): closed once that is written, now or with the step's batch."""
        live.state = State.DONE
        if self._closing is not None:
            self._closing.append(live)
            return
        self.flush([live.episode_id])
        self._closed(live, False)

    @contextmanager
    def one_flush(self):
        """Inside, an ending episode's last events are not written at once: they go with the step's batch
        (``send_step``: one round trip per engine step, not one per finishing episode, beside the next step), and
        the episode is closed, its group published if complete, once that batch is settled."""
        self._closing = []
        try:
            yield
        finally:
            closing, self._closing = self._closing, None
            self.ending += closing
            for live in closing:
                if (run := self.groups.get(live.group_id)) is not None:
                    run.ended.add(live.episode_id)

    def send_step(self, wake_read: Callable | None = None) -> None:
        """After an engine step: this step's writes leave on the writer thread in one pipeline, while the caller
        runs the next step. They are the events of every episode that ended in the step, every buffered event
        when any is due by count or age, the publishes of groups completed by the batch settled last, and
        ``wake_read(pipe)``: the worker's non-blocking read of the streams that wake it, whose reply comes back
        in ``replies`` once settled."""
        self.settle()
        ending, self.ending = self.ending, []
        batch = self.events.take(None if self.events.due() else [live.episode_id for live in ending])
        publishing = self.groups.take_queued()
        if not batch and wake_read is None and not publishing:
            # nothing of theirs is buffered or in flight: their end is in Redis already
            for live in ending:
                self._closed(live, False)
            return

        def also(pipe):
            self.groups.add(pipe, publishing)
            if wake_read is not None:
                wake_read(pipe)

        self._sent = {episode_id for episode_id, _ in batch.targets}
        self.writer.submit(lambda: self.events.send(batch, also), (batch, ending, publishing))

    def settle(self, publish_later: bool = False) -> None:
        """Wait for the batch in flight, if any, and apply its results: a fenced episode drops its group (a step
        later than a synchronous flush would, and before anything of the group is published); an ending episode
        whose last events are now in Redis is closed and its group published when complete (with
        ``publish_later``, in the next step's pipeline)."""
        if not self.writer.in_flight:
            return
        (results, extra), (batch, ending, publishing) = self.writer.wait()
        written = self.events.entries_written
        errors = self.events.settle(batch, results)
        self.groups.settle(publishing, extra[: len(publishing)])
        for reply in extra[len(publishing) :]:
            if isinstance(reply, Exception):
                raise reply
            self.replies.append(reply)
        self._written(written, errors)
        for live in ending:
            self._closed(live, publish_later)

    def in_flight(self, episode_ids: list[str] | None) -> bool:
        """Whether the batch in flight holds events of these episodes (of any, for None)."""
        return self.writer.in_flight and (episode_ids is None or not self._sent.isdisjoint(episode_ids))

    def flush(self, episode_ids: list[str] | None = None, due_only: bool = False) -> None:
        """Write buffered events now (after the batch in flight when it holds any of these episodes); a fenced
        episode drops its group (other errors raise). An episode that ended in a step and is now all written is
        closed."""
        if due_only or self.in_flight(episode_ids):
            self.settle()
        written = self.events.entries_written
        errors = self.events.maybe_flush() if due_only else self.events.flush(episode_ids)
        self._written(written, errors)
        if self.ending:
            done = [live for live in self.ending if self.events.written(live.episode_id)]
            self.ending = [live for live in self.ending if live not in done]
            for live in done:
                self._closed(live, False)
        self.groups.publish_queued()

    def start_and_read(self, starting: list[str], reading: list[str]) -> tuple[list[list[tuple]], set[str]]:
        """One round trip: write the buffered events of new episodes (``starting``: their starts, each fenced at
        seq 0, so written only where the stream is empty), then read the streams of ``reading``. Returns (the
        streams read, the episodes whose start was refused). A refused start is not a lost episode: its stream
        held events already (a group held before), and the caller resumes it from what was read."""
        written = self.events.entries_written
        batch = self.events.take(starting) if starting else Batch()
        results, streams = self.events.send_and_read(batch, reading)
        errors = self.events.settle(batch, results)
        refused = {episode_id for episode_id, exc in errors.items() if isinstance(exc, Fenced)}
        self._written(written, {episode_id: exc for episode_id, exc in errors.items() if episode_id not in refused})
        return streams, refused

    def forget(self, group_id: str) -> None:
        """The group left this worker: none of its episodes is closed here any more."""
        self.ending = [live for live in self.ending if live.group_id != group_id]

    def stop(self) -> None:
        """Settle the batch in flight and stop the writer thread."""
        self.settle()
        self.writer.close()

    def _written(self, entries_before: int, errors: dict[str, Exception]) -> None:
        if self.events.entries_written > entries_before:
            # tests only (shared/runtime/faults.py)
            crash_point("rollout", "flushed")
        for exc in errors.values():
            if not isinstance(exc, Fenced):
                raise exc
        if errors:
            self._fenced(list(errors))

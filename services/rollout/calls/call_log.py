"""The episode log for agent calls: tokens tagged with their call, and fences
rebased instead of fatal.

Several writers share an agent episode's stream: the agent runner (started,
finished) and the workers serving its calls (calls may overlap and be served by
different workers). A fenced append is then usually another writer's event
for another call, not a lost episode: the writer re-reads the stream and, when
every call its pending events belong to is still its own (no other worker took
it over, it is not complete), appends them again after the new tail.
"""

from __future__ import annotations

from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog, Fenced

MAX_REBASES = 8


class CallLog(EpisodeLog):
    def flush(self, episode_ids: list[str] | None = None) -> dict[str, Exception]:
        held = {
            e: list(p.events)
            for e, p in self._pending.items()
            if p.events and (episode_ids is None or e in episode_ids)
        }
        errors = super().flush(episode_ids)
        for episode_id, exc in list(errors.items()):
            if isinstance(exc, Fenced) and self._rebase(episode_id, held.get(episode_id, [])):
                del errors[episode_id]
        return errors

    def _rebase(self, episode_id: str, events) -> bool:
        for _ in range(MAX_REBASES):
            ep = fold(self.read(episode_id))
            for ev in events:
                call = ep.calls.get(ev.data.get("call", -1))
                if ev.kind == "call":
                    if call is not None:
                        # another worker opened this call
                        return False
                elif call is None or call.done or call.worker != self.worker or ep.done:
                    # taken over, complete, or the episode ended
                    return False
            self.open(episode_id, ep.last_seq + 1)
            for ev in events:
                self.append(episode_id, ev.kind, ev.data, ev.policy)
            errors = super().flush([episode_id])
            if not errors:
                return True
            if not isinstance(errors[episode_id], Fenced):
                raise errors[episode_id]
        return False

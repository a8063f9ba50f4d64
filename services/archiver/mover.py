"""The move, in an order that a kill -9 anywhere leaves safe to repeat (crash points ``archiver:POINT``):

    read the episodes' streams (each must have ended: its last event is its end)
    write the segment: tmp file, fsync, rename, fsync folder            -> ``written``  (an orphan: not listed)
    append its line to the manifest, fsync                              -> ``listed``   (in both tiers)
    delete the streams (and their call indexes), half of them, then     -> ``deleting``
    the rest                                                            -> ``deleted``

``recover`` (at start) cuts a torn manifest line, deletes orphan segment files and deletes from Redis every
stream a listed segment holds: after it, each episode is in exactly one tier. Readers meanwhile prefer Redis and
skip an archived copy of an episode still there, so none is counted twice even mid-move. A stream is deleted
only if it still holds exactly the entries archived (a script compares XLEN): nothing written is ever lost.
"""

from __future__ import annotations

import gc
from pathlib import Path

import redis
import redis.cluster

from services.archiver.select import due_groups, due_val_groups, newest_commit, still_needed
from shared.protocol.archive import builder as segment_builder
from shared.protocol.archive import segments
from shared.protocol.archive.ledger import LedgerTail
from shared.protocol.keys import Keys
from shared.protocol.streams import samples as samples_stream
from shared.protocol.streams import stream_head
from shared.runtime.faults import crash_point

_DELETE_IF_LEN = """
if redis.call('XLEN', KEYS[1]) == tonumber(ARGV[1]) then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
_DELETE_MANY_IF_LEN = """
local deleted = 0
for i, key in ipairs(KEYS) do
  if redis.call('XLEN', key) == tonumber(ARGV[i]) then
    redis.call('DEL', key)
    deleted = deleted + 1
  end
end
return deleted
"""
_XRANGE_MANY = """
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = redis.call('XRANGE', key, '-', '+')
end
return out
"""
# episodes per segment at most: one segment per step on a default run (a footer, ~2.5 KB, each)
BATCH = 10_000
# streams per script call and per DEL (one server; on a cluster each key is its own call)
DELETE_CHUNK = 500
# streams per XRANGE script call (one server): a few ms of the server's time per call
READ_CHUNK = 500


class Mover:
    def __init__(
        self,
        client,
        keys: Keys,
        run_path: Path | str,
        retention: int,
        batch: int = BATCH,
        log=None,
        seed_base: int | None = None,
    ):
        self.client, self.keys, self.retention, self.batch, self.log = client, keys, retention, batch, log
        # the run's seed: episodes' default seeds are stored as this one number
        self.seed_base = seed_base
        self.run_path = Path(run_path)
        self.folder = segments.folder_of(run_path)
        self.store = segments.SegmentStore(self.folder)
        self._delete = client.register_script(_DELETE_IF_LEN)
        one_server = not isinstance(client, redis.cluster.RedisCluster)
        self._delete_many = client.register_script(_DELETE_MANY_IF_LEN) if one_server else None
        self._xrange_many = client.register_script(_XRANGE_MANY) if one_server else None
        self._ledger = LedgerTail(self.run_path / "trainer")
        self._cursor, self._val_cursor = "0-0", "0-0"
        # training groups (samples), then validation rounds' (samples:val)
        self._episodes_of: dict[str, list[str]] = {}
        self._val_episodes_of: dict[str, list[str]] = {}
        self.moved = 0

    def recover(self) -> int:
        """Finish or undo a move a crash cut short; returns the streams deleted (already in a listed segment). Only
        the newest listed segment can have streams left: a move lists its segment and deletes its streams before the
        next one starts."""
        segments.repair_manifest(self.folder)
        gone = segments.remove_orphans(self.folder)
        if gone and self.log:
            self.log.info("orphan segments removed", files=gone)
        newest = self.store.segments()[-1:]
        archived = list(self.store.ids(since=len(self.store.segments()) - 1)) if newest else []
        deleted = 0
        for start in range(0, len(archived), self.batch):
            chunk = archived[start : start + self.batch]
            pipe = self.client.pipeline(transaction=False)
            for eid in chunk:
                pipe.exists(self.keys.episode(eid))
            still = [eid for eid, n in zip(chunk, pipe.execute()) if n]
            if still:
                cold = self.store.read_many(still)
                deleted += self._drop({eid: cold[eid] for eid in still})
        return deleted

    def _follow(self, stream: str, cursor: str, into: dict[str, list[str]], head=None) -> str:
        """Read ``stream``'s published groups after ``cursor`` into ``into`` (group id -> episode ids); the new
        cursor."""
        while True:
            good, _, after = samples_stream.read_after(self.client, stream, cursor, count=1000, head=head)
            for s in good:
                into[s.group_id] = s.episodes
            if after == cursor:
                return cursor
            cursor = after

    def step(self) -> int:
        """Move every episode due now, a segment per ``batch`` episodes; returns the episodes moved. Python's cycle
        collector waits meanwhile: a step makes ~100 objects per episode and no cycles, and the collections they
        would set off walk every object the process holds (~20 % of the step's CPU, bench/log/archiver_cpu.py)."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self._step()
        finally:
            if was:
                gc.enable()

    def _step(self) -> int:
        self._cursor = self._follow(
            self.keys.samples, self._cursor, self._episodes_of, head=stream_head.path_of(self.run_path, "samples")
        )
        self._val_cursor = self._follow(
            self.keys.val_samples,
            self._val_cursor,
            self._val_episodes_of,
            head=stream_head.path_of(self.run_path, stream_head.NAMES["samples:val"]),
        )
        ledger = self._ledger.read()
        due = [(self._episodes_of, g) for g in due_groups(ledger, self._episodes_of, self.retention)]
        due += [
            (self._val_episodes_of, g)
            for g in due_val_groups(self._val_episodes_of, newest_commit(ledger), self.retention)
        ]
        ids = [e for groups, g in due for e in groups[g]]
        movable = [e for e, held in zip(ids, self.store.may_hold(ids)) if not held]
        moved = 0
        for start in range(0, len(movable), self.batch):
            moved += self._move(movable[start : start + self.batch])
        self.moved += moved
        held = iter(self.store.may_hold(ids))
        # a group moved whole is never looked at again (a run's groups grow without end)
        for groups, g in due:
            if all([next(held) for _ in groups[g]]):
                del groups[g]
        # nor are its done lines
        self._ledger.keep(still_needed(ledger, self._episodes_of, self.retention))
        return moved

    def _move(self, episode_ids: list[str]) -> int:
        streams = self._read(episode_ids)
        builder = segment_builder.Builder(self.seed_base)
        for eid, entries in streams.items():
            # a published group's episodes have ended; never move one that could grow
            if segments.ended(entries):
                builder.add(eid, entries)
        if not builder:
            return 0
        name = segments.next_name(self.folder)
        size = segments.write_file(self.folder, name, builder.table())
        crash_point("archiver", "written")
        moved, tokens = builder.episode_ids, builder.tokens
        segments.append_manifest(
            self.folder, {"segment": name, "episodes": len(moved), "bytes": size, "tokens": tokens}
        )
        crash_point("archiver", "listed")
        self.store.add(name, moved)
        self._drop({eid: streams[eid] for eid in moved})
        if self.log:
            self.log.info("episodes moved to a segment", segment=name, episodes=len(moved), bytes=size, tokens=tokens)
        return len(moved)

    def _read(self, episode_ids: list[str], again: bool = True) -> dict[str, list[tuple[bytes, list[bytes]]]]:
        """{episode id: its stream's entries, flat} of those that exist: one pipeline, the XRANGE replies as the
        server sends them (redis-py's dict per entry costs more than the rest of the row); on one server a script
        call per ``READ_CHUNK`` streams (a command per stream costs redis-py more than its reply)."""
        pipe = self.client.pipeline(transaction=False)
        if self._xrange_many is not None:
            for at in range(0, len(episode_ids), READ_CHUNK):
                self._xrange_many(
                    keys=[self.keys.episode(eid) for eid in episode_ids[at : at + READ_CHUNK]], client=pipe
                )
            try:
                replies = [entries for chunk in pipe.execute() for entries in chunk]
            except redis.exceptions.NoScriptError:
                # Redis restarted under the pipeline: the client's retry sent the script's EVALSHA again to a server
                # that has not loaded it. A new pipeline loads it first; a second refusal is a real error
                if not again:
                    raise
                return self._read(episode_ids, again=False)
            return {eid: entries for eid, entries in zip(episode_ids, replies) if entries}
        # a cluster's pipeline keeps its own replies' shape
        if isinstance(pipe, redis.client.Pipeline):
            pipe.response_callbacks = redis.client.CaseInsensitiveDict(
                {k: v for k, v in pipe.response_callbacks.items() if k.upper() != "XRANGE"}
            )
        for eid in episode_ids:
            pipe.xrange(self.keys.episode(eid))
        out = {}
        for eid, entries in zip(episode_ids, pipe.execute()):
            if entries:
                out[eid] = entries if isinstance(entries[0][1], list) else segments.flat(entries)
        return out

    def _drop(self, archived: dict[str, list]) -> int:
        """Delete the streams (those still holding exactly the archived entries) and their call indexes: on one
        server a script call and a DEL per ``DELETE_CHUNK`` streams, on a cluster one of each per stream."""
        items = list(archived.items())
        half = len(items) // 2
        deleted = 0
        for part, point in ((items[:half], "deleting"), (items[half:], "deleted")):
            pipe = self.client.pipeline(transaction=False)
            if self._delete_many is not None:
                scripts = -(-len(part) // DELETE_CHUNK)
                for at in range(0, len(part), DELETE_CHUNK):
                    chunk = part[at : at + DELETE_CHUNK]
                    self._delete_many(
                        keys=[self.keys.episode(eid) for eid, _ in chunk],
                        args=[len(entries) for _, entries in chunk],
                        client=pipe,
                    )
            else:
                scripts = len(part)
                for eid, entries in part:
                    self._delete(keys=[self.keys.episode(eid)], args=[len(entries)], client=pipe)
            indexes = [self.keys.call_index(eid) for eid, _ in part]
            for at in range(0, len(indexes), DELETE_CHUNK if self._delete_many is not None else 1):
                pipe.delete(*indexes[at : at + (DELETE_CHUNK if self._delete_many is not None else 1)])
            results = pipe.execute()
            deleted += sum(results[:scripts])
            crash_point("archiver", point)
        return deleted

"""The episodes page's index: one ``Summary`` per episode (services/ops/inspect/episodes.py), built once and kept.

The first build reads every episode of the run through ``read_summaries`` (the one reader of all the run's
episodes); after that a refresh summarizes only the episodes it has not seen end: a SCAN of the episode keys
names the new ones, and ``EpisodeLog.read_many`` reads them with those still running. An ended episode's summary
never changes (its stream is append-only and ends with its last event), so it is kept: in memory, and in
``<run folder>/ui/episodes.msgpack`` (tagged with the run's id) so that the next `streamrl ui` on the run starts
from it. A query (``query``) filters and sorts the kept rows in memory: no stream is read per request.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path

import msgpack

from services.ops.inspect.episodes import Filters, Summary, ordered, read_summaries, summarize
from shared.protocol.episode.log import EpisodeLog

# outcomes whose summary cannot change any more
ENDED = ("finished", "failed", "truncated")
# under the run's folder
CACHE = Path("ui") / "episodes.msgpack"
CACHE_FORMAT = 1
_FIELDS = [f.name for f in fields(Summary)]


def encode_rows(run_id: str, rows: list[Summary]) -> bytes:
    return msgpack.packb(
        {"format": CACHE_FORMAT, "run_id": run_id, "rows": [[getattr(s, f) for f in _FIELDS] for s in rows]}
    )


def decode_rows(run_id: str, blob: bytes) -> list[Summary]:
    """The cached rows of run ``run_id``; [] for a cache of another run (same name, made again) or format."""
    try:
        data = msgpack.unpackb(blob)
    # a torn write: built again
    except (ValueError, msgpack.ExtraData) as exc:
        del exc
        return []
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("run_id") != run_id:
        return []
    return [Summary(**dict(zip(_FIELDS, row))) for row in data["rows"]]


class EpisodeIndex:
    """``refresh()`` brings the rows up to date (call it from one thread at a time); ``query`` reads them."""

    def __init__(self, client, keys, run_path: Path | None, run_id: str = "", batch: int = 500, archive=None):
        # archive: SegmentStore
        self.client, self.keys, self.batch, self.archive = client, keys, batch, archive
        self.cache = Path(run_path) / CACHE if run_path is not None else None
        self.run_id = run_id
        self.rows: dict[str, Summary] = {}
        # the rows as one list, replaced whole after each refresh (readers' view)
        self.table: list[Summary] = []
        self.built = False
        # ended rows in the cache file
        self.saved = 0
        self.last_refresh_s = 0.0
        # episodes read so far by the first build
        self.progress = 0
        # listed segments when the last refresh looked
        self._segments_seen = 0
        self._lock = threading.Lock()

    def load(self) -> int:
        """The cached rows, if any: how many."""
        if self.cache is None or not self.cache.exists():
            return 0
        rows = decode_rows(self.run_id, self.cache.read_bytes())
        self.rows = {s.episode_id: s for s in rows}
        self.table, self.built = list(self.rows.values()), bool(rows)
        self.saved = sum(1 for s in rows if s.outcome in ENDED)
        return len(rows)

    def refresh(self) -> int:
        """Summarize the episodes not known to have ended; returns how many were (re)read."""
        t0 = time.monotonic()
        if not self.built:
            fresh = []
            # what a first build reads; later refreshes look only past it
            if self.archive is not None:
                self._segments_seen = len(self.archive.segments())
            for s in read_summaries(self.client, self.keys, self.batch, archive=self.archive):
                fresh.append(s)
                self.progress = len(fresh)
        else:
            open_ids = {eid for eid, s in self.rows.items() if s.outcome not in ENDED}
            for key in self.client.scan_iter(match=self.keys.episode("*"), count=1000, _type="stream"):
                eid = self.keys.episode_id(key)
                if eid not in self.rows:
                    open_ids.add(eid)
            fresh = self._summarize(sorted(open_ids | self._archived_unseen()))
        with self._lock:
            for s in fresh:
                self.rows[s.episode_id] = s
            self.table, self.built = list(self.rows.values()), True
        self.last_refresh_s = time.monotonic() - t0
        self._save()
        return len(fresh)

    def _archived_unseen(self) -> set[str]:
        """Episodes the archiver moved that no refresh saw in Redis (one that started, ended and moved between two
        refreshes): of those listed since the last look only."""
        if self.archive is None:
            return set()
        seen, self._segments_seen = self._segments_seen, len(self.archive.segments())
        return {eid for eid in self.archive.ids(since=seen) if eid not in self.rows}

    def _summarize(self, ids: list[str]) -> list[Summary]:
        log, out = EpisodeLog(self.client, self.keys, worker="ui", archive=self.archive), []
        for i in range(0, len(ids), self.batch):
            chunk = ids[i : i + self.batch]
            out += [summarize(eid, entries) for eid, entries in zip(chunk, log.read_many(chunk)) if entries]
        return out

    def _save(self) -> None:
        ended = [s for s in self.table if s.outcome in ENDED]
        if self.cache is None or len(ended) == self.saved:
            return
        try:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(encode_rows(self.run_id, ended))
            os.replace(tmp, self.cache)
            self.saved = len(ended)
        # a read-only run folder: the index stays in memory
        except OSError:
            pass

    def query(
        self, filters: Filters, sort: str = "id", descending: bool = False, offset: int = 0, limit: int = 50
    ) -> tuple[int, list[Summary]]:
        """(how many rows match, the page of them from ``offset``)."""
        rows = [s for s in self.table if filters.keep(s)]
        return len(rows), ordered(rows, sort, descending)[offset : offset + limit]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.table:
            out[s.outcome] = out.get(s.outcome, 0) + 1
        return out

    def policy_tokens(self) -> int:
        return sum(s.length for s in self.table)


def row_json(s: Summary) -> dict:
    return {**asdict(s), "span": s.span}

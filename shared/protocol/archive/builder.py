"""A segment's table, built column by column as its episodes are added: ``Builder.add`` packs an episode's entries
straight into the columns (shared/protocol/archive/entries.py ``Columns``) and its analysis columns
(shared/protocol/archive/summary.py), ``Builder.table`` makes each column one Arrow array off those flat lists
(shared/protocol/archive/arrays.py: numpy buffers, no pandas). No row is ever a dict: on the default run's
episodes (3 entries, ~2 tokens each) building and transposing rows cost more than packing them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from shared.protocol.archive import arrays as segment_arrays
from shared.protocol.archive import entries as segment_entries
from shared.protocol.archive import summary as segment_summary
from shared.protocol.archive.segments import SCHEMA, flat

TYPES = {f.name: f.type for f in SCHEMA}


class Builder:
    """``add`` episodes, then ``table``. ``seed_base``: the run's ``seed`` (episodes' seeds made by the rollout's
    rule then cost nothing)."""

    def __init__(self, seed_base: int | None = None):
        self.columns = segment_entries.Columns(seed_base)
        self.episode_ids: list[str] = []
        self.analysis: tuple[list, ...] = tuple([] for _ in segment_summary.NAMES)

    def __len__(self) -> int:
        return len(self.episode_ids)

    def add(self, episode_id: str, entries: list[tuple]) -> None:
        """Add an episode: its XRANGE entries, flat ``(id, [name, value, ...])`` as the archiver reads them or as
        redis-py gives them."""
        if entries and not isinstance(entries[0][1], list):
            entries = flat(entries)
        values = segment_summary.summary(self.columns.add(episode_id, entries), entries)
        self.episode_ids.append(episode_id)
        for column, value in zip(self.analysis, values):
            column.append(value)

    @property
    def tokens(self) -> int:
        """Policy tokens of the episodes added (their ``num_generated``)."""
        return sum(self.analysis[segment_summary.NAMES.index("num_generated")])

    def table(self) -> pa.Table:
        c = self.columns
        cols = {"episode_id": segment_arrays.array(self.episode_ids, pa.string())}
        cols.update(
            {
                name: segment_arrays.array(values, TYPES[name])
                for name, values in zip(segment_summary.NAMES, self.analysis)
            }
        )
        cols.update({name: segment_arrays.array(values, TYPES[name]) for name, values in c.row.items()})
        per_entry = _offsets(c.entries)
        for name, values in zip(segment_entries.LISTS, c.lists):
            cols[name] = pa.ListArray.from_arrays(per_entry, segment_arrays.array(values, TYPES[name].value_type))
        cols["others"] = pa.ListArray.from_arrays(
            _offsets(c.others_n), segment_arrays.array(c.others, TYPES["others"].value_type)
        )
        cols["tok_counts"] = pa.ListArray.from_arrays(_offsets(c.tok_n), segment_arrays.array(c.tok_counts, pa.int32()))
        per_token = _offsets(c.tokens)
        ids = np.frombuffer(b"".join(c.ids), "<u4")
        lps = np.frombuffer(b"".join(c.lps), "<f4")
        cols["tok_ids"] = pa.ListArray.from_arrays(per_token, segment_arrays.from_numpy(ids, pa.uint32()))
        # null: exactly +0.0
        cols["tok_logprobs"] = pa.ListArray.from_arrays(
            per_token, segment_arrays.from_numpy(lps, pa.float32(), lps.view("<u4") != 0)
        )
        return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)


def _offsets(lengths: list[int]) -> pa.Array:
    return segment_arrays.from_numpy(segment_arrays.offsets(np.asarray(lengths, np.int64)), pa.int32())


def table_of(episodes, seed_base: int | None = None) -> pa.Table:
    """The segment table of ``(episode id, entries)`` pairs."""
    builder = Builder(seed_base)
    for episode_id, entries in episodes:
        builder.add(episode_id, entries)
    return builder.table()

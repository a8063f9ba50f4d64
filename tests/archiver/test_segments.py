"""Segments hold episodes byte-identical to their Redis streams; the readers read both tiers as one log."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from services.ops.inspect.episodes import read_summaries
from shared.protocol.archive import builder as segment_builder
from shared.protocol.archive import index as segment_index
from shared.protocol.archive import segments
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from tests.archiver.tiers_support import all_streams, make_run, one_segment


def test_a_segment_gives_back_the_stream_byte_for_byte(client, keys, tmp_path):
    eids, hot, folder = one_segment(client, keys, tmp_path, versions=3)
    store = segments.SegmentStore(folder)
    cold = store.read_many(eids)
    assert cold == hot
    assert all(fold(cold[e]) == fold(hot[e]) for e in eids)
    # loads as it is: analysis columns beside the raw log
    table = pq.read_table(folder / "seg-00000001.parquet")
    assert sorted(table.column("episode_id").to_pylist()) == sorted(eids)
    assert table.column("num_generated").to_pylist() == [40] * len(eids)
    assert set(table.column("reward").to_pylist()) == {0.0, 1.0}
    # the folder is one dataset: the manifest ("_") is skipped
    assert pq.read_table(folder).num_rows == len(eids)


def test_an_unlisted_segment_is_not_read_and_is_removed_as_an_orphan(client, keys, tmp_path):
    groups = make_run(client, keys, tmp_path, versions=1)
    eid = groups["g1"][0]
    folder = tmp_path / "episodes"
    segments.write_file(
        folder, "seg-00000001.parquet", segment_builder.table_of([(eid, client.xrange(keys.episode(eid)))])
    )
    # renamed into place but not listed: not there yet
    assert segments.SegmentStore(folder).read(eid) == []
    assert segments.remove_orphans(folder) == ["seg-00000001.parquet"]
    assert segments.next_name(folder) == "seg-00000001.parquet"


def test_readers_fall_back_to_the_segments(client, keys, tmp_path):
    groups = make_run(client, keys, tmp_path, versions=2)
    eids = [e for es in groups.values() for e in es]
    hot = all_streams(client, keys, eids)
    folder = tmp_path / "episodes"
    moved = groups["g1"]
    segments.write_file(folder, "seg-00000001.parquet", segment_builder.table_of((e, hot[e]) for e in moved))
    segments.append_manifest(folder, {"segment": "seg-00000001.parquet", "episodes": len(moved)})
    client.delete(*[keys.episode(e) for e in moved])
    log = EpisodeLog(client, keys, "reader", archive=segments.SegmentStore(folder))
    assert log.read(moved[0]) == hot[moved[0]]
    assert log.read_many(eids) == [hot[e] for e in eids]
    # without the archive: gone (the change matters)
    assert EpisodeLog(client, keys, "reader").read(moved[0]) == []
    rows = list(read_summaries(client, keys, archive=segments.SegmentStore(folder)))
    assert sorted(r.episode_id for r in rows) == sorted(eids)
    # an episode in both tiers (a crash between the manifest line and the delete) is summarised once
    client.xadd(keys.episode(moved[0]), hot[moved[0]][0][1], id=hot[moved[0]][0][0])
    rows = list(read_summaries(client, keys, archive=segments.SegmentStore(folder)))
    assert sorted(r.episode_id for r in rows) == sorted(eids)


def _list(folder, name: str, episodes: dict) -> None:
    segments.write_file(folder, name, segment_builder.table_of(episodes.items()))
    segments.append_manifest(folder, {"segment": name, "episodes": len(episodes)})


def test_the_index_holds_a_hash_per_episode_and_reads_right_when_hashes_collide(client, keys, tmp_path, monkeypatch):
    groups = make_run(client, keys, tmp_path, versions=4)
    hot = all_streams(client, keys, [e for es in groups.values() for e in es])
    folder = tmp_path / "episodes"
    first = {e: hot[e] for e in groups["g1"] + groups["g2"]}
    # g2 again: the first listed is the one read
    second = {e: hot[e] for e in groups["g2"] + groups["g3"]}
    # a different copy, to tell which segment was read
    second["g2-0"] = hot["g2-0"][:1]
    _list(folder, "seg-00000001.parquet", first)
    _list(folder, "seg-00000002.parquet", second)
    store = segments.SegmentStore(folder)
    everything = [e for es in groups.values() for e in es]
    assert store.may_hold(everything) == [not e.startswith("g4") for e in everything]
    assert store.read_many(everything) == {e: hot[e] for e in everything if not e.startswith("g4")}
    # g2's episodes once, first copy
    assert [e for e, _ in store.iter_all()] == list(first) + list(groups["g3"])
    # not ids
    assert store._index.keys.nbytes + store._index.where.nbytes == 12 * (len(first) + len(second))

    monkeypatch.setattr(segment_index, "hashes", lambda ids: np.array([len(e) % 2 for e in ids], np.int64))
    # every id now shares its hash with half the others, across segments
    store = segments.SegmentStore(folder)
    assert store.read_many(everything) == {e: hot[e] for e in everything if not e.startswith("g4")}
    assert dict(store.iter_all()) == {e: hot[e] for e in [*first, *groups["g3"]]}
    assert store.read("g4-0") == []

"""Format 2 segments store token payloads columnar, losslessly; format 1 segments (raw entries only) still read."""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shared.protocol import segment_columns, segments
from tests.archiver.tiers_support import all_streams, make_run, one_segment

FORMAT_1 = pa.schema([f for f in segments.SCHEMA if f.name not in segments.TOKEN_COLUMNS])


def _tokens(ids, lps, **extra) -> list[bytes]:
    data = msgpack.packb({"ids": np.asarray(ids, "<u4").tobytes(), "logprobs": np.asarray(lps, "<f4").tobytes(),
                          **extra}, use_bin_type=True)
    return [b"type", b"tokens", b"v", b"2", b"policy", b"3", b"worker", b"w", b"seq", b"1", b"data", data]


def test_token_columns_keep_every_bit_and_leave_odd_entries_whole():
    odd_bits = np.array([0x7FC00001, 0x80000000, 0x00000001, 0xFF800000], "<u4").view("<f4")  # NaN payload, -0.0
    flat = [[b"type", b"started", b"data", b"\x80"],
            _tokens([1, 70000, 3, 4], odd_bits),
            _tokens([5], [-0.25], call=2),  # a field besides ids/logprobs: kept whole
            [b"type", b"tokens", b"data", b"\xc1"],  # not msgpack: kept whole
            _tokens([], [])]
    entries, counts, ids, lps = segment_columns.pack(flat)
    assert counts == [-1, 4, -1, -1, 0]
    assert entries[1] == flat[1][:-2]  # the payload left the entry for the columns
    assert segment_columns.unpack(entries, counts, ids, lps) == flat
    assert ids[:4] == bytes([1, 0x70, 3, 4])  # byte planes: the low bytes of the ids first


def test_a_format_1_segment_still_reads(client, keys, tmp_path):
    groups = make_run(client, keys, tmp_path, versions=2)
    eids = [e for es in groups.values() for e in es]
    hot = all_streams(client, keys, eids)
    folder = tmp_path / "episodes"
    folder.mkdir()
    old_rows = [{**{k: v for k, v in segments.to_row(e, hot[e]).items() if k not in segments.TOKEN_COLUMNS},
                 "entries": [[x for kv in f.items() for x in kv] for _, f in hot[e]]} for e in eids]
    pq.write_table(pa.Table.from_pylist(old_rows, schema=FORMAT_1), folder / "seg-00000001.parquet")
    segments.append_manifest(folder, {"segment": "seg-00000001.parquet", "episodes": len(eids)})
    assert segments.file_format(folder / "seg-00000001.parquet") == 1
    store = segments.SegmentStore(folder)
    assert store.read_many(eids) == hot
    assert dict(store.iter_all()) == hot


def test_format_2_moves_the_token_payloads_out_of_the_entries(client, keys, tmp_path):
    eids, hot, folder = one_segment(client, keys, tmp_path, versions=2)
    table = pq.read_table(folder / "seg-00000001.parquet")
    assert segments.file_format(folder / "seg-00000001.parquet") == segments.FORMAT == 2
    assert all(n >= 0 for counts in table.column("tok_counts").to_pylist() for n in counts if n != -1)
    assert sum(n for counts in table.column("tok_counts").to_pylist() for n in counts if n > 0) == 40 * len(eids)
    assert segments.SegmentStore(folder).read_many(eids) == hot

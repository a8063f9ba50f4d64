"""Format 4 segments store entries as columns (what a group shares once), losslessly; segments of formats 1 (raw
entries only), 2 (token columns) and 3 (format 4 with the started and end payloads inside ``payloads``) still
read."""

from __future__ import annotations

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shared.protocol.archive import (
    builder as segment_builder,
)
from shared.protocol.archive import (
    columns as segment_columns,
)
from shared.protocol.archive import (
    entries as segment_entries,
)
from shared.protocol.archive import (
    segments,
)
from shared.protocol.episode.sampling import episode_seed
from tests.archiver.tiers_support import all_streams, make_run, one_segment, row_of

FORMAT_1 = pa.schema(
    segments.ANALYSIS + [("entry_ids", pa.list_(pa.binary())), ("entries", pa.list_(pa.list_(pa.binary())))]
)
FORMAT_2 = pa.schema(
    list(FORMAT_1) + [("tok_counts", pa.list_(pa.int32())), ("tok_ids", pa.binary()), ("tok_logprobs", pa.binary())],
    metadata={b"streamrl.segment_format": b"2"},
)


def _old_rows(hot: dict, fmt: int) -> list[dict]:
    """Rows as formats 1 and 2 wrote them (their writers' code, kept here)."""
    rows = []
    for eid, entries in hot.items():
        flat = [[x for kv in f.items() for x in kv] for _, f in entries]
        row = {
            "episode_id": eid,
            "group_id": eid.split("-")[0],
            "worker": "w1",
            "status": "finished",
            "finish_reason": "stop",
            "reward": 1.0,
            "num_generated": 40,
            "version": 1,
            "entry_ids": [i for i, _ in entries],
            "entries": flat,
        }
        if fmt == 2:
            row["entries"], row["tok_counts"], row["tok_ids"], row["tok_logprobs"] = segment_columns.pack(flat)
        rows.append(row)
    return rows


def _tokens(ids, lps, **extra) -> list[bytes]:
    data = msgpack.packb(
        {"ids": np.asarray(ids, "<u4").tobytes(), "logprobs": np.asarray(lps, "<f4").tobytes(), **extra},
        use_bin_type=True,
    )
    return [b"type", b"tokens", b"v", b"2", b"policy", b"3", b"worker", b"w", b"seq", b"1", b"data", data]


def test_token_columns_keep_every_bit_and_leave_odd_entries_whole():
    # NaN payload, -0.0
    odd_bits = np.array([0x7FC00001, 0x80000000, 0x00000001, 0xFF800000], "<u4").view("<f4")
    flat = [
        [b"type", b"started", b"data", b"\x80"],
        _tokens([1, 70000, 3, 4], odd_bits),
        # a field besides ids/logprobs: kept whole
        _tokens([5], [-0.25], call=2),
        # not msgpack: kept whole
        [b"type", b"tokens", b"data", b"\xc1"],
        _tokens([], []),
    ]
    entries, counts, ids, lps = segment_columns.pack(flat)
    assert counts == [-1, 4, -1, -1, 0]
    # the payload left the entry for the columns
    assert entries[1] == flat[1][:-2]
    assert segment_columns.unpack(entries, counts, ids, lps) == flat
    # byte planes: the low bytes of the ids first
    assert ids[:4] == bytes([1, 0x70, 3, 4])


def test_format_1_and_2_segments_still_read(client, keys, tmp_path):
    groups = make_run(client, keys, tmp_path, versions=2)
    hot = all_streams(client, keys, [e for es in groups.values() for e in es])
    folder = tmp_path / "episodes"
    folder.mkdir()
    for fmt, schema in ((1, FORMAT_1), (2, FORMAT_2)):
        name = f"seg-0000000{fmt}.parquet"
        pq.write_table(pa.Table.from_pylist(_old_rows(hot, fmt), schema=schema), folder / name)
        assert segments.file_format(folder / name) == fmt
        segments.append_manifest(folder, {"segment": name, "episodes": len(hot)})
    store = segments.SegmentStore(folder)
    assert store.read_many(list(hot)) == hot
    assert dict(store.iter_all()) == hot


FORMAT_3 = pa.schema(
    [f for f in segments.SCHEMA if f.name not in ("start", "end")], metadata={b"streamrl.segment_format": b"3"}
)


def _as_format_3(row: dict) -> dict:
    """A format 4 row as format 3 wrote it: the templated started payload and the end's inside ``payloads``, token
    columns as lists (a log-prob of +0.0 a null)."""
    row = dict(row)
    payloads = row["payloads"] = list(row["payloads"])
    start, end = row.pop("start"), row.pop("end")
    if start is not None:
        payloads[row["kinds"].index(b"started")] = start
    if end is not None:
        payloads[-1] = end
    row["tok_ids"] = np.frombuffer(row["tok_ids"], "<u4").tolist()
    row["tok_logprobs"] = [x or None for x in np.frombuffer(row["tok_logprobs"], "<f4").tolist()]
    return row


def test_format_3_segments_still_read(client, keys, tmp_path):
    groups = make_run(client, keys, tmp_path, versions=2)
    hot = all_streams(client, keys, [e for es in groups.values() for e in es])
    folder = tmp_path / "episodes"
    folder.mkdir()
    rows = [_as_format_3(row_of(eid, entries)) for eid, entries in hot.items()]
    # the case format 4 changed: payloads inside the list
    assert any(r["payloads"][0] for r in rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=FORMAT_3), folder / "seg-00000001.parquet")
    assert segments.file_format(folder / "seg-00000001.parquet") == 3
    segments.append_manifest(folder, {"segment": "seg-00000001.parquet", "episodes": len(rows)})
    store = segments.SegmentStore(folder)
    assert store.read_many(list(hot)) == hot
    assert dict(store.iter_all()) == hot


def test_format_4_stores_a_groups_prompt_once_and_gives_every_entry_back(client, keys, tmp_path):
    eids, hot, folder = one_segment(client, keys, tmp_path, versions=2)
    path = folder / "seg-00000001.parquet"
    assert segments.file_format(path) == segments.FORMAT == 4
    table = pq.read_table(path)
    assert sum(n for counts in table.column("tok_counts").to_pylist() for n in counts) == 40 * len(eids)
    # each in its own column
    assert all(p is None for ps in table.column("payloads").to_pylist() for p in ps)
    started = set(table.column("start").to_pylist())
    # one per group: own fields are columns
    assert len(started) == 2 and all(b"prompt_ids" in p for p in started)
    assert all(b"reward" in p for p in table.column("end").to_pylist())
    assert table.column("index").to_pylist() == [0, 1, 0, 1]
    # token ids load as lists (pandas, DuckDB)
    assert table.column("tok_ids").to_pylist()[0][:3] == [0, 7, 14]
    assert segments.SegmentStore(folder).read_many(eids) == hot


def _entry(kind: bytes, seq: int, data: bytes, **over) -> list[bytes]:
    fields = {b"type": kind, b"v": b"2", b"policy": b"3", b"worker": b"w", b"seq": str(seq).encode(), b"data": data}
    fields.update({k.encode(): v for k, v in over.items()})
    return [x for kv in fields.items() for x in kv]


def _started(eid: str, index: int, seed) -> bytes:
    return msgpack.packb(
        {
            "episode_id": eid,
            "group_id": "g",
            "index": index,
            "prompt_ids": b"\x05\x00\x00\x00",
            "sampling": {"max_tokens": 8, "seed": seed},
        },
        use_bin_type=True,
    )


def test_format_4_keeps_odd_entries_whole_and_every_bit():
    # NaN, -0.0, +0.0
    odd_bits = np.array([0x7FC00001, 0x80000000, 0x00000001, 0xFF800000, 0], "<u4").view("<f4")
    tokens = _tokens([1, 70000, 3, 4, 9], odd_bits)
    entries = [
        (b"5-0", _entry(b"started", 0, _started("g-1", 1, episode_seed(7, "g", 1)))),
        (b"5-1", tokens[:9] + [b"1"] + tokens[10:]),
        # not msgpack: kept as it is, in its place
        (b"9-0", _entry(b"tokens", 2, b"\xc1")),
        # seq not its position: the whole entry kept
        (b"9-1", _entry(b"note", 7, b"")),
        # a second started: its payload whole
        (b"10-0", _entry(b"started", 4, _started("g-1", 1, 12))),
        # a policy "03" does not round-trip
        (b"12-0", _entry(b"finished", 5, b"\x80", policy=b"03")),
    ]
    row = row_of("g-1", entries, seed_base=7)
    # the seed is the rule's: the base only
    assert (row["index"], row["seed"], row["seed_base"]) == (1, None, 7)
    assert [len(o) for o in row["others"]] == [13, 13] and row["tok_counts"] == [5]
    back = segment_entries.unpack("g-1", row, row["tok_ids"], row["tok_logprobs"])
    assert back == [(i, dict(zip(f[::2], f[1::2]))) for i, f in entries]
    # another run's seed: the seed itself
    row = row_of("g-1", entries[:1], seed_base=8)
    assert (row["seed"], row["seed_base"]) == (episode_seed(7, "g", 1), None)
    # not its own episode id: the payload whole
    row = row_of("g-2", entries[:1])
    assert row["index"] is None and row["payloads"][0] == entries[0][1][-1]


def test_format_4_token_columns_keep_every_bit_through_a_file(client, keys, tmp_path):
    odd_bits = np.array([0x7FC00001, 0x80000000, 0x00000001, 0xFF800000, 0], "<u4").view("<f4")
    entry = (b"5-1", _tokens([1, 70000, 3, 4, 9], odd_bits))
    table = segment_builder.table_of([("g-1", [(entry[0], dict(zip(entry[1][::2], entry[1][1::2])))])])
    segments.write_file(tmp_path, "seg-00000001.parquet", table)
    segments.append_manifest(tmp_path, {"segment": "seg-00000001.parquet", "episodes": 1})
    assert segments.SegmentStore(tmp_path).read("g-1") == [(entry[0], dict(zip(entry[1][::2], entry[1][1::2])))]


def test_token_payload_reads_exactly_what_packb_writes():
    rng = np.random.default_rng(0)
    # bin 8 / 16 / 32 headers on both sides of each boundary
    for n in (0, 1, 63, 64, 16383, 16384):
        ids, lps = rng.integers(0, 1 << 32, n, dtype="<u4").tobytes(), rng.random(n).astype("<f4").tobytes()
        data = msgpack.packb({"ids": ids, "logprobs": lps}, use_bin_type=True)
        assert segment_columns.token_payload(data) == (ids, lps)
        for odd in (
            data + b"\x00",
            data[:-1],
            msgpack.packb({"logprobs": lps, "ids": ids}, use_bin_type=True),
            msgpack.packb({"ids": ids, "logprobs": lps, "x": 1}, use_bin_type=True),
            msgpack.packb({"ids": ids, "logprobs": lps + bytes(4)}, use_bin_type=True),
        ):
            assert segment_columns.token_payload(odd) is None
    # a bin 16 for 4 bytes
    long_head = b"\x82\xa3ids\xc5\x00\x04" + bytes(4) + b"\xa8logprobs\xc4\x04" + bytes(4)
    assert msgpack.unpackb(long_head) == {"ids": bytes(4), "logprobs": bytes(4)}
    # packb would write it shorter: not byte-identical
    assert segment_columns.token_payload(long_head) is None
    assert segment_columns.token_payload(b"\x82\xa3ids\xc4") is None


def test_log_probs_go_plain_where_whole_values_repeat_and_keep_every_bit(tmp_path):
    rng = np.random.default_rng(1)
    assert segment_columns.planes_pay_off(rng.exponential(0.5, 4000).astype("<f4").tobytes())
    # a group's episodes drew the same tokens
    repeated = np.tile(rng.exponential(0.5, 50).astype("<f4"), 80)
    assert not segment_columns.planes_pay_off(repeated.tobytes())
    odd = np.array([0x7FC00001, 0x80000000, 0x00000001, 0xFF800000, 0], "<u4").view("<f4")
    lps = np.concatenate([repeated, odd])
    tokens = _tokens(np.arange(len(lps)) % 7, lps)
    # seq 0: its position, so its tokens go to the columns
    entry = (b"5-1", tokens[:9] + [b"0"] + tokens[10:])
    table = segment_builder.table_of([("g-1", [entry])])
    assert table.column("tok_counts").to_pylist() == [[len(lps)]]
    # plain for this one
    assert segments.encodings(table) != segments.ENCODINGS
    segments.write_file(tmp_path, "seg-00000001.parquet", table)
    segments.append_manifest(tmp_path, {"segment": "seg-00000001.parquet", "episodes": 1})
    assert segments.SegmentStore(tmp_path).read("g-1") == [(entry[0], dict(zip(entry[1][::2], entry[1][1::2])))]


def test_format_4_segments_load_as_a_dataset(client, keys, tmp_path):
    import datasets
    import pandas as pd

    eids, hot, folder = one_segment(client, keys, tmp_path, versions=3)
    # plain log-probs
    assert segments.encodings(pq.read_table(folder / "seg-00000001.parquet")) != segments.ENCODINGS
    # the manifest skipped by its "_"
    df = pd.read_parquet(folder)
    assert sorted(df.episode_id) == sorted(eids) and set(df.status) == {"finished"}
    assert df.tok_logprobs.iloc[0][:2].tolist() == np.float32([-0.25, -0.26]).tolist()
    assert df.groupby("version").reward.mean().to_dict() == {1: 1.0, 2: 0.0, 3: 1.0}
    ds = datasets.load_dataset(
        "parquet", data_files=str(folder / "seg-*.parquet"), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert ds.num_rows == len(eids) and ds[0]["tok_ids"][:3] == [0, 7, 14]

"""The head of prompts / samples leaves Redis once no consumer needs it, for a file the whole-run readers read first
the trim rule (pure), and on a real server what a trim keeps (every pending entry, the last delivered
one, the group's lag), what it moves (everything below, byte for byte), and a crash between the two."""

from __future__ import annotations

import time

from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP
from shared.protocol.streams import samples, stream_head
from shared.protocol.streams.stream_head import Trimmer, trim_point

NOW = 1_000_000_000


def test_the_trim_point_keeps_pending_the_last_delivered_and_the_recent():
    # nothing delivered: nothing to move
    assert trim_point("0-0", None, NOW) is None
    # the last delivered stays
    assert trim_point(f"{NOW - 90_000}-3", None, NOW, keep_s=60) == f"{NOW - 90_000}-3"
    # pending
    assert trim_point(f"{NOW - 90_000}-3", f"{NOW - 95_000}-0", NOW, keep_s=60) == f"{NOW - 95_000}-0"
    # the last minute stays
    assert trim_point(f"{NOW - 1_000}-0", None, NOW, keep_s=60) == f"{NOW - 60_000}-0"
    assert trim_point(f"{NOW - 90_000}-10", f"{NOW - 90_000}-9", NOW, keep_s=0) == f"{NOW - 90_000}-9"


def _past(entry_id) -> None:
    """Wait for the clock to pass ``entry_id``'s millisecond: a trim with keep_s 0 keeps what was written in the
    millisecond it runs (its window ends at now), which a fast box reaches before the test's trim."""
    ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    while int(time.time() * 1000) <= ms:
        time.sleep(0.001)


def _stream(client, keys, n: int) -> list[bytes]:
    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="$", mkstream=True)
    ids = [client.xadd(keys.prompts, {"group_id": f"g{i}", "data": bytes([0xC3, i, 0xFF])}) for i in range(n)]
    _past(ids[-1])
    return ids


def test_a_trim_moves_what_no_consumer_needs_and_keeps_the_rest(client, keys, tmp_path):
    ids = _stream(client, keys, 10)
    before = client.xrange(keys.prompts)
    # 0..5 delivered
    client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"}, count=6)
    # 4 still pending
    client.xack(keys.prompts, ROLLOUT_GROUP, *ids[:4], ids[5])
    path = stream_head.path_of(tmp_path, "prompts")
    trimmer = Trimmer(client, keys.prompts, ROLLOUT_GROUP, path, keep_s=0)
    # exact, to see it on ten entries (a run trims whole nodes: ~)
    trimmer.approximate = False
    assert trimmer.trim() == 4
    # the pending one and after
    assert [e for e, _ in client.xrange(keys.prompts)] == ids[4:]
    # byte for byte
    assert stream_head.read_head(path) == before[:4]
    assert stream_head.read_all(client, keys.prompts, path) == before
    # a takeover still finds it
    claimed = client.xclaim(keys.prompts, ROLLOUT_GROUP, "w2", 0, [ids[4]])
    assert [e for e, _ in claimed] == [ids[4]]
    group = client.xinfo_groups(keys.prompts)[0]
    # the driver's lag is still known
    assert group["lag"] == 4 and group["pending"] == 1
    # nothing more until the pending entry is acknowledged
    assert trimmer.trim() == 0


def test_a_crash_between_the_append_and_the_trim_reads_each_entry_once(client, keys, tmp_path):
    ids = _stream(client, keys, 6)
    before = client.xrange(keys.prompts)
    client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"})
    client.xack(keys.prompts, ROLLOUT_GROUP, *ids)
    path = stream_head.path_of(tmp_path, "prompts")
    path.parent.mkdir(parents=True)
    path.write_text(
        "".join(__import__("json").dumps(stream_head.encode(i, f)) + "\n" for i, f in before[:3])
        # appended, not trimmed, then a torn line: the crash
        + '{"id": "9-'
    )
    assert stream_head.read_all(client, keys.prompts, path) == before
    restarted = Trimmer(client, keys.prompts, ROLLOUT_GROUP, path, keep_s=0)
    restarted.approximate = False
    # after the file's last id, below the last delivered
    assert restarted.trim() == 2
    assert stream_head.read_all(client, keys.prompts, path) == before and client.xlen(keys.prompts) == 1


def test_a_reader_behind_the_trim_or_starting_over_reads_the_file_first(client, keys, tmp_path):
    client.xgroup_create(keys.samples, TRAINER_GROUP, id="$", mkstream=True)
    written = [samples.Sample(f"g{i}", [f"g{i}-0"], "w1", 1) for i in range(5)]
    for s in written:
        client.xadd(keys.samples, samples.encode(s))
    client.xreadgroup(TRAINER_GROUP, "t", {keys.samples: ">"})
    client.xack(keys.samples, TRAINER_GROUP, *[e for e, _ in client.xrange(keys.samples)][:4])
    path = stream_head.path_of(tmp_path, "samples")
    trimmer = Trimmer(client, keys.samples, TRAINER_GROUP, path, keep_s=0)
    trimmer.approximate = False
    trimmer.trim()
    cursor, seen = "0-0", []
    for _ in range(4):
        good, _, cursor = samples.read_after(client, keys.samples, cursor, count=2, head=path)
        seen += [s.group_id for s in good]
    assert seen == [s.group_id for s in written]


def test_the_time_window_and_the_versions_rule():
    from shared.protocol.streams import versions
    from shared.runtime.weights.origins import RECENT_VERSIONS

    assert stream_head.window_point(NOW, keep_s=60) == f"{NOW - 60_000}-0"
    # a clock near zero: nothing is older
    assert stream_head.window_point(5_000, keep_s=60) == "0-0"
    # one version every 10 s, newest first
    newest = [f"{NOW - i * 10_000}-0" for i in range(versions.KEEP_LAST)]
    # fewer than KEEP_LAST: all stay
    assert versions.trim_point(newest[:-1], NOW, keep_s=0) is None
    # the newest KEEP_LAST stay
    assert versions.trim_point(newest, NOW, keep_s=0) == newest[-1]
    # and the last minute (inside them here)
    assert versions.trim_point(newest, NOW, keep_s=60) == newest[-1]
    assert versions.trim_point(newest[:2] * 8, NOW, keep_s=1, keep_last=2) == f"{NOW - 10_000}-0"
    # a long window keeps more
    assert versions.trim_point(newest, NOW, keep_s=1000) == f"{NOW - 1_000_000}-0"
    # the weight origins' reader finds what it reads in Redis
    assert versions.KEEP_LAST >= RECENT_VERSIONS


def test_a_reader_following_a_long_head_reads_the_file_once(client, keys, tmp_path):
    """An archiver restarted late follows a head of thousands of entries a batch at a time: each batch is read at
    its offset, the file indexed once (the old read_after parsed the whole file for every batch)."""
    client.xgroup_create(keys.samples, TRAINER_GROUP, id="$", mkstream=True)
    for i in range(5_000):
        client.xadd(keys.samples, samples.encode(samples.Sample(f"g{i}", [f"g{i}-0"], "w1", 1)))
    client.xreadgroup(TRAINER_GROUP, "t", {keys.samples: ">"})
    client.xack(keys.samples, TRAINER_GROUP, *[e for e, _ in client.xrange(keys.samples)])
    _past(client.xrevrange(keys.samples, count=1)[0][0])
    path = stream_head.path_of(tmp_path, "samples")
    # the last delivered stays
    assert Trimmer(client, keys.samples, TRAINER_GROUP, path, keep_s=0).trim() == 4_999
    cursor, seen, batches = "0-0", [], 0
    while True:
        good, _, after = samples.read_after(client, keys.samples, cursor, count=1000, head=path)
        if after == cursor:
            break
        cursor, seen, batches = after, seen + [s.group_id for s in good], batches + 1
    # five from the file, one from Redis
    assert seen == [f"g{i}" for i in range(5_000)] and batches == 6
    index = stream_head.index_of(path)
    read, size = index.bytes_read, path.stat().st_size
    # indexed once, each line read about once: a batch reads past its last line at most a stride of lines (the
    # old way read the whole file twice for each of the 6 batches)
    assert read <= 2.1 * size, (read, size)
    # sparse: one point per stride
    assert len(index.ids) == len(index.offsets) == -(-4_999 // index.STRIDE)
    # the trimmer appends more: only the new bytes are indexed
    with open(path, "a") as fh:
        fh.write(__import__("json").dumps(stream_head.encode(b"99999999999999-0", {"group_id": "late"})) + "\n")
    assert [e for e, _ in stream_head.read_after(client, keys.samples, path, cursor, 10)] == [b"99999999999999-0"]
    # new bytes indexed, then read from the indexed line at or before the cursor: a stride at most
    line = size / 4_999
    assert stream_head.index_of(path).bytes_read - read <= 2 * (path.stat().st_size - size) + 1.5 * index.STRIDE * line
    entries = stream_head.read_head(path)
    for cursor in (
        "0-0",
        entries[0][0].decode(),
        entries[63][0].decode(),
        entries[64][0].decode(),
        entries[2_500][0].decode(),
        entries[-2][0].decode(),
        entries[-1][0].decode(),
    ):
        want = [e for e in entries if stream_head.id_key(e[0].decode()) > stream_head.id_key(cursor)][:130]
        # any cursor, not only a follower's last one
        assert index.after(cursor, 130) == want, cursor


def test_a_trimmer_by_its_own_rule_stores_what_it_is_told(client, keys, tmp_path):
    """No consumer group: the rule is ``point``; ``store`` leaves out what is kept elsewhere (the trainer's
    records), and the next trim after a restart neither loses nor repeats an entry."""
    from shared.protocol.streams import metrics

    for i in range(10):
        metrics.record(client, keys, "train" if i % 2 else "sync", {"step" if i % 2 else "sync": i})
    ids = [e for e, _ in client.xrange(keys.metrics)]
    path = stream_head.path_of(tmp_path, "metrics")

    def numbers(entries):
        return [max(metrics.decode(f)[1].values()) for _, f in entries]

    def trimmer(upto: int) -> Trimmer:
        t = Trimmer(
            client,
            keys.metrics,
            None,
            path,
            point=lambda now_ms: ids[upto].decode(),
            store=lambda f: metrics.to_head(f, trainer_file=True),
        )
        t.approximate = False
        return t

    # entries 0, 2, 4 stored; 1, 3, 5 trimmed, kept by the trainer's file
    assert trimmer(6).trim() == 3
    assert numbers(stream_head.read_head(path)) == [0, 2, 4] and numbers(client.xrange(keys.metrics)) == [6, 7, 8, 9]
    # restarted: 6 and 8 stored, 7 left out
    assert trimmer(9).trim() == 2 and client.xlen(keys.metrics) == 1
    assert numbers(stream_head.read_all(client, keys.metrics, path)) == [0, 2, 4, 6, 8, 9]

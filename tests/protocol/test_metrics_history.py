"""The metrics stream keeps a recent window in Redis, its older records in the run folder: the head rule
(pure), a run's whole history read from the trainer's metrics.jsonl, the head file and Redis with each record
once (also mid-move, after a crash between the append and the trim), and the newest record of a kind found in the
files' ends when Redis's window has none."""

from __future__ import annotations

import json

from shared.protocol.streams import metrics, stream_head


def _fields(kind: str, data: dict) -> dict:
    return {b"kind": kind.encode(), b"json": json.dumps(data).encode()}


def test_train_records_go_to_the_head_only_when_the_trainer_file_is_not_there():
    assert metrics.to_head(_fields("train", {"step": 1}), trainer_file=False)
    assert not metrics.to_head(_fields("train", {"step": 1}), trainer_file=True)
    assert metrics.to_head(_fields("validation", {"version": 2}), trainer_file=True)
    assert metrics.to_head({b"kind": b"agent", b"json": b"not json"}, trainer_file=True)


def _run(client, keys, run_path, crash_mid_move: bool):
    """Six steps, a sync, two rollout reports and two validation rounds; the driver's trimmer moves all but the
    last few, the trainer's records to its own file."""
    run_path.mkdir()
    for step in range(1, 7):
        rec = {"step": step, "version": step, "stale_tokens_masked": step * 10}
        (run_path / "metrics.jsonl").open("a").write(json.dumps(rec) + "\n")
        metrics.record(client, keys, "train", rec)
        if step in (2, 5):
            metrics.record(client, keys, "validation", {"version": step, "reward_mean": step / 10})
        if step == 3:
            metrics.record(client, keys, "sync", {"sync": "s1", "total_s": 0.1})
        if step in (1, 4):
            metrics.record(client, keys, "rollout", {"worker": "w1", "tokens": step * 100})
    ids = [e for e, _ in client.xrange(keys.metrics)]
    trimmer = stream_head.Trimmer(
        client,
        keys.metrics,
        None,
        metrics.head_path(run_path),
        point=lambda now_ms: ids[-2].decode(),
        store=lambda f: metrics.to_head(f, (run_path / "metrics.jsonl").exists()),
    )
    trimmer.approximate = False
    # appended, then killed before the XTRIM: the head's records are in Redis too
    if crash_mid_move:
        trimmer.client = type("NoTrim", (), {"xrange": client.xrange, "xtrim": lambda *a, **k: 0})()
    trimmer.trim()
    return ids


def test_a_run_history_reads_each_record_once_from_files_and_redis(client, keys, tmp_path):
    for crash in (False, True):
        client.delete(keys.metrics)
        run_path = tmp_path / f"run-{crash}"
        ids = _run(client, keys, run_path, crash)
        # the window: the last two entries
        assert client.xlen(keys.metrics) == (len(ids) if crash else 2)
        head = [metrics.decode(f)[0] for _, f in stream_head.read_head(metrics.head_path(run_path))]
        # no train record: those are in its file
        assert head == ["rollout", "validation", "sync", "rollout"]
        found = metrics.history(client, keys, run_path)
        assert [r["step"] for r in found["train"]] == [1, 2, 3, 4, 5, 6], crash
        assert [r["version"] for r in found["validation"]] == [2, 5]
        assert [r["tokens"] for r in found["rollout"]] == [100, 400] and len(found["sync"]) == 1
        # Redis gone: the files alone
        gone = metrics.history(None, keys, run_path)
        # the window: lost
        assert [r["version"] for r in gone["validation"]] == [2] and len(gone["train"]) == 6


def test_the_newest_record_older_than_the_window_comes_from_the_files_ends(client, keys, tmp_path):
    run_path = tmp_path / "run"
    _run(client, keys, run_path, crash_mid_move=False)
    # Redis's window has none
    assert metrics.last(client, keys, "sync") is None
    assert metrics.last(client, keys, "sync", run_path=run_path) == {"sync": "s1", "total_s": 0.1}
    assert metrics.last(client, keys, "validation", run_path=run_path)["version"] == 5
    client.delete(keys.metrics)
    # the trainer's file's last line
    assert metrics.last(client, keys, "train", run_path=run_path)["step"] == 6
    assert metrics.last(client, keys, "fault_probe", run_path=run_path) is None

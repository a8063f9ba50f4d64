"""Every write a retried command can repeat is a no-op the second time, on a real server.

Each test runs the same write twice, as redis-py does when a reply is lost, and checks the stream holds one
entry and the second call said so (its return value; the debug log line is ``duplicate_write_skipped``).
"""

from __future__ import annotations

import contextlib
import logging

import structlog

from shared.protocol import gate, schema
from shared.protocol.streams import control, dead_letters, metrics, prompts, versions
from shared.protocol.streams.prompts import PromptGroup


@contextlib.contextmanager
def _debug_logs():
    """Capture log entries down to debug level, whatever level an earlier test configured."""
    old = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**old)


def test_prompt_group_enqueued_twice_is_one_entry(client, keys):
    g = PromptGroup(prompts.group_id(0, 7), 2, prompt="1+1=")
    first = prompts.enqueue(client, keys, [g])
    with _debug_logs() as logs:
        again = prompts.enqueue(client, keys, [g, PromptGroup(prompts.group_id(1, 7), 2, prompt="1+1=")])
    assert first[0] and again[0] is None and again[1]
    assert [e["write"] for e in logs if e["event"] == "duplicate_write_skipped"] == ["prompts"]
    assert client.xlen(keys.prompts) == 2
    # the same row in another epoch is another group
    assert prompts.group_id(0, 7) != prompts.group_id(1, 7)


def test_version_published_twice_is_one_entry_and_never_goes_back(client, keys):
    v1, v2 = versions.Version(1, "/w/1", "a", 1), versions.Version(2, "/w/2", "b", 2)
    e1 = versions.publish(client, keys, v1)
    # the retry: no second entry, the first one's id
    assert versions.publish(client, keys, v1) == e1
    versions.publish(client, keys, v2)
    # an older version after a newer one: a no-op too
    versions.publish(client, keys, v1)
    assert [v.version for v in versions.read_all(client, keys)] == [1, 2]


def test_control_command_and_ack_written_once_and_a_duplicate_obeyed_once(client, keys):
    pause = control.Command("pause", "v1-abc")
    assert control.send_command(client, keys, pause) and control.send_command(client, keys, pause) is None
    assert control.send_ack(client, keys, pause, "w1", True, 0)
    assert control.send_ack(client, keys, pause, "w1", True, 0) is None
    # another worker's ack is its own
    assert control.send_ack(client, keys, pause, "w2", True, 0)
    entries = control.read_after(client, keys, "0-0")
    assert [type(e).__name__ for _, e in entries] == ["Command", "dict", "dict"]
    # a duplicate that got in anyway (an old writer)
    client.xadd(keys.control, control.encode_command(pause))
    seen = control.Seen()
    obeyed = [c for _, c in control.read_after(client, keys, "0-0") if isinstance(c, control.Command) and seen.first(c)]
    assert len(obeyed) == 1
    assert control.last_id(client, keys) == entries[-1][0] or control.last_id(client, keys) > entries[-1][0]


def test_one_dead_letter_per_stream_entry(client, keys):
    assert dead_letters.send(client, keys, keys.prompts, "1-0", "bad n", "w1")
    # a retry, or another finder
    assert not dead_letters.send(client, keys, keys.prompts, "1-0", "bad n", "w2")
    assert dead_letters.send(client, keys, keys.prompts, "2-0", "bad n", "w1")
    assert [d.entry for d in dead_letters.read_all(client, keys)] == ["1-0", "2-0"]


def test_metrics_record_written_twice_is_read_once_the_last_kept(client, keys):
    metrics.record(client, keys, "train", {"step": 1, "loss": 0.5})
    metrics.record(client, keys, "train", {"step": 2, "loss": 0.4})
    # step 2 redone after a restart
    metrics.record(client, keys, "train", {"step": 2, "loss": 0.3})
    metrics.record(client, keys, "sync", {"sync": "v1-a", "total_s": 1})
    # a retried XADD
    metrics.record(client, keys, "sync", {"sync": "v1-a", "total_s": 1})
    assert [r["loss"] for _, r in metrics.read(client, keys, "train")] == [0.5, 0.3]
    assert len(metrics.read(client, keys, "sync")) == 1
    assert metrics.last(client, keys, "train")["loss"] == 0.3
    assert [r["step"] for _, r in metrics.read(client, keys, newest_first=True, kind="train")] == [2, 1]


def test_metrics_file_drops_a_redone_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1}\n{"step": 2, "loss": 2}\n{"step": 2, "loss": 3}\n')
    assert [r["loss"] for r in metrics.read_file(path)] == [1, 3]
    assert metrics.read_file(tmp_path / "absent.jsonl") == []


def test_gate_refund_of_a_group_counts_once(client, keys):
    gate.open(client, keys, 0, 4, 0)
    g = gate.Gate(client, keys, sync_mode=False)
    assert g.reserve(3).granted == 3 and gate.started(client, keys) == 3
    assert gate.refund_group(client, keys, "q000-000001")
    # the trainer judged it again after a restart
    assert not gate.refund_group(client, keys, "q000-000001")
    assert gate.started(client, keys) == 2


def test_schema_lists_every_stream_with_its_codec_doc():
    text = schema.describe()
    for title, module_name in schema.CODECS:
        assert f"## {title}" in text and module_name.replace(".", "/") in text
    for doc_bit in (
        "group_id  the prompt group's id",
        "one entry per published policy version",
        "``type=cmd``",
        "``stream`` (the key",
        "``kind`` and ``json``",
        "trained.jsonl",
        "gate:started",
        "`tokens`",
    ):
        assert doc_bit in text, doc_bit

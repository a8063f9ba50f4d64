"""shared/protocol/archive/jsonl.py: an append-only JSON-lines file read whole or by its end, a torn last line
ignored."""

from __future__ import annotations

import pytest

from shared.protocol.archive import jsonl


def test_read_skips_a_torn_last_line_and_names_a_bad_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "tor')
    # the blank line skipped, the torn one not read
    assert jsonl.read(path, "ledger") == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"ledger .*f\.jsonl: line 2 is not JSON"):
        jsonl.read(path, "ledger")
    assert jsonl.read(tmp_path / "none.jsonl", "ledger") == []


def test_tail_reads_only_the_end_and_skips_the_line_it_cut(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text("".join(f'{{"n": {n}}}\n' for n in range(100)))
    got = jsonl.tail(path, 40, "metrics")
    assert got and got[-1] == {"n": 99} and [r["n"] for r in got] == list(range(100 - len(got), 100))
    # the whole file: its first line too
    assert jsonl.tail(path, 10_000, "metrics") == [{"n": n} for n in range(100)]
    path.write_text('{"n": 1}\nnot json\n{"n": 2}\n')
    with pytest.raises(ValueError, match="metrics .*: a line near its end is not JSON"):
        jsonl.tail(path, 10_000, "metrics")

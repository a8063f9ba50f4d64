"""The move's shortcuts give what the long ways give: a group's started payload matched off its bytes
(shared/protocol/archive/templates.py) templates as decoding it does, the segment's columns built off numpy buffers
(shared/protocol/archive/arrays.py) are the table ``pyarrow`` builds from the rows, and a move never imports pandas
(~0.2 s of CPU in each archiver process) nor pyarrow.compute."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pyarrow as pa
import pytest

from shared.protocol.archive import (
    arrays as segment_arrays,
)
from shared.protocol.archive import (
    builder as segment_builder,
)
from shared.protocol.archive import (
    entries as segment_entries,
)
from shared.protocol.archive import (
    segments,
)
from shared.protocol.archive import (
    templates as segment_templates,
)
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.episode.sampling import episode_seed
from tests.archiver.test_segment_format import _entry, _tokens
from tests.archiver.test_segment_summary import SHAPES, _write

ROOT = Path(__file__).resolve().parents[2]

SAMPLING = {"temperature": 1.0, "max_tokens": 8, "stop_token_ids": [2]}


def _started(eid: str, group: str, index, seed="rule", **extra) -> bytes:
    sampling = dict(SAMPLING)
    if seed is not None:
        sampling["seed"] = episode_seed(0, group, index) if seed == "rule" else seed
    return msgpack.packb(
        {
            "episode_id": eid,
            "group_id": group,
            "index": index,
            "prompt_ids": [5, 6, 7, 8],
            "sampling": sampling,
            "task": {"answer": "7"},
            **extra,
        },
        use_bin_type=True,
    )


# (episode id, payload): each tried after the one before it, with the template it left
PAYLOADS = [
    ("g-0", _started("g-0", "g", 0)),
    ("g-1", _started("g-1", "g", 1)),
    ("g-200", _started("g-200", "g", 200)),
    # a seed of its own: kept as the seed
    ("g-3", _started("g-3", "g", 3, seed=12)),
    # not int64
    ("g-4", _started("g-4", "g", 4, seed=-5)),
    ("g-5", _started("g-5", "g", 5, seed=(1 << 64) - 1)),
    # an index past int32: kept whole
    ("g-6", _started("g-6", "g", 1 << 31)),
    # not an int
    ("g-7", _started("g-7", "g", True)),
    # not its own episode id: kept whole
    ("g-8", _started("g-9", "g", 8)),
    # no seed: a template without a seed slot
    ("g-9", _started("g-9", "g", 9, seed=None)),
    ("g-10", _started("g-10", "g", 10, seed=None)),
    # a seed again, after a template without
    ("g-11", _started("g-11", "g", 11)),
    # another group, another prompt
    ("h-0", _started("h-0", "h", 0)),
    ("h-1", _started("h-1", "h", 1, extra=1)),
    # each one below tried against this template
    ("h-2", _started("h-2", "h", 2)),
    # a byte more
    ("h-3", _started("h-3", "h", 3) + b"\x00"),
    # one more before the last piece
    ("h-3", _started("h-3", "h", 3).replace(b"\xa4task", b"\xc0\xa4task")),
    # index 4 as an int8: not packb's way
    ("h-4", _started("h-4", "h", 4).replace(b"\x04", b"\xd0\x04", 1)),
    ("h-5", b"\xc1"),
    ("h-6", _started("h-6", "h", 6)),
    ("\x00", _started("\x00", "h", 7)),
    # a byte off at the end: another template
    ("h-7", _started("h-7", "h", 7)[:-1] + b"\x00"),
]


@pytest.mark.parametrize("seed_base", [0, None, 3])
def test_a_template_matched_off_the_bytes_is_what_decoding_says(seed_base):
    templates = segment_templates.Templates()
    for eid, payload in PAYLOADS:
        fast = segment_entries._template(eid, payload, seed_base, templates)
        assert fast == segment_entries._template(eid, payload, seed_base), eid
        if fast is not None:
            assert segment_entries.fill(fast[0], eid, fast[1], fast[2], fast[3]) == payload
    # the shortcut was taken: g-1, g-200, g-3, g-4, g-10, h-6, "\x00"
    assert templates.hits == 7


def test_a_template_that_cannot_be_cut_is_not_kept():
    payload = msgpack.packb(
        {
            "episode_id": "g-0",
            "group_id": "g",
            "index": 0,
            "sampling": {"seed": 1},
            # a payload holding a mark
            "note": segment_templates._MARKS[0],
        },
        use_bin_type=True,
    )
    templates = segment_templates.Templates()
    assert segment_entries._template("g-0", payload, None, templates) is not None
    assert templates.last is None


def _episodes(client, keys) -> list[tuple[str, list]]:
    """(episode id, entries) of every shape: each of SHAPES as redis-py gives them, odd ones flat, an empty one."""
    log = EpisodeLog(client, keys, "w7")
    out = []
    for k, shape in enumerate(sorted(SHAPES)):
        _write(log, f"g-{k}", SHAPES[shape])
        out.append((f"g-{k}", client.xrange(keys.episode(f"g-{k}"))))
    odd = [
        (b"5-0", _entry(b"started", 0, b"\xc1")),
        (b"9-1", _entry(b"note", 7, b"")),
        (b"12-0", _entry(b"finished", 2, b"\x80", policy=b"03")),
        (b"12-1", _tokens([1, 2], [0.0, -1.5])),
    ]
    return out + [("odd-\u00e9", odd), ("empty", [])]


def test_the_columns_built_off_buffers_are_valid_arrays_that_give_every_episode_back(client, keys):
    episodes = _episodes(client, keys)
    table = segment_builder.table_of(episodes)
    # every buffer, offset and bitmap as Arrow's own builders would make them
    table.validate(full=True)
    assert table.equals(pa.Table.from_pylist(table.to_pylist(), schema=segments.SCHEMA))
    rows = table.to_pylist()
    assert any(r["others"] for r in rows) and any(r["finish_reason"] is None for r in rows)
    assert any(r["reward"] is None for r in rows) and any(r["start"] is None for r in rows)
    # +0.0 a null, as before
    assert table.column("tok_logprobs").combine_chunks().values.null_count > 0
    as_redis = [
        (
            eid,
            segments.from_row({"entry_ids": [i for i, _ in e], "entries": [f for _, f in e]})
            if e and isinstance(e[0][1], list)
            else e,
        )
        for eid, e in episodes
    ]
    # packed column by column, unpacked row by row: the same entries
    assert segments.entries_of(table) == as_redis
    assert segment_builder.table_of([]).num_rows == 0
    lps = table.column("tok_logprobs").combine_chunks().values
    for part in (lps, lps.slice(3), lps.slice(1, 4)):
        assert segment_arrays.valid_values(part).tolist() == part.drop_null().to_pylist()


MOVE = """
import sys
from pathlib import Path
from services.archiver.mover import Mover
from shared.protocol.keys import Keys
from shared.runtime.connection import connect
from tests.archiver.tiers_support import make_run
client, keys, run_path = connect(sys.argv[1]), Keys(sys.argv[2]), Path(sys.argv[3])
make_run(client, keys, run_path, versions=4)
mover = Mover(client, keys, run_path, retention=1)
mover.recover()
print(mover.step(), "pandas" in sys.modules, "pyarrow.compute" in sys.modules)
"""


def test_a_move_imports_neither_pandas_nor_pyarrow_compute(redis_url, keys, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", MOVE, redis_url, keys.run, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    # 3 groups of 2 moved; neither imported
    assert done.stdout.split() == ["6", "False", "False"]

"""The ``metrics`` stream: one entry per record, two plain fields, ``kind`` and ``json``.

Kinds and who writes them: ``train`` (trainer, one per optimizer step: loss, reward, staleness, ...),
``sync`` (syncer, one per weight sync: per-phase durations, workers missing), ``publish`` (trainer, one per
version once it is published: full and delta bytes, bytes written, elements changed, the entropy floor,
services/trainer/publisher.py), ``snapshot`` (trainer, one per snapshot landed on disk: version, step, bytes,
seconds, services/trainer/state/snapshot.py), ``rollout`` (each rollout
worker every few seconds: tokens, episodes, busy/idle seconds; ``final: true`` on its last record, whose
counters are complete), ``validation`` (driver, one per validation round), ``fault_probe`` (a crash drill's
worker, tests/support/fault_worker.py, just before it is killed: its counters and unflushed tokens), ``agent``
(the agents worker, services/gateway/runner.py, one per ended agent episode: calls, training rows, forks, aborted
calls). The trainer also
appends its records to ``metrics.jsonl`` in the run folder.

Where the records live: Redis keeps the last ``stream_keep_s`` seconds (and ``MAXLEN`` entries at most,
a backstop for a run with no driver); the driver moves the older head to ``<run>/streams/metrics.jsonl``
(shared/protocol/streams/stream_head.py), all but the train records when the trainer's ``metrics.jsonl`` is in the same
run folder (``to_head``: stored once). ``read`` and ``last`` read Redis (the recent records); ``history`` reads a
run's every record: the trainer's file, the head file, then Redis after the head's last id.

Duplicates are tolerated by the reader, not prevented by the writer (a record is informational and written
often): a retried XADD, or a step redone after a trainer restart, can leave two records with one identity
(``identity``: train ``step``, sync ``sync`` id, validation ``version``; an identical rollout record); ``read``
and ``dedupe`` keep the last of them, in the place of the last.
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.protocol.archive import jsonl
from shared.protocol.keys import Keys
from shared.protocol.streams import codec, stream_head

MAXLEN = 100_000
KINDS = ("train", "sync", "rollout", "validation", "fault_probe", "publish", "agent", "snapshot")


def record(client, keys: Keys, kind: str, data: dict) -> None:
    if kind not in KINDS:
        raise ValueError(f"metrics kind {kind!r}: expected one of {', '.join(KINDS)}")
    client.xadd(keys.metrics, {"kind": kind, "json": json.dumps(data)}, maxlen=MAXLEN, approximate=True)


def decode(fields: dict) -> tuple[str, dict]:
    """(kind, record); a record that is not JSON decodes as {} (the stream is informational)."""
    f = {codec.text(k): codec.text(v) for k, v in fields.items()}
    try:
        data = json.loads(f.get("json", "{}"))
    except ValueError:
        data = {}
    return f.get("kind", ""), data if isinstance(data, dict) else {}


def identity(kind: str, data: dict):
    """What makes a record the same record written again; None for a record that has none."""
    key = {
        "train": "step",
        "sync": "sync",
        "validation": "version",
        "publish": "version",
        "agent": "episode",
        "snapshot": "version",
    }.get(kind)
    if key is not None:
        return (kind, data[key]) if key in data else None
    if kind == "rollout":
        return (kind, json.dumps(data, sort_keys=True))
    return None


def dedupe(records: list, kind_of=lambda r: r[0], data_of=lambda r: r[1]) -> list:
    """``records`` without the earlier copies of a record written twice (same ``identity``), order kept."""
    last = {}
    for i, r in enumerate(records):
        ident = identity(kind_of(r), data_of(r))
        if ident is not None:
            last[ident] = i
    out = []
    for i, r in enumerate(records):
        ident = identity(kind_of(r), data_of(r))
        if ident is None or last[ident] == i:
            out.append(r)
    return out


def read_file(path) -> list[dict]:
    """The trainer's ``metrics.jsonl`` (train records), a redone step's earlier record dropped."""
    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return dedupe(rows, kind_of=lambda r: "train", data_of=lambda r: r)


def read(
    client,
    keys: Keys,
    kind: str | None = None,
    newest_first: bool = False,
    count: int | None = None,
    since_id: str = "-",
) -> list[tuple[str, dict]]:
    """[(entry id, record)] of one kind (or all), oldest first unless ``newest_first``."""
    raw = (
        client.xrevrange(keys.metrics, count=count)
        if newest_first
        else client.xrange(keys.metrics, min=since_id, count=count)
    )
    out = []
    for entry_id, fields in raw:
        k, data = decode(fields)
        if kind is None or k == kind:
            out.append((codec.text(entry_id), k, data))
    if newest_first:
        out.reverse()
    out = dedupe(out, kind_of=lambda r: r[1], data_of=lambda r: r[2])
    if newest_first:
        out.reverse()
    return [(entry_id, data) for entry_id, _, data in out]


def last(client, keys: Keys, kind: str, scan: int = 200, run_path=None, tail_bytes: int = 1 << 18) -> dict | None:
    """The newest record of ``kind`` among the newest ``scan`` entries, None when there is none; with ``run_path``,
    one older than Redis's window from the end of the run's files (their last ``tail_bytes``: a bounded read)."""
    found = read(client, keys, kind, newest_first=True, count=scan)
    if found or run_path is None:
        return found[0][1] if found else None
    if kind == "train":
        rows = jsonl.tail(trainer_path(run_path), tail_bytes, "metrics file")
        if rows:
            return rows[-1]
    older = [
        data for k, data in (decode(f) for _, f in stream_head.read_tail(head_path(run_path), tail_bytes)) if k == kind
    ]
    return older[-1] if older else None


def head_path(run_path) -> Path:
    """Where the driver moves the stream's older records: ``<run>/streams/metrics.jsonl``."""
    return stream_head.path_of(run_path, stream_head.NAMES["metrics"])


def trainer_path(run_path) -> Path:
    """The trainer's own file of its train records: ``<run>/metrics.jsonl``."""
    return Path(run_path) / "metrics.jsonl"


def to_head(fields: dict, trainer_file: bool) -> bool:
    """Whether a metrics entry moving out of Redis goes to the head file (pure): every kind but the trainer's
    records when its ``metrics.jsonl`` is in the run folder (they are there already)."""
    return not (trainer_file and decode(fields)[0] == "train")


def history(client, keys: Keys, run_path, kinds=KINDS) -> dict[str, list[dict]]:
    """A run's every record of ``kinds``, by kind, oldest first, each once: the trainer's ``metrics.jsonl`` (train),
    the head file, then Redis after the head's last id (``client`` None: the files alone, Redis gone)."""
    path = head_path(run_path)
    entries = stream_head.read_all(client, keys.metrics, path) if client is not None else stream_head.read_head(path)
    rows = [("train", r) for r in read_file(trainer_path(run_path))] if "train" in kinds else []
    rows += [(k, data) for k, data in (decode(f) for _, f in entries) if k in kinds]
    out: dict[str, list[dict]] = {k: [] for k in kinds}
    for k, data in dedupe(rows):
        out[k].append(data)
    return out

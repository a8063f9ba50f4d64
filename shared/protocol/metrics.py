"""The ``metrics`` stream: one entry per record, two plain fields, ``kind`` and ``json``.

Kinds and who writes them: ``train`` (trainer, one per optimizer step: loss, reward, staleness, ...),
``sync`` (syncer, one per weight sync: per-phase durations, workers missing), ``rollout`` (each rollout
worker every few seconds: tokens, episodes, busy/idle seconds; ``final: true`` on its last record, whose
counters are complete), ``validation`` (driver, one per validation round). The stream is capped
(approximately ``MAXLEN`` entries); the trainer also appends its records to ``metrics.jsonl`` in the run folder.
"""

from __future__ import annotations

import json

from shared.protocol.keys import Keys

MAXLEN = 100_000
KINDS = ("train", "sync", "rollout", "validation")


def _s(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def record(client, keys: Keys, kind: str, data: dict) -> None:
    if kind not in KINDS:
        raise ValueError(f"metrics kind {kind!r}: expected one of {', '.join(KINDS)}")
    client.xadd(keys.metrics, {"kind": kind, "json": json.dumps(data)}, maxlen=MAXLEN, approximate=True)


def decode(fields: dict) -> tuple[str, dict]:
    """(kind, record); a record that is not JSON decodes as {} (the stream is informational)."""
    f = {_s(k): _s(v) for k, v in fields.items()}
    try:
        data = json.loads(f.get("json", "{}"))
    except ValueError:
        data = {}
    return f.get("kind", ""), data if isinstance(data, dict) else {}


def read(client, keys: Keys, kind: str | None = None, newest_first: bool = False, count: int | None = None,
         since_id: str = "-") -> list[tuple[str, dict]]:
    """[(entry id, record)] of one kind (or all), oldest first unless ``newest_first``."""
    raw = client.xrevrange(keys.metrics, count=count) if newest_first else \
        client.xrange(keys.metrics, min=since_id, count=count)
    out = []
    for entry_id, fields in raw:
        k, data = decode(fields)
        if kind is None or k == kind:
            out.append((_s(entry_id), data))
    return out

"""A segment row's analysis columns (group id, last worker, status, finish reason, reward, generated tokens, newest
policy version), in ``NAMES`` order. A plain episode's come off what packing its entries found
(``segment_entries.Columns.add``: its group id, last worker, end and tokens), with only the end entry's payload
decoded. An episode of another shape (agent calls, an entry kept whole, tokens not in the token columns, a started
payload not templated) is folded instead; one that does not fold gets blank analysis columns (its entries are the
record all the same). For a plain episode both ways give the same values (tests/archiver)."""

from __future__ import annotations

import functools

import msgpack

from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold

NAMES = ("group_id", "worker", "status", "finish_reason", "reward", "num_generated", "version")
BLANK = ("", "", "", None, None, 0, -1)


@functools.lru_cache(maxsize=4096)
def _reason_reward(payload: bytes) -> tuple[str, float] | None:
    """(reason, reward) of a finished payload, or None. Memoized: a segment's end payloads are a few hundred
    distinct values (the reason, the reward, the checker's details) for thousands of episodes."""
    try:
        data = msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001 - an odd payload: the fold decides
        return None
    if not isinstance(data, dict) or not isinstance(data.get("reason"), str):
        return None
    try:
        return data["reason"], float(data["reward"])
    except (KeyError, TypeError, ValueError):
        return None


def _plain(plain: tuple) -> tuple | None:
    """The analysis columns of a plain episode, or None (the fold decides)."""
    group_id, worker, end_kind, end, tokens, version = plain
    try:
        worker = worker.decode()
    except UnicodeDecodeError:
        return None
    if end_kind == b"failed":
        return group_id, worker, "failed", None, None, tokens, version
    ending = _reason_reward(end)
    if ending is None:
        return None
    return group_id, worker, "finished", ending[0], ending[1], tokens, version


def summary(plain: tuple | None, entries: list[tuple[bytes, list[bytes]]]) -> tuple:
    """The analysis columns (``NAMES``) of an episode: ``plain`` is what ``Columns.add`` returned for it (None: not
    plain), ``entries`` its flat XRANGE entries, ``(id, [name, value, ...])``, folded when it is not plain."""
    if plain is not None:
        out = _plain(plain)
        if out is not None:
            return out
    try:
        ep = fold((i, dict(zip(fields[::2], fields[1::2]))) for i, fields in entries)
    except EventError:
        return BLANK
    return (
        ep.group_id,
        ep.last_worker,
        ep.status,
        ep.finish_reason,
        ep.reward,
        ep.num_generated,
        max(ep.versions, default=-1),
    )

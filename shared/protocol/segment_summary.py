"""A segment row's analysis columns (group id, last worker, status, finish reason, reward, generated tokens, newest
policy version) read off its packed entry columns (shared/protocol/segment_entries.py) without a fold: the header
fields say the kinds, workers and policies, the ``tok_counts`` the tokens, and only the end entry's payload is
decoded. An episode of another shape (agent calls, an entry kept whole, tokens not in the token columns, a
started payload not templated) is folded instead; one that does not fold gets blank analysis columns (its
entries are the record all the same). For a plain episode both ways give the same values (tests/archiver)."""

from __future__ import annotations

import functools

import msgpack

from shared.protocol.events import EventError
from shared.protocol.fold import fold

BLANK = {"group_id": "", "worker": "", "status": "", "finish_reason": None, "reward": None, "num_generated": 0,
         "version": -1}
PLAIN = {b"started", b"tokens", b"aborted", b"resumed", b"tool_call", b"tool_result", b"finished", b"failed"}


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


def _plain(cols: dict) -> dict | None:
    """The analysis columns of a plain episode (see the module's doc), or None."""
    kinds = cols["kinds"]
    if (not kinds or kinds[0] != b"started" or cols.get("group_id") is None or cols["others"]
            or not PLAIN.issuperset(kinds) or kinds.count(b"tokens") != len(cols["tok_counts"])):
        return None
    end = kinds[-1]
    out = {"group_id": cols["group_id"], "worker": cols["workers"][-1].decode(),
           "status": end.decode() if end in (b"finished", b"failed") else None, "finish_reason": None,
           "reward": None, "num_generated": sum(cols["tok_counts"]), "version": -1}
    if out["status"] is None:
        return None  # not ended: its status depends on more than its last entry (the fold says)
    if end == b"finished":
        payload = cols["payloads"][-1]
        ending = _reason_reward(cols.get("end") if payload is None else payload)
        if ending is None:
            return None
        out["finish_reason"], out["reward"] = ending
    counts = iter(cols["tok_counts"])
    versions = [p for k, p in zip(kinds, cols["policies"]) if k == b"tokens" and next(counts) > 0]
    out["version"] = max(versions, default=-1)
    return out


def summary(cols: dict, entries: list[tuple[bytes, list[bytes]]]) -> dict:
    """{group_id, worker, status, finish_reason, reward, num_generated, version} of an episode (``entries``: its
    flat XRANGE entries, ``(id, [name, value, ...])``): from its packed columns when it is plain, else from its
    fold (blank when it does not fold)."""
    try:
        plain = _plain(cols)
    except Exception:  # noqa: BLE001 - an odd payload: the fold decides
        plain = None
    if plain is not None:
        return plain
    try:
        ep = fold((i, dict(zip(fields[::2], fields[1::2]))) for i, fields in entries)
    except EventError:
        return dict(BLANK)
    return {"group_id": ep.group_id, "worker": ep.last_worker, "status": ep.status,
            "finish_reason": ep.finish_reason, "reward": ep.reward, "num_generated": ep.num_generated,
            "version": max(ep.versions, default=-1)}

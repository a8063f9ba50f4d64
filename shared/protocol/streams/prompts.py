"""Prompt groups: what the ``prompts`` stream holds, one entry per group.

Entry fields: ``group_id`` (plain), ``n`` (plain, episodes to roll out), ``v`` (schema version "1") and ``data``, a
msgpack map with ``prompt`` (text, or chat messages ``[{"role", "content"}, ...]`` rendered by the model's chat
template; tokenized by the worker) or ``prompt_ids`` (token ids), ``task`` (map handed to the reward function) and
optional ``sampling`` overrides.

Enqueueing is idempotent: group ids are deterministic (the driver's come from the dataset position and
epoch, a validation round's from its version), and one script sets ``enqueued:<group id>`` NX and appends
the entry only when that marker was new, so a retried enqueue (reply lost) or a driver restarted before it
saved its position adds no second entry for the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from shared.protocol.episode import sampling
from shared.protocol.episode.errors import EventError
from shared.protocol.streams import codec, once
from shared.protocol.streams.routing import node_of

# episodes in one group at most (a poison n of 10**9 would take a worker's memory)
MAX_GROUP = 4096

_ENQUEUE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
end
return false
"""


@dataclass
class PromptGroup:
    group_id: str
    n: int
    # text, or chat messages
    prompt: str | list[dict] | None = None
    prompt_ids: list[int] | None = None
    task: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    entry_id: str = ""

    def episode_ids(self) -> list[str]:
        return [f"{self.group_id}-{i}" for i in range(self.n)]


def encode_group(g: PromptGroup) -> dict:
    data: dict[str, Any] = {"task": g.task, "sampling": g.sampling}
    if g.prompt_ids is not None:
        data["prompt_ids"] = list(g.prompt_ids)
    else:
        data["prompt"] = g.prompt
    return {"group_id": g.group_id, "n": str(g.n), "v": "1", "data": msgpack.packb(data)}


def decode_group(entry_id, fields: dict) -> PromptGroup:
    entry_id = codec.text(entry_id)
    f = {codec.text(k): v for k, v in fields.items()}
    group_id = codec.text(f.get("group_id", ""))
    if not group_id or any(c in group_id for c in " :*"):
        raise EventError(entry_id, "group_id", f"expected a non-empty id without spaces, ':' or '*', got {group_id!r}")
    if codec.text(f.get("v", "1")) != "1":
        raise EventError(entry_id, "v", f"unknown prompt schema version {codec.text(f['v'])!r}; expected '1'")
    try:
        n = int(codec.text(f.get("n", "")))
        if not 1 <= n <= MAX_GROUP:
            raise ValueError
    except ValueError:
        raise EventError(
            entry_id, "n", f"expected an integer >= 1 and <= {MAX_GROUP}, got {codec.text(f.get('n'))!r}"
        ) from None
    try:
        data = msgpack.unpackb(f["data"], raw=False) if "data" in f else None
    except Exception as exc:
        raise EventError(entry_id, "data", f"not decodable as msgpack ({exc})") from None
    if not isinstance(data, dict):
        raise EventError(entry_id, "data", "expected a msgpack map")
    prompt, ids = data.get("prompt"), data.get("prompt_ids")
    if (prompt is None) == (ids is None):
        raise EventError(entry_id, "data.prompt", "expected exactly one of 'prompt' (text) or 'prompt_ids'")
    if prompt is not None and not isinstance(prompt, str):
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)
        ):
            raise EventError(
                entry_id,
                "data.prompt",
                f"expected text or a non-empty list of chat messages (maps with a 'role'), got {type(prompt).__name__}",
            )
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and i >= 0 for i in ids)):
        raise EventError(entry_id, "data.prompt_ids", "expected a list of non-negative ints")
    for name in ("task", "sampling"):
        if not isinstance(data.get(name, {}), dict):
            raise EventError(entry_id, f"data.{name}", "expected a map")
    sampling.check(entry_id, "data.sampling", data.get("sampling", {}))
    if isinstance(prompt, list):
        for i, m in enumerate(prompt):
            content = m.get("content")
            if not (
                content is None
                or isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(part, dict) for part in content))
            ):
                raise EventError(
                    entry_id,
                    f"data.prompt[{i}].content",
                    f"expected text, a list of parts or nothing, got {type(content).__name__}",
                )
    return PromptGroup(group_id, n, prompt, ids, data.get("task", {}), data.get("sampling", {}), entry_id)


def group_id(epoch: int, position: int) -> str:
    """The driver's id for the group of dataset row ``position`` in pass ``epoch`` over the dataset."""
    return f"q{epoch:03d}-{position:06d}"


def enqueue(client, keys, groups: list[PromptGroup], stream: str | None = None) -> list[str | None]:
    """Add groups to ``stream`` (default: the training prompts stream), each at most once per group id:
    the entry ids, None for a group already enqueued (a no-op, logged at debug)."""
    # on every primary of a cluster; a cluster pipeline has no script cache
    sha = client.script_load(_ENQUEUE)
    pipe = client.pipeline(transaction=False)
    for g in groups:
        pipe.execute_command(
            "EVALSHA",
            sha,
            2,
            keys.enqueued(g.group_id),
            stream or keys.prompts,
            once.MARKER_TTL_S,
            *(x for kv in encode_group(g).items() for x in kv),
            **node_of(client, keys.enqueued(g.group_id)),
        )
    out = []
    for g, entry_id in zip(groups, pipe.execute()):
        if entry_id is None:
            once.skipped("prompts", group_id=g.group_id)
        out.append(None if entry_id is None else codec.text(entry_id))
    return out


def forget(pipe, keys, group_ids: list[str]) -> None:
    """Queue on ``pipe`` the deletion of the enqueue markers of ``group_ids``, for a caller whose own record now
    says they are enqueued (the driver's counter, set on the same pipeline before this): a restarted driver
    starts after them and never enqueues them again, so their markers guard nothing any more (one
    marker per group grew with the run). A crash before the pipeline runs keeps them (they expire)."""
    for g in group_ids:
        pipe.delete(keys.enqueued(g))

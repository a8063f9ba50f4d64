"""LLM call requests: what the ``calls`` stream holds, one entry per call the
gateway hands to the rollout workers (consumer group ``rollout``).

Entry fields: ``episode_id`` and ``call`` (plain: the episode and the call's
index in it), ``v`` (this codec's version, "1") and ``data``, a msgpack map:
``digest`` (str, the request digest), ``extends`` (int, the call whose
prompt + completion the prompt extends, or -1), ``prompt_ids`` (array of ints,
the WHOLE prompt), ``sampling`` (map: temperature, top_p, top_k, max_tokens,
stop_token_ids, seed) and ``messages`` (str, the request's messages as JSON,
kept for replay).

``request`` adds an entry idempotently: one script looks the digest up in the
episode's call index (``Keys.call_index``), and only when it is not there
assigns the next call index and adds the entry. A retried request (same
episode, same digest) gets the index of the call already made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from shared.protocol.episode import sampling
from shared.protocol.episode.errors import EventError
from shared.protocol.keys import Keys
from shared.protocol.streams import codec

_REQUEST = """
local i = redis.call('HGET', KEYS[1], ARGV[1])
if i then return {tonumber(i), 0} end
i = redis.call('HINCRBY', KEYS[1], '#n', 1) - 1
redis.call('HSET', KEYS[1], ARGV[1], i)
redis.call('EXPIRE', KEYS[1], 604800)
redis.call('XADD', KEYS[2], '*', 'episode_id', ARGV[2], 'call', i, 'v', '1', 'data', ARGV[3])
return {i, 1}
"""


@dataclass
class CallRequest:
    episode_id: str
    digest: str
    extends: int
    prompt_ids: list[int]
    sampling: dict[str, Any]
    messages: str = ""
    # assigned by ``request``
    call: int = -1
    entry_id: str = ""
    extra: dict = field(default_factory=dict)


def _payload(r: CallRequest) -> bytes:
    return msgpack.packb(
        {
            "digest": r.digest,
            "extends": r.extends,
            "prompt_ids": list(r.prompt_ids),
            "sampling": r.sampling,
            "messages": r.messages,
        }
    )


class Requester:
    """The gateway's side: ``request(CallRequest) -> (call index, new?)``."""

    def __init__(self, client, keys: Keys):
        self.client, self.keys = client, keys
        self._script = client.register_script(_REQUEST)

    def lookup(self, episode_id: str, digest: str) -> int | None:
        i = self.client.hget(self.keys.call_index(episode_id), digest)
        return None if i is None else int(i)

    def request(self, r: CallRequest) -> tuple[int, bool]:
        index, new = self._script(
            keys=[self.keys.call_index(r.episode_id), self.keys.calls], args=[r.digest, r.episode_id, _payload(r)]
        )
        r.call = int(index)
        return r.call, bool(new)


def decode_request(entry_id, fields: dict) -> CallRequest:
    entry_id = codec.text(entry_id)
    f = {codec.text(k): v for k, v in fields.items()}
    if codec.text(f.get("v", "")) != "1":
        raise EventError(entry_id, "v", f"unknown call request version {codec.text(f.get('v'))!r}; expected '1'")
    episode_id = codec.text(f.get("episode_id", ""))
    if not episode_id:
        raise EventError(entry_id, "episode_id", "missing")
    try:
        call = int(codec.text(f.get("call", "")))
    except ValueError:
        raise EventError(entry_id, "call", f"expected an integer, got {codec.text(f.get('call'))!r}") from None
    try:
        data = msgpack.unpackb(f["data"], raw=False)
    except Exception as exc:
        raise EventError(entry_id, "data", f"not decodable as msgpack ({exc})") from None
    if not isinstance(data, dict):
        raise EventError(entry_id, "data", "expected a msgpack map")
    ids = data.get("prompt_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
        raise EventError(entry_id, "data.prompt_ids", "expected a non-empty list of non-negative ints")
    if not isinstance(data.get("sampling"), dict) or "max_tokens" not in data["sampling"]:
        raise EventError(entry_id, "data.sampling", "expected a map with max_tokens")
    sampling.check(entry_id, "data.sampling", data["sampling"])
    if not isinstance(data.get("messages", ""), str):
        raise EventError(entry_id, "data.messages", "expected str")
    if not isinstance(data.get("extends"), int) or not isinstance(data.get("digest"), str):
        raise EventError(entry_id, "data.extends", "expected int 'extends' and str 'digest'")
    return CallRequest(
        episode_id,
        data["digest"],
        data["extends"],
        ids,
        data["sampling"],
        str(data.get("messages", "")),
        call,
        entry_id,
    )

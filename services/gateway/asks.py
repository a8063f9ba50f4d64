"""Which call a request is: a retry of a call already made, or a new ask to be sampled.

A client retries a request it lost (the openai and anthropic clients send ``x-stainless-retry-count: 1`` and
up; any client may send an ``Idempotency-Key``). A client that says neither and sends the same request again
after the gateway that took the first one went away (a restart) before answering it is retrying too: the ask
records which gateway process took it, and the gateway marks a call answered as it hands the answer out. Any
other second identical request (a retry of a malformed answer, a second opinion) is a new ask, sampled anew.

The durable agent rerun after a crash sends the same requests again from its start; the agent runner counts its
runs (``#attempt`` in the episode's call index), and within each run the k-th ask of a request is that request's
k-th call, so a rerun's asks find the calls the earlier runs made and are answered from the log.

So a call's identity is the request's digest plus one of: the idempotency key, or the ask's ordinal among
this run's identical requests (a retry takes the newest ordinal instead of the next one). Counted atomically in
Redis, in the episode's call index hash, so concurrent gateways agree.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from shared.protocol.keys import Keys
from shared.protocol.streams.routing import node_of

# the ordinal of this ask among the run's identical requests: the next one, or the newest one when this is a
# retry (said so, or the newest was taken by another gateway process and never answered); and the index of the
# call requested under that identity, or -1 (the call lookup rides with the ordinal: one round trip)
_ORDINAL = """
local attempt = redis.call('HGET', KEYS[1], '#attempt') or '0'
local field = '#ask:' .. attempt .. ':' .. ARGV[1]
local n = tonumber(redis.call('HGET', KEYS[1], field) or '0')
if n > 0 then
  local prev = ARGV[1] .. ':' .. (n - 1)
  local index = redis.call('HGET', KEYS[1], prev)
  if ARGV[2] == '1' then return {n - 1, tonumber(index or '-1')} end
  local owner = redis.call('HGET', KEYS[1], '#own:' .. prev)
  if owner and owner ~= ARGV[3] then
    if not index or not redis.call('HGET', KEYS[1], '#ans:' .. index) then return {n - 1, tonumber(index or '-1')} end
  end
end
redis.call('HSET', KEYS[1], '#own:' .. ARGV[1] .. ':' .. n, ARGV[3])
redis.call('HINCRBY', KEYS[1], field, 1)
redis.call('EXPIRE', KEYS[1], 604800)
return {n, tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. ':' .. n) or '-1')}
"""


@dataclass(frozen=True)
class Ask:
    """What a request's headers say about it."""

    retry: bool = False
    idempotency_key: str = ""

    @classmethod
    def of(cls, headers: Mapping[str, str] | None) -> "Ask":
        headers = headers or {}
        count = str(headers.get("x-stainless-retry-count", "0")).strip()
        return cls(retry=count.isdigit() and int(count) > 0, idempotency_key=headers.get("idempotency-key", "")[:200])


class Asks:
    def __init__(self, client, keys: Keys):
        self.client, self.keys = client, keys
        # this gateway process: an unanswered ask another one took is a retry when it comes again
        self.boot = uuid.uuid4().hex[:16]

    def identity(self, episode_id: str, digest: str, ask: Ask) -> tuple[str, int | None]:
        """The call identity (the key of the episode's call index) of a request with ``digest``, and the index of
        the call requested under it (None: none yet)."""
        pipe = self.client.pipeline(transaction=False)
        read = self.ask_on(pipe, episode_id, digest, ask)
        return read(pipe.execute()[0])

    def ask_on(self, pipe, episode_id: str, digest: str, ask: Ask) -> Callable[[Any], tuple[str, int | None]]:
        """``identity`` as one command queued on ``pipe`` (to ride with the caller's reads); what it returns makes
        that command's reply the identity and the index."""
        key = self.keys.call_index(episode_id)
        if ask.idempotency_key:
            identity = f"{digest}:k{hashlib.sha256(ask.idempotency_key.encode()).hexdigest()[:16]}"
            pipe.hget(key, identity)
            return lambda index: (identity, None if index is None else int(index))
        # EVAL, not EVALSHA: a pipeline (a cluster's above all) loads no script, and the server caches it by its
        # text; raw, routed to the key's node (a cluster pipeline takes scripts no other way)
        pipe.execute_command(
            "EVAL", _ORDINAL, 1, key, digest, "1" if ask.retry else "0", self.boot, **node_of(self.client, key)
        )
        return lambda reply: (f"{digest}:{int(reply[0])}", None if int(reply[1]) < 0 else int(reply[1]))

    def answered(self, episode_id: str, index: int) -> None:
        """The gateway hands call ``index``'s answer out: an identical request from now on is a new ask."""
        self.client.hset(self.keys.call_index(episode_id), f"#ans:{index}", 1)

    def new_run(self, episode_id: str) -> int:
        """The agent runner starts a run of the agent (the first or a rerun): ordinals count again from 0."""
        key = self.keys.call_index(episode_id)
        pipe = self.client.pipeline()
        pipe.hincrby(key, "#attempt", 1)
        pipe.expire(key, 604800)
        return int(pipe.execute()[0])

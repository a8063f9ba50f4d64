"""Which call a request is: a retry of a call already made, or a new ask to be sampled.

A client retries a request it lost (the openai and anthropic clients send ``x-stainless-retry-count: 1`` and
up; any client may send an ``Idempotency-Key``). A deliberate second identical request (a retry of a malformed
answer, a second opinion) is a new ask and is sampled anew. The durable agent rerun after a crash sends the
same requests again from its start; the agent runner counts its runs (``#attempt`` in the episode's call
index), and within each run the k-th ask of a request is that request's k-th call, so a rerun's asks find the
calls the earlier runs made and are answered from the log.

So a call's identity is the request's digest plus one of: the idempotency key, or the ask's ordinal among
this run's identical requests (a retry takes the newest ordinal instead of the next one). Counted atomically in
Redis, in the episode's call index hash, so concurrent gateways agree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

from shared.protocol.keys import Keys

# the ordinal of this ask among the run's identical requests: the next one, or (a retry) the newest one
_ORDINAL = """
local attempt = redis.call('HGET', KEYS[1], '#attempt') or '0'
local field = '#ask:' .. attempt .. ':' .. ARGV[1]
if ARGV[2] == '1' then
  local n = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if n > 0 then return n - 1 end
end
local n = redis.call('HINCRBY', KEYS[1], field, 1)
redis.call('EXPIRE', KEYS[1], 604800)
return n - 1
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
        self._ordinal = client.register_script(_ORDINAL)

    def identity(self, episode_id: str, digest: str, ask: Ask) -> str:
        """The call identity (the key of the episode's call index) of a request with ``digest``."""
        if ask.idempotency_key:
            return f"{digest}:k{hashlib.sha256(ask.idempotency_key.encode()).hexdigest()[:16]}"
        n = self._ordinal(keys=[self.keys.call_index(episode_id)], args=[digest, "1" if ask.retry else "0"])
        return f"{digest}:{int(n)}"

    def new_run(self, episode_id: str) -> int:
        """The agent runner starts a run of the agent (the first or a rerun): ordinals count again from 0."""
        key = self.keys.call_index(episode_id)
        pipe = self.client.pipeline()
        pipe.hincrby(key, "#attempt", 1)
        pipe.expire(key, 604800)
        return int(pipe.execute()[0])

"""Small builders shared by tests: well-formed events and raw stream entries."""

from __future__ import annotations

from shared.protocol.episode.events import Event, encode


def started(seq: int = 0, episode_id: str = "e1", prompt=(5, 6, 7), policy: int = 0, worker: str = "w") -> Event:
    return Event(
        "started",
        policy,
        worker,
        seq,
        {
            "episode_id": episode_id,
            "group_id": "g1",
            "index": 0,
            "prompt_ids": list(prompt),
            "sampling": {"max_tokens": 32},
            "task": {"answer": "42"},
        },
    )


def tokens(seq: int, ids, policy: int = 0, worker: str = "w", logprobs=None) -> Event:
    ids = list(ids)
    return Event("tokens", policy, worker, seq, {"ids": ids, "logprobs": logprobs or [-0.5] * len(ids)})


def finished(seq: int, reward: float = 1.0, policy: int = 0) -> Event:
    return Event("finished", policy, "w", seq, {"reason": "stop", "reward": reward, "details": {}})


def raw(events: list[Event]) -> list[tuple]:
    """Events as XRANGE would return them: (id, {bytes: bytes})."""
    out = []
    for i, ev in enumerate(events):
        fields = {k.encode(): (v if isinstance(v, bytes) else v.encode()) for k, v in encode(ev).items()}
        out.append((f"{1000 + i}-0".encode(), fields))
    return out

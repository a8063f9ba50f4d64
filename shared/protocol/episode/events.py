"""Episode event schema, version 2: the contract between every streamrl process.

Version 2 adds agent episodes (LLM calls made through the gateway): the kinds
``call`` and ``call_done``, an optional ``call`` field on ``tokens``,
``aborted`` and ``resumed`` naming the call they belong to, and an optional
``agent`` field on ``started``. Version-1 entries still decode and fold (a
stream may mix both: a version-1 entry is read under the version-1 rules,
which are the version-2 rules without the new kinds and fields).

This module is the code *and* the documentation of the schema; docs/events.md
summarises it; ``streamrl schema`` prints it.

An episode is one Redis stream, ``streamrl:<run>:ep:{<episode_id>}`` (the braces: its own Redis Cluster
hash tag; ``streamrl schema`` lists every key). Each entry
has five plain header fields, readable with ``redis-cli XRANGE``, and one
msgpack payload field, always written last (so ``redis-cli -x`` can supply it
from stdin):

    type    event kind, one of KINDS below ("started", "tokens", ...)
    v       schema version, the decimal string "2" ("1" is still read)
    policy  policy version in effect when the event was written, decimal string
            ("0" is the initial weights); for "tokens" it is the version that
            generated them
    worker  id of the process that wrote the event (any string without spaces)
    seq     0, 1, 2, ... with no gaps: the event's position in the episode
    data    msgpack map, fields per kind below

Types used in payloads:
    ids       token ids: msgpack bin of little-endian uint32 (numpy "<u4"), or a
              plain msgpack array of ints (handy when writing by hand)
    logprobs  msgpack bin of little-endian float32 ("<f4"), or an array of floats;
              natural-log probability of each sampled token under the sampling
              distribution, same length as the ids it belongs to
    routes    msgpack map {layers, k, planes}: for each token, the experts each MoE layer chose for it,
              as layer-major byte planes (shared/protocol/episode/routes.py)
    str, int, float, bool, map, any: the msgpack types of those names

Writing an episode by hand (redis-cli + the msgpack library only):

    python -c 'import msgpack,sys;sys.stdout.buffer.write(msgpack.packb({"episode_id":"e1","group_id":"g1",\\
      "index":0,"prompt_ids":[20,21,22],"sampling":{"max_tokens":8},"task":{}}))' \\
      | redis-cli -x XADD 'streamrl:demo:ep:{e1}' '*' type started v 2 policy 0 worker me seq 0 data
    python -c 'import msgpack,sys;sys.stdout.buffer.write(msgpack.packb({"ids":[30,31],"logprobs":[-0.5,-1.25]}))' \\
      | redis-cli -x XADD 'streamrl:demo:ep:{e1}' '*' type tokens v 2 policy 0 worker me seq 1 data
    python -c 'import msgpack,sys;sys.stdout.buffer.write(msgpack.packb({"reason":"stop","reward":1.0,\\
      "details":{}}))' \\
      | redis-cli -x XADD 'streamrl:demo:ep:{e1}' '*' type finished v 2 policy 0 worker me seq 2 data
    streamrl replay e1 --run demo
"""

from __future__ import annotations

import array
import math
import sys
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from shared.protocol.episode import routes, sampling
from shared.protocol.episode.errors import EventError
from shared.protocol.streams import codec

SCHEMA_VERSION = 2
# version-1 streams still fold
READABLE_VERSIONS = (1, 2)
HEADER_FIELDS = ("type", "v", "policy", "worker", "seq", "data")

# kind -> {payload field: (type, required, meaning)}
KINDS: dict[str, dict[str, tuple[str, bool, str]]] = {
    "started": {
        "episode_id": ("str", True, "this episode's id (the stream key's suffix)"),
        "group_id": ("str", True, "the prompt group this episode belongs to (GRPO group)"),
        "index": ("int", True, "position of the episode in its group, 0-based"),
        "prompt_ids": ("ids", True, "the prompt's token ids (chat template applied)"),
        "sampling": ("map", True, "temperature, top_p, top_k, max_tokens (response budget), stop_token_ids, seed"),
        "task": ("map", False, "task metadata, e.g. the ground truth the reward function reads"),
        "agent": (
            "str",
            False,
            "v2: 'module:function' of the user agent running this episode through the gateway; "
            "prompt_ids is then empty and every prompt comes with a 'call' event",
        ),
    },
    "tokens": {
        "ids": ("ids", True, "a chunk of generated token ids, in order"),
        "logprobs": ("logprobs", True, "behaviour log-prob of each token in ids"),
        "call": ("int", False, "v2: the call these tokens answer (agent episodes); absent: the episode's response"),
        "routes": (
            "routes",
            False,
            "v2: a mixture-of-experts policy's expert choices for each token in ids (see routes.py): the routes "
            "the trainer replays; absent for a dense policy or with routing_replay off",
        ),
    },
    "aborted": {
        "reason": (
            "str",
            True,
            "why generation stopped: 'pause' (weight sync), 'shutdown', 'debug', 'repack' (the "
            "group was handed to a long-tail worker)",
        ),
        "num_tokens": ("int", True, "response tokens in the stream at the abort (of the call, when 'call' is set)"),
        "call": ("int", False, "v2: the call whose generation stopped"),
    },
    "resumed": {
        "num_tokens": ("int", True, "response tokens replayed from the stream; generation continues after them"),
        "takeover_from": ("str", False, "the worker whose episode this was, when resumed after its crash"),
        "repacked": (
            "str",
            False,
            "the worker that handed this episode over in a long-tail repack (its 'aborted' "
            "event, reason 'repack', comes just before)",
        ),
        "call": ("int", False, "v2: the call whose generation continues"),
    },
    "call": {
        "call": ("int", True, "v2: index of this LLM call in the episode, 0-based, assigned by the gateway"),
        "extends": (
            "int",
            True,
            "the call whose prompt + completion this prompt extends, or -1: prompt_ids is the "
            "whole prompt (the first call, or a fork: the agent rewrote its history)",
        ),
        "prompt_ids": (
            "ids",
            True,
            "extends >= 0: only the tokens appended after the extended call's prompt + "
            "completion (tool results, user turns, template tokens; never trained on); "
            "extends = -1: the whole prompt",
        ),
        "digest": (
            "str",
            True,
            "digest of the request (messages, tools, sampling): a retry with the same digest is "
            "answered from this call",
        ),
        "sampling": (
            "map",
            True,
            "temperature, top_p, top_k, max_tokens (budget of this call), stop_token_ids, seed; stop and "
            "stop_kept (optional: stop strings matched on the decoded completion; the answer is cut before a "
            "'stop' one, a 'stop_kept' one stays in it)",
        ),
        "messages": (
            "str",
            False,
            "the request's messages and tools as JSON text (for replay); with 'tool_choice' when it is not "
            "'auto' and 'prefill', the text put after the generation prompt (a forced tool call's opening), "
            "which the answer is parsed with",
        ),
    },
    "call_done": {
        "call": ("int", True, "v2: the call that is complete"),
        "reason": ("str", True, "'stop' (stop token or stop string), 'length' (budget or context spent)"),
        "num_tokens": ("int", True, "completion tokens of the call"),
        "stop": (
            "str",
            False,
            "the stop string (of the call's sampling stop or stop_kept) whose decoded text the last token "
            "completed; absent: no stop string ended the call",
        ),
    },
    "tool_call": {
        "call_id": ("str", True, "id unique within the episode, pairs the call with its result"),
        "name": ("str", True, "tool name as written by the model"),
        "args": ("str", True, "raw argument text as written by the model"),
    },
    "tool_result": {
        "call_id": ("str", True, "the call this answers"),
        "ok": ("bool", True, "false when the tool raised, timed out, was unknown or returned garbage"),
        "output": ("str", True, "the tool's output, or the error message when ok is false"),
        "ids": ("ids", True, "tokens appended to the context for the model (masked out of the loss)"),
    },
    "finished": {
        "reason": ("str", True, "'stop' (stop token), 'length' (budget), 'context' (model length), 'tool_limit'"),
        "reward": ("float", True, "scalar reward of the episode"),
        "details": ("map", False, "reward function's breakdown"),
    },
    "failed": {
        "error": ("str", True, "what went wrong, for a person"),
        "where": (
            "str",
            False,
            "component that failed: 'engine', 'reward', 'prompt', 'agent' (the user's agent raised), 'gateway' "
            "(the agent lost the gateway and it did not come back: an infrastructure failure), ...",
        ),
    },
}

TERMINAL_KINDS = ("finished", "failed")
# the ``where`` of a failure the platform caused, not the episode's input, model, reward or agent: `streamrl check`
# counts these, and a run with any is not ok
INFRASTRUCTURE_FAILURES = ("gateway",)
V2_KINDS = ("call", "call_done")


@dataclass(slots=True)
class Event:
    kind: str
    policy: int
    worker: str
    seq: int
    data: dict[str, Any]
    # Redis stream id once written, e.g. "1732300000000-0"
    entry_id: str = ""

    @property
    def time_ms(self) -> int:
        return int(self.entry_id.split("-")[0]) if self.entry_id else 0


# a short list packs faster through the standard library's array (a C loop over the list, no format string built a
# call) than through a numpy array made for it (most tokens events hold a few tokens); an array, a long list, or a
# machine whose byte order is not the wire's little-endian goes through numpy
_ARRAY_MAX = 256 if sys.byteorder == "little" else -1


def pack_ids(ids) -> bytes:
    if isinstance(ids, list) and len(ids) <= _ARRAY_MAX:
        try:
            return array.array("I", ids).tobytes()
        except (OverflowError, TypeError):
            # a negative id, one past uint32, or not an integer: numpy's own error (or conversion) below
            pass
    return np.asarray(ids, dtype="<u4").tobytes()


def pack_logprobs(logprobs) -> bytes:
    if isinstance(logprobs, list) and len(logprobs) <= _ARRAY_MAX:
        try:
            # a value past float32's range becomes an infinity, as through numpy
            return array.array("f", logprobs).tobytes()
        except TypeError:
            pass
    return np.asarray(logprobs, dtype="<f4").tobytes()


_PACKERS = {"ids": pack_ids, "logprobs": pack_logprobs, "routes": routes.pack}
# kind -> fields packed as bytes
_PACKED = {
    kind: tuple((name, _PACKERS[typ]) for name, (typ, _, _) in payload.items() if typ in _PACKERS)
    for kind, payload in KINDS.items()
}


def encode_data(event: Event) -> bytes:
    """The event's msgpack payload (the ``data`` field): ids and logprobs packed as bytes."""
    data = event.data
    packers = _PACKED[event.kind]
    if packers:
        data = dict(data)
        for name, pack in packers:
            if name in data:
                data[name] = pack(data[name])
    return _packer().pack(data)


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's packer: one made per event cost as much as the packing (a Packer is not safe across threads)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    return packer


def encode(event: Event) -> dict[str, bytes | str]:
    """Event -> stream entry fields (header strings, msgpack payload last)."""
    return {
        "type": event.kind,
        "v": str(SCHEMA_VERSION),
        "policy": str(event.policy),
        "worker": event.worker,
        "seq": str(event.seq),
        "data": encode_data(event),
    }


def _header_int(entry_id: str, fields: dict, name: str) -> int:
    raw = fields.get(name)
    if raw is None:
        raise EventError(entry_id, name, "missing header field")
    try:
        return int(codec.text(raw))
    except ValueError:
        raise EventError(entry_id, name, f"expected a decimal integer, got {raw!r}") from None


def _unpack_array(entry_id: str, name: str, value: Any, dtype: str, kind: type) -> list:
    if isinstance(value, bytes):
        if len(value) % 4:
            raise EventError(entry_id, name, f"expected {dtype} bytes (length a multiple of 4), got {len(value)} bytes")
        return np.frombuffer(value, dtype=dtype).tolist()
    if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return [kind(x) for x in value]
    raise EventError(entry_id, name, f"expected {dtype} bytes or an array of numbers, got {type(value).__name__}")


_CHECKS = {"str": str, "int": int, "float": (int, float), "bool": bool, "map": dict}


def decode(entry_id: Any, fields: dict) -> Event:
    """Stream entry (as returned by XRANGE, bytes or str) -> Event, or EventError."""
    entry_id = codec.text(entry_id)
    fields = {codec.text(k): v for k, v in fields.items()}
    kind = codec.text(fields.get("type", b""))
    if kind not in KINDS:
        raise EventError(entry_id, "type", f"unknown event kind {kind!r}; expected one of {', '.join(KINDS)}")
    version = _header_int(entry_id, fields, "v")
    if version not in READABLE_VERSIONS:
        raise EventError(
            entry_id,
            "v",
            f"unknown schema version {version}; this build reads versions {', '.join(map(str, READABLE_VERSIONS))}",
        )
    if version == 1 and kind in V2_KINDS:
        raise EventError(entry_id, "type", f"event kind {kind!r} needs schema version 2, the entry says 1")
    policy = _header_int(entry_id, fields, "policy")
    seq = _header_int(entry_id, fields, "seq")
    if "data" not in fields:
        raise EventError(entry_id, "data", "missing msgpack payload")
    try:
        data = msgpack.unpackb(fields["data"], raw=False, strict_map_key=True)
    # msgpack raises several unrelated types
    except Exception as exc:
        raise EventError(entry_id, "data", f"not decodable as msgpack ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise EventError(entry_id, "data", f"expected a msgpack map, got {type(data).__name__}")
    for name, (typ, required, _) in KINDS[kind].items():
        if name not in data:
            if required:
                raise EventError(entry_id, f"data.{name}", f"missing (required for {kind!r}, type {typ})")
            continue
        value = data[name]
        if typ == "ids":
            data[name] = _unpack_array(entry_id, f"data.{name}", value, "<u4", int)
        elif typ == "logprobs":
            data[name] = _unpack_array(entry_id, f"data.{name}", value, "<f4", float)
        elif typ == "routes":
            data[name] = routes.unpack(entry_id, f"data.{name}", value, len(data["ids"]))
        elif not isinstance(value, _CHECKS[typ]) or (typ in ("int", "float") and isinstance(value, bool)):
            raise EventError(entry_id, f"data.{name}", f"expected {typ}, got {type(value).__name__}")
        elif typ == "float" and not math.isfinite(value):
            raise EventError(entry_id, f"data.{name}", f"expected a finite number, got {value}")
        elif name == "sampling":
            sampling.check(entry_id, f"data.{name}", value)
    if kind == "tokens" and len(data["ids"]) != len(data["logprobs"]):
        raise EventError(
            entry_id, "data.logprobs", f"{len(data['logprobs'])} log-probs for {len(data['ids'])} token ids"
        )
    return Event(
        kind=kind, policy=policy, worker=codec.text(fields.get("worker", b"")), seq=seq, data=data, entry_id=entry_id
    )


def describe() -> str:
    """The schema as Markdown, for `streamrl schema` (docs/events.md summarises it)."""
    lines = [f"Schema version {SCHEMA_VERSION}. Header fields: " + ", ".join(f"`{h}`" for h in HEADER_FIELDS) + ".", ""]
    for kind, payload in KINDS.items():
        lines.append(f"- `{kind}`")
        for name, (typ, required, meaning) in payload.items():
            lines.append(f"  - `{name}` ({typ}{'' if required else ', optional'}): {meaning}")
    return "\n".join(lines)

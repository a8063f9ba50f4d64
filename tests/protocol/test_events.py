import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import KINDS, SCHEMA_VERSION, Event, decode, describe, encode
from tests.support.helpers import raw, started, tokens

u32 = st.integers(min_value=0, max_value=2**32 - 1)
f32 = st.floats(width=32, allow_nan=False)
names = st.text(min_size=1, max_size=12)


@given(
    ids=st.lists(u32, max_size=64),
    data=st.data(),
    policy=st.integers(0, 10**6),
    seq=st.integers(0, 10**6),
    worker=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20),
)
def test_tokens_round_trip(ids, data, policy, seq, worker):
    logprobs = data.draw(st.lists(f32, min_size=len(ids), max_size=len(ids)))
    ev = Event("tokens", policy, worker, seq, {"ids": ids, "logprobs": logprobs})
    ((entry_id, fields),) = raw([ev])
    back = decode(entry_id, fields)
    assert (back.kind, back.policy, back.worker, back.seq) == ("tokens", policy, worker, seq)
    assert back.data["ids"] == ids
    # float32 inputs survive exactly
    assert back.data["logprobs"] == logprobs


@given(
    prompt=st.lists(u32, max_size=40),
    task=st.dictionaries(names, st.one_of(st.integers(-5, 5), names)),
    call_id=names,
    output=st.text(max_size=50),
    ok=st.booleans(),
    reward=st.floats(-1e6, 1e6),
)
def test_every_kind_round_trips(prompt, task, call_id, output, ok, reward):
    evs = [
        Event(
            "started",
            0,
            "w",
            0,
            {
                "episode_id": "e",
                "group_id": "g",
                "index": 3,
                "prompt_ids": prompt,
                "sampling": {"temperature": 1.0},
                "task": task,
            },
        ),
        Event("tokens", 0, "w", 1, {"ids": prompt, "logprobs": [-1.0] * len(prompt)}),
        Event("aborted", 1, "w", 1, {"reason": "pause", "num_tokens": 0}),
        Event("resumed", 2, "w2", 2, {"num_tokens": 0, "takeover_from": "w"}),
        Event("tool_call", 2, "w2", 3, {"call_id": call_id, "name": "calc", "args": "1+1"}),
        Event("tool_result", 2, "w2", 4, {"call_id": call_id, "ok": ok, "output": output, "ids": prompt}),
        Event("finished", 2, "w2", 5, {"reason": "stop", "reward": reward, "details": {"k": 1}}),
        Event("failed", 2, "w2", 6, {"error": output, "where": "engine"}),
        Event(
            "call",
            2,
            "w2",
            7,
            {
                "call": 0,
                "extends": -1,
                "prompt_ids": prompt,
                "digest": call_id,
                "sampling": {"max_tokens": 4},
                "messages": output,
            },
        ),
        Event("call_done", 2, "w2", 8, {"call": 0, "reason": "stop", "num_tokens": 0}),
    ]
    assert {e.kind for e in evs} == set(KINDS)
    for ev, (entry_id, fields) in zip(evs, raw(evs)):
        back = decode(entry_id, fields)
        assert back.kind == ev.kind and back.data == ev.data


def test_headers_are_plain_text():
    fields = encode(tokens(1, [1, 2]))
    assert list(fields) == ["type", "v", "policy", "worker", "seq", "data"]
    assert fields["type"] == "tokens" and fields["v"] == str(SCHEMA_VERSION) and fields["seq"] == "1"


def test_hand_written_arrays_are_accepted():
    fields = {
        b"type": b"tokens",
        b"v": b"1",
        b"policy": b"3",
        b"worker": b"me",
        b"seq": b"1",
        b"data": msgpack.packb({"ids": [30, 31], "logprobs": [-0.5, -1]}),
    }
    ev = decode(b"5-0", fields)
    assert ev.data == {"ids": [30, 31], "logprobs": [-0.5, -1.0]} and ev.policy == 3


def _fields(**over):
    ((_, fields),) = raw([started()])
    fields = {k.decode(): v for k, v in fields.items()}
    fields.update(over)
    return fields


@pytest.mark.parametrize(
    "fields, field, words",
    [
        (_fields(type=b"exploded"), "type", "unknown event kind"),
        (_fields(v=b"3"), "v", "unknown schema version 3"),
        (_fields(v=b"one"), "v", "decimal integer"),
        (_fields(seq=None), "seq", "missing header"),
        (_fields(data=b"\xc1\xc1"), "data", "not decodable"),
        (_fields(data=msgpack.packb([1, 2])), "data", "expected a msgpack map"),
        (
            _fields(data=msgpack.packb({"episode_id": "e", "group_id": "g", "index": 0, "sampling": {}})),
            "data.prompt_ids",
            "missing",
        ),
        (
            _fields(
                data=msgpack.packb(
                    {"episode_id": "e", "group_id": "g", "index": "zero", "prompt_ids": [], "sampling": {}}
                )
            ),
            "data.index",
            "expected int",
        ),
        (
            _fields(
                data=msgpack.packb(
                    {"episode_id": "e", "group_id": "g", "index": 0, "prompt_ids": b"abc", "sampling": {}}
                )
            ),
            "data.prompt_ids",
            "multiple of 4",
        ),
        (
            _fields(type=b"tokens", data=msgpack.packb({"ids": [1, 2], "logprobs": [0.0]})),
            "data.logprobs",
            "1 log-probs for 2 token ids",
        ),
    ],
)
def test_decode_names_entry_and_field(fields, field, words):
    fields = {k: v for k, v in fields.items() if v is not None}
    with pytest.raises(EventError) as err:
        decode(b"1700000000000-7", fields)
    assert err.value.entry_id == "1700000000000-7" and err.value.field == field
    assert words in str(err.value) and "1700000000000-7" in str(err.value)


def test_describe_lists_every_kind_and_field():
    text = describe()
    for kind, payload in KINDS.items():
        assert f"`{kind}`" in text
        for name in payload:
            assert f"`{name}`" in text


@given(
    ids=st.one_of(st.lists(u32, max_size=300), st.lists(st.integers(-(2**40), 2**40), max_size=4)),
    logprobs=st.lists(st.floats(allow_nan=False), max_size=300),
)
def test_short_lists_pack_to_the_same_bytes_as_numpy_and_refuse_the_same_ids(ids, logprobs):
    """pack_ids / pack_logprobs take a faster path for short lists: bytes identical to numpy's, a bad id refused."""
    import numpy as np

    from shared.protocol.episode.events import pack_ids, pack_logprobs

    try:
        expected = np.asarray(ids, dtype="<u4").tobytes()
    except OverflowError:
        with pytest.raises(OverflowError):
            pack_ids(ids)
    else:
        assert pack_ids(ids) == expected
    with np.errstate(over="ignore"):
        assert pack_logprobs(logprobs) == np.asarray(logprobs, dtype="<f4").tobytes()

"""Poison never crashes: every stream codec, fed random and adversarial entries, returns a value or raises EventError
naming the entry and the field (which the reader dead-letters and acknowledges), never anything else. Pure decode
functions, no Redis: >= 10,000 cases in all in CI (a quarter in a developer's run: tests/support/fuzz.py)."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol.episode import events
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold
from shared.protocol.streams import calls, control, dead_letters, metrics, prompts, pulls, repacks, samples, versions
from tests.support.fuzz import cases

# a value anywhere in an entry: what a writer without the schema could put there
SCALAR = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.sampled_from([float("nan"), float("inf"), "hot", "", "NaN", "-1", "1e400", 2**64])
)
VALUE = st.recursive(
    SCALAR,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=12)
            | st.sampled_from(
                [
                    "temperature",
                    "top_p",
                    "top_k",
                    "max_tokens",
                    "seed",
                    "stop_token_ids",
                    "prompt",
                    "prompt_ids",
                    "sampling",
                    "task",
                    "role",
                    "content",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=10,
)


def _field(v):
    """A stream entry's field value: bytes, as Redis returns it (msgpack for structured values)."""
    if isinstance(v, bytes):
        return v
    if isinstance(v, (dict, list)):
        try:
            return msgpack.packb(v, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return b"\xc1"
    return str(v).encode()


def entries(names: list[str]):
    """Entries with some of the codec's own field names (and stray ones), random values, sometimes a real-looking
    msgpack ``data`` map of random content."""
    keys = st.sampled_from(names + ["x", "data", "v"])
    plain = st.dictionaries(keys, VALUE.map(_field), max_size=len(names) + 2)
    data = st.dictionaries(
        st.sampled_from(
            [
                "prompt",
                "prompt_ids",
                "sampling",
                "task",
                "digest",
                "extends",
                "messages",
                "episode_id",
                "group_id",
                "index",
                "ids",
                "logprobs",
                "reward",
                "reason",
            ]
        ),
        VALUE,
        max_size=6,
    )
    with_data = st.tuples(plain, data).map(lambda p: {**p[0], "data": _field(p[1])})
    return plain | with_data


# stream -> (decode(entry_id, fields), field names its writers use)
CODECS = {
    "prompts": (prompts.decode_group, ["group_id", "n", "v", "data"]),
    "calls": (calls.decode_request, ["episode_id", "call", "v", "data"]),
    "control": (
        control.decode_entry,
        ["type", "cmd", "sync", "version", "path", "sha256", "url", "targets", "sources", "worker", "ok", "error"],
    ),
    "versions": (versions.decode, list(versions.FIELDS)),
    "samples": (samples.decode, ["group_id", "episodes", "worker", "n"]),
    "episode": (events.decode, ["type", "v", "policy", "worker", "seq", "data"]),
    "pulls": (pulls.decode, ["worker", "version", "source", "seconds", "kind"]),
    "repacks": (repacks.decode, list(repacks.FIELDS)),
    "metrics": (lambda _id, f: metrics.decode(f), ["kind", "json"]),
    "dead": (lambda _id, f: dead_letters.decode(f), list(dead_letters.FIELDS)),
}
# per codec: 11,000 in all in CI's deep fuzz pass (FUZZ_FULL=1), a tenth in ./dev test
CASES = cases(1100)


@pytest.mark.parametrize("stream", sorted(CODECS))
def test_every_codec_decodes_or_names_the_field(stream):
    decode, names = CODECS[stream]

    @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(fields=entries(names))
    def one(fields):
        try:
            decode("1-1", fields)
        except EventError as exc:
            assert exc.entry_id == "1-1" and exc.field

    one()


@pytest.mark.parametrize("bad", ["hot", float("nan"), float("inf"), -1.0, True, None, [1]])
def test_a_prompt_or_call_with_bad_temperature_is_an_error_naming_the_field(bad):
    group = prompts.encode_group(prompts.PromptGroup("g", 2, prompt="1+1=", sampling={"temperature": bad}))
    with pytest.raises(EventError, match=r"data\.sampling\.temperature"):
        prompts.decode_group("1-1", group)
    req = {
        "episode_id": "e-0",
        "call": "0",
        "v": "1",
        "data": msgpack.packb(
            {
                "digest": "d",
                "extends": -1,
                "prompt_ids": [1, 2],
                "sampling": {"max_tokens": 4, "temperature": bad},
                "messages": "",
            }
        ),
    }
    with pytest.raises(EventError, match=r"data\.sampling\.temperature"):
        calls.decode_request("1-2", req)
    with pytest.raises(EventError, match=r"data\.sampling\.bogus"):
        prompts.decode_group(
            "1-3", prompts.encode_group(prompts.PromptGroup("g", 1, prompt="x", sampling={"bogus": 1}))
        )


@pytest.mark.parametrize("key", ["stop", "stop_kept"])
@pytest.mark.parametrize("bad", ["abc", [""], ["x" * 257], ["a", "b", "c", "d", "e"], [1], None])
def test_a_call_with_bad_stop_strings_is_an_error_naming_the_field(key, bad):
    def request(value) -> dict:
        data = {"digest": "d", "extends": -1, "prompt_ids": [1], "sampling": {"max_tokens": 4, key: value}}
        return {"episode_id": "e-0", "call": "0", "v": "1", "data": msgpack.packb(data)}

    with pytest.raises(EventError, match=rf"data\.sampling\.{key}"):
        calls.decode_request("1-1", request(bad))
    assert calls.decode_request("1-2", request(["</tool_call>", "x" * 256])).sampling[key][1] == "x" * 256


def test_an_episode_with_a_nan_reward_does_not_fold():
    ev = events.Event(
        "started",
        0,
        "w",
        0,
        {
            "episode_id": "e",
            "group_id": "g",
            "index": 0,
            "prompt_ids": [1],
            "sampling": {"temperature": 1.0},
            "task": {},
        },
    )
    done = events.Event("finished", 0, "w", 1, {"reason": "stop", "reward": math.nan})
    with pytest.raises(EventError, match="finite"):
        fold([("1-1", events.encode(ev)), ("1-2", events.encode(done))])

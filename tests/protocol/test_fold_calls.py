"""Schema v2: agent episodes fold into training rows (linear chains, forks); v1 streams still fold."""

import msgpack
import pytest

from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import Event
from shared.protocol.episode.fold import PROMPT_VERSION, fold
from tests.support.helpers import raw


def agent_started():
    return Event(
        "started",
        0,
        "runner",
        0,
        {
            "episode_id": "e1",
            "group_id": "g1",
            "index": 0,
            "prompt_ids": [],
            "sampling": {"temperature": 1.0},
            "task": {},
            "agent": "m:f",
        },
    )


def call(seq, index, extends, ids, policy=0, worker="w"):
    return Event(
        "call",
        policy,
        worker,
        seq,
        {"call": index, "extends": extends, "prompt_ids": ids, "digest": f"d{index}", "sampling": {"max_tokens": 8}},
    )


def toks(seq, index, ids, policy=0, worker="w"):
    return Event("tokens", policy, worker, seq, {"ids": ids, "logprobs": [-0.5] * len(ids), "call": index})


def done(seq, index, n, worker="w"):
    return Event("call_done", 0, worker, seq, {"call": index, "reason": "stop", "num_tokens": n})


def finished(seq, reward=1.0):
    return Event("finished", 1, "runner", seq, {"reason": "stop", "reward": reward})


def test_linear_chain_is_one_sequence_with_bridges_masked_and_versions_per_token():
    evs = [
        agent_started(),
        call(1, 0, -1, [1, 2, 3]),
        toks(2, 0, [10, 11]),
        Event("aborted", 0, "w", 3, {"reason": "pause", "num_tokens": 2, "call": 0}),
        Event("resumed", 1, "w", 4, {"num_tokens": 2, "call": 0}),
        toks(5, 0, [12], policy=1),
        done(6, 0, 3),
        call(7, 1, 0, [4, 5], policy=1),
        toks(8, 1, [13, 14], policy=1),
        done(9, 1, 2),
        finished(10),
    ]
    ep = fold(raw(evs))
    assert ep.agent == "m:f" and ep.status == "finished" and not ep.branches
    assert ep.calls[1].prompt_ids == [1, 2, 3, 10, 11, 12, 4, 5]
    assert ep.prompt_ids == [1, 2, 3]
    assert ep.tokens == [10, 11, 12, 4, 5, 13, 14]
    assert ep.mask == [1, 1, 1, 0, 0, 1, 1]
    assert ep.versions == [0, 0, 1, PROMPT_VERSION, PROMPT_VERSION, 1, 1]
    assert ep.logprobs == [-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert ep.calls[0].aborts[0]["num_tokens"] == 2 and ep.calls[0].resumes[0]["version"] == 1
    assert ep.num_generated == 5
    # the trained sequence is, token for token, the prompt every call saw plus what it generated
    assert ep.prompt_ids + ep.tokens == ep.calls[1].prompt_ids + ep.calls[1].tokens


def test_the_stop_string_that_ended_a_call_is_kept_and_older_streams_have_none():
    ended = Event("call_done", 0, "w", 3, {"call": 0, "reason": "stop", "num_tokens": 2, "stop": "ab"})
    ep = fold(raw([agent_started(), call(1, 0, -1, [1, 2]), toks(2, 0, [10, 11]), ended]))
    assert ep.calls[0].stop_string == "ab" and ep.calls[0].reason == "stop"
    ep = fold(raw([agent_started(), call(1, 0, -1, [1, 2]), toks(2, 0, [10, 11]), done(3, 0, 2)]))
    assert ep.calls[0].stop_string is None
    bad = Event("call_done", 0, "w", 3, {"call": 0, "reason": "stop", "num_tokens": 2, "stop": 5})
    with pytest.raises(EventError, match=r"data\.stop"):
        fold(raw([agent_started(), call(1, 0, -1, [1, 2]), toks(2, 0, [10, 11]), bad]))


def test_a_fork_trains_each_chain_as_its_own_row_with_the_episode_reward():
    evs = [
        agent_started(),
        call(1, 0, -1, [1, 2]),
        toks(2, 0, [10]),
        done(3, 0, 1),
        # history rewritten: a fork
        call(4, 1, -1, [7, 8, 9]),
        toks(5, 1, [11, 12]),
        done(6, 1, 2),
        finished(7, reward=0.5),
    ]
    ep = fold(raw(evs))
    assert [r.prompt_ids for r in ep.rows] == [[7, 8, 9], [1, 2]]
    assert [r.tokens for r in ep.rows] == [[11, 12], [10]]
    assert [r.reward for r in ep.rows] == [0.5, 0.5]


def test_call_events_are_checked():
    with pytest.raises(EventError, match="no call 3"):
        fold(raw([agent_started(), toks(1, 3, [1])]))
    with pytest.raises(EventError, match="not a complete call"):
        fold(raw([agent_started(), call(1, 0, -1, [1]), call(2, 1, 0, [2])]))
    with pytest.raises(EventError, match="holds 1"):
        fold(raw([agent_started(), call(1, 0, -1, [1]), toks(2, 0, [5]), done(3, 0, 2)]))
    with pytest.raises(EventError, match="opened twice"):
        fold(raw([agent_started(), call(1, 0, -1, [1]), call(2, 0, -1, [1])]))


def test_version_1_entries_still_fold_and_cannot_hold_calls():
    ((eid, f),) = raw([call(1, 0, -1, [1])])
    f[b"v"] = b"1"
    with pytest.raises(EventError, match="needs schema version 2"):
        fold([raw([agent_started()])[0], (eid, {**f, b"seq": b"1"})])
    v1 = [
        (
            b"1-0",
            {
                b"type": b"started",
                b"v": b"1",
                b"policy": b"0",
                b"worker": b"w",
                b"seq": b"0",
                b"data": msgpack.packb(
                    {"episode_id": "e", "group_id": "g", "index": 0, "prompt_ids": [1], "sampling": {}}
                ),
            },
        ),
        (
            b"2-0",
            {
                b"type": b"tokens",
                b"v": b"1",
                b"policy": b"0",
                b"worker": b"w",
                b"seq": b"1",
                b"data": msgpack.packb({"ids": [3], "logprobs": [-1.0]}),
            },
        ),
    ]
    ep = fold(v1)
    assert ep.tokens == [3] and ep.calls == {} and ep.rows == [ep]


def test_replay_shows_an_agent_episode_call_by_call():
    from services.ops.inspect.views import format_timeline, timeline_json

    evs = [
        agent_started(),
        call(1, 0, -1, [1, 2]),
        toks(2, 0, [10]),
        Event("aborted", 0, "w", 3, {"reason": "pause", "num_tokens": 1, "call": 0}),
        Event("resumed", 1, "w2", 4, {"num_tokens": 1, "call": 0, "takeover_from": "w"}),
        done(5, 0, 1),
        call(6, 1, 0, [4]),
        toks(7, 1, [11]),
        done(8, 1, 1),
        call(9, 2, -1, [7]),
        toks(10, 2, [12]),
        done(11, 2, 1),
        finished(12),
    ]
    ep = fold(raw(evs))
    text = format_timeline(ep, decode_text=lambda ids: "".join(chr(97 + i % 26) for i in ids))
    assert "call 0: pause at 1 tokens" in text and "call 0: at 1 tokens, takeover from w" in text
    assert "agent m:f: 3 calls, 2 training row(s) (1 forked)" in text
    assert "call 1: extends call 0 + 1 masked tokens" in text and "call 2: fork: whole prompt" in text
    assert [c["index"] for c in timeline_json(ep)["calls"]] == [0, 1, 2]


def test_each_row_trains_under_the_sampling_its_calls_used_not_the_started_events():
    """The agent asked for temperature 0.7 / top_p 0.9 on its first chain and 0.3 on a second (a new chain: the
    gateway never extends across a change of transform): each row carries its own calls' transform."""
    first = call(1, 0, -1, [1, 2])
    first.data["sampling"] = {"max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 0}
    second = call(4, 1, -1, [7, 8, 9])
    second.data["sampling"] = {"max_tokens": 8, "temperature": 0.3, "top_p": 1.0, "top_k": 5}
    evs = [
        agent_started(),
        first,
        toks(2, 0, [10]),
        done(3, 0, 1),
        second,
        toks(5, 1, [11]),
        done(6, 1, 1),
        finished(7),
    ]
    ep = fold(raw(evs))
    # the main row: the last chain
    assert (ep.sampling["temperature"], ep.sampling["top_k"]) == (0.3, 5)
    (branch,) = ep.branches
    assert (branch.sampling["temperature"], branch.sampling["top_p"]) == (0.7, 0.9)

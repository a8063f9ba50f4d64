"""Hypothesis properties (issue 17): fold over generated episodes and their mutations, every stream codec
round-tripping through a real server, the trainer batch's alignment around tool tokens, and the checker's
counts under one injected fault.

Expectations are computed here, from what the generators meant, never by calling the code under test."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol.events import Event, EventError
from shared.protocol.fold import fold
from tests.helpers import raw

FIXTURES = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=25)

logprob = st.floats(-30.0, 0.0, width=32)  # float32 values survive the "<f4" packing exactly
names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1, max_size=10)


# ---------------------------------------------------------------------------------------------------------------
# 1. fold over generated valid episodes, and over the same episodes with one entry dropped, doubled or swapped

gen_step = st.tuples(st.just("gen"), st.lists(st.tuples(st.integers(0, 2**32 - 1), logprob), min_size=1, max_size=6))
pause_step = st.tuples(st.just("pause"), st.sampled_from(["pause", "shutdown", "debug"]), st.integers(0, 2))
tool_step = st.tuples(st.just("tool"), st.lists(st.integers(0, 2**32 - 1), max_size=4), st.booleans())


@st.composite
def episodes(draw):
    """(events of a valid finished episode, the tokens/logprobs/versions/mask it must fold to)."""
    prompt = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=5))
    evs = [Event("started", 0, "w0", 0, {"episode_id": "e1", "group_id": "g1", "index": 0, "prompt_ids": prompt,
                                          "sampling": {"max_tokens": 64}, "task": {}})]
    want = {"tokens": [], "logprobs": [], "versions": [], "mask": []}
    policy, worker = 0, "w0"
    for i, step in enumerate(draw(st.lists(st.one_of(gen_step, pause_step, tool_step), max_size=8))):
        seq = len(evs)
        if step[0] == "gen":
            ids, lps = [t for t, _ in step[1]], [lp for _, lp in step[1]]
            evs.append(Event("tokens", policy, worker, seq, {"ids": ids, "logprobs": lps}))
            want["tokens"] += ids
            want["logprobs"] += lps
            want["versions"] += [policy] * len(ids)
            want["mask"] += [1] * len(ids)
        elif step[0] == "pause":  # aborted at the stream's length, resumed there under a newer (or same) policy
            n = len(want["tokens"])
            evs.append(Event("aborted", policy, worker, seq, {"reason": step[1], "num_tokens": n}))
            policy, worker = policy + step[2], f"w{i}"
            evs.append(Event("resumed", policy, worker, seq + 1, {"num_tokens": n}))
        else:
            call_id = f"c{i}"
            evs.append(Event("tool_call", policy, worker, seq, {"call_id": call_id, "name": "calc", "args": "1+1"}))
            evs.append(Event("tool_result", policy, worker, seq + 1,
                             {"call_id": call_id, "ok": step[2], "output": "2", "ids": step[1]}))
            want["tokens"] += step[1]
            want["logprobs"] += [0.0] * len(step[1])
            want["versions"] += [-1] * len(step[1])
            want["mask"] += [0] * len(step[1])
    evs.append(Event("finished", policy, worker, len(evs), {"reason": "stop", "reward": 0.5, "details": {}}))
    return evs, want


@settings(max_examples=60, deadline=None)
@given(episodes())
def test_fold_of_a_generated_episode_gives_the_tokens_versions_logprobs_and_mask_it_was_built_from(episode):
    evs, want = episode
    ep = fold(raw(evs))
    assert (ep.tokens, ep.logprobs, ep.versions, ep.mask) == \
        (want["tokens"], want["logprobs"], want["versions"], want["mask"])
    assert ep.status == "finished" and ep.reward == 0.5 and ep.last_seq == len(evs) - 1
    assert len(ep.aborts) == len(ep.resumes) == sum(e.kind == "aborted" for e in evs)
    assert not ep.pending_tool_calls and ep.num_generated == sum(want["mask"])


@st.composite
def mutated(draw):
    """(a valid episode with one entry dropped, doubled or two neighbours swapped, index of the entry fold must
    name in it, the seq that entry carries, 'gap' or 'duplicate')."""
    evs, _ = draw(episodes())
    kind = draw(st.sampled_from(["drop", "double", "swap"]))
    if kind == "drop":  # any entry but the last (a stream cut short at its end is a running episode, not an error)
        i = draw(st.integers(0, len(evs) - 2))
        return evs[:i] + evs[i + 1:], i, evs[i + 1].seq, "gap"  # the entry after the hole
    if kind == "double":
        i = draw(st.integers(0, len(evs) - 1))
        return evs[:i + 1] + [evs[i]] + evs[i + 1:], i + 1, evs[i].seq, "duplicate"  # the copy, not the original
    i = draw(st.integers(0, len(evs) - 2))
    return evs[:i] + [evs[i + 1], evs[i]] + evs[i + 2:], i, evs[i + 1].seq, "gap"  # the one that came forward


@settings(max_examples=100, deadline=None)
@given(mutated())
def test_fold_names_the_entry_after_a_dropped_one_the_copy_of_a_doubled_one_and_the_first_of_a_swapped_pair(case):
    evs, index, seq, problem = case
    entries = raw(evs)  # ids in stream order, as XRANGE gives them after the mutation
    with pytest.raises(EventError) as err:
        fold(entries)
    assert err.value.entry_id == entries[index][0].decode()
    assert err.value.field == "seq" and err.value.problem == f"{problem}: expected {index}, got {seq}"

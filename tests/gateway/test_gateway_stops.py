"""Stop strings, tool_choice and parallel_tool_calls end to end: a stock `openai` client, the in-process gateway
and a real rollout worker (a subprocess) serving the scripted chat model, whose greedy answers are known text. The
calls end where the strings are completed (across a weight sync too), the answers are cut or forced as asked, and
every next turn extends the exact ids that were sampled."""

from __future__ import annotations

import threading
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from services.gateway.chat import template_messages
from tests.support.chat_models import CALC_TOOL, calc_conversation, scripted_chat_model
from tests.support.gateway_stack import episode, live_stack, start_agent_episode
from tests.support.procs import wait_until
from tests.support.rollout_harness import acks, send

pytestmark = [pytest.mark.slow(seconds=90), pytest.mark.timeout(600)]
CONV = calc_conversation(2, 3)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return scripted_chat_model(tmp_path_factory.mktemp("chat"), [(CONV, [CALC_TOOL])])


@pytest.fixture(scope="module")
def stack(chat_dir, redis_server):
    """One run: a rollout worker (slowed, so that a sync lands mid-call) and an in-process gateway, greedy."""
    with live_stack(redis_server.url, chat_dir, "gw-stops", "rs1", step_delay_ms=40) as stack:
        yield {**stack, "tok": AutoTokenizer.from_pretrained(chat_dir)}


def api(stack, eid: str) -> openai.OpenAI:
    start_agent_episode(stack["client"], stack["keys"], eid)
    return openai.OpenAI(base_url=stack["gw"].base_url(eid), api_key="test", max_retries=5)


def turn(tok, k: int) -> str:
    """The scripted model's k-th assistant turn as text (what greedy decoding writes after the prompt)."""
    before = tok.apply_chat_template(
        template_messages(CONV[:k]), tools=[CALC_TOOL], add_generation_prompt=True, tokenize=False
    )
    upto = tok.apply_chat_template(template_messages(CONV[: k + 1]), tools=[CALC_TOOL], tokenize=False)
    return upto[len(before) :].split("<|im_end|>")[0]


def test_a_multi_token_stop_string_ends_the_call_the_answer_is_cut_and_the_next_turn_extends_it(stack):
    client, keys, tok = stack["client"], stack["keys"], stack["tok"]
    oai = api(stack, "stop-0")
    text = turn(tok, 5)
    assert text == "answer: 5"
    history = CONV[:5]
    # streamed: the deltas never show the stop string, nor its first character while it may be starting
    stream = oai.chat.completions.create(
        model="policy", messages=history, tools=[CALC_TOOL], stop=[": 5", "never"], stream=True
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "answer" and chunks[-1].choices[0].finish_reason == "stop"
    # the same ask again (a new ask: its own call), whole: the same answer
    whole = oai.chat.completions.create(model="policy", messages=history, tools=[CALC_TOOL], stop=[": 5", "never"])
    assert whole.choices[0].message.content == "answer" and whole.choices[0].finish_reason == "stop"
    ep = episode(client, keys, "stop-0")
    call = ep.calls[whole.streamrl["call"]]
    # logged up to the token that completed the string, nothing after
    done = tok.decode(call.tokens, skip_special_tokens=True)
    assert call.stop_string == ": 5" and call.reason == "stop" and done.endswith(": 5")
    assert ": 5" not in tok.decode(call.tokens[:-1], skip_special_tokens=True)
    # the next turn sends back the cut answer: it extends the call's exact ids
    nxt = oai.chat.completions.create(
        model="policy",
        messages=history + [{"role": "assistant", "content": "answer"}, {"role": "user", "content": "ok"}],
        tools=[CALC_TOOL],
        max_tokens=4,
    )
    ep = episode(client, keys, "stop-0")
    child = ep.calls[nxt.streamrl["call"]]
    assert child.extends == call.index
    assert child.prompt_ids[: len(call.prompt_ids) + len(call.tokens)] == call.prompt_ids + call.tokens
    # the completions API cuts the same way
    comp = oai.completions.create(model="policy", prompt=call.prompt_ids, stop=["wer"], max_tokens=12)
    assert comp.choices[0].text == "ans" and comp.choices[0].finish_reason == "stop"


def test_a_stop_string_straddling_a_weight_sync_still_ends_the_call(stack):
    client, keys, tok = stack["client"], stack["keys"], stack["tok"]
    oai = api(stack, "straddle-0")
    text = turn(tok, 1)
    start = text.index("calc")
    stop_string = text[start : start + 24]
    out = {}
    t = threading.Thread(
        target=lambda: out.update(
            r=oai.chat.completions.create(model="policy", messages=CONV[:1], tools=[CALC_TOOL], stop=[stop_string])
        ),
        daemon=True,
    )
    t.start()

    def logged() -> str:
        call = episode(client, keys, "straddle-0").calls.get(0)
        return tok.decode(call.tokens, skip_special_tokens=True) if call else ""

    # the abort lands inside the stop string: part of it logged before the sync, the rest after
    wait_until(lambda: len(logged()) >= start + 2, what="call 0 inside the stop string", poll=0.01)
    send(client, keys, "pause", sync="s-stop")
    wait_until(lambda: acks(client, keys, "pause"), what="pause ack")
    send(client, keys, "load", sync="s-stop", version=1, path=str(Path(stack["dir"]) / "model.safetensors"))
    wait_until(lambda: acks(client, keys, "load"), what="load ack")
    send(client, keys, "resume", sync="s-stop")
    t.join(timeout=120)
    call = episode(client, keys, "straddle-0").calls[0]
    at_abort = tok.decode(call.tokens[: call.aborts[0]["num_tokens"]], skip_special_tokens=True)
    assert start < len(at_abort) < start + len(stop_string), (at_abort, stop_string)
    assert call.resumes and set(call.versions) == {0, 1}
    assert call.stop_string == stop_string and tok.decode(call.tokens, skip_special_tokens=True) == text[: start + 24]
    answer = out["r"].choices[0]
    assert answer.message.content == text[:start] and answer.finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calc"}}])
def test_a_forced_tool_call_is_prefilled_and_the_next_turn_extends_its_exact_ids(stack, choice):
    client, keys, tok = stack["client"], stack["keys"], stack["tok"]
    eid = f"forced-{0 if choice == 'required' else 1}"
    oai = api(stack, eid)
    first = oai.chat.completions.create(model="policy", messages=CONV[:1], tools=[CALC_TOOL], tool_choice=choice)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("calc", '{"e": "2+3"}')]
    ep = episode(client, keys, eid)
    c0 = ep.calls[0]
    opening = tok.decode(c0.prompt_ids).rsplit("<|im_start|>assistant\n", 1)[1]
    # the prefill is prompt-side (never sampled): the completion is the rest of the call
    assert opening.startswith("<tool_call>") and "<tool_call>" not in tok.decode(c0.tokens)
    assert opening + tok.decode(c0.tokens, skip_special_tokens=True) == turn(tok, 1)
    # the agent sends the answer back with the tool's result: the next call extends call 0's exact ids
    back = {"role": "assistant", "content": message.content, "tool_calls": [c.model_dump() for c in message.tool_calls]}
    second = oai.chat.completions.create(
        model="policy", messages=[*CONV[:1], back, CONV[2]], tools=[CALC_TOOL], max_tokens=8
    )
    c1 = episode(client, keys, eid).calls[second.streamrl["call"]]
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + len(c0.tokens)] == c0.prompt_ids + c0.tokens


def test_parallel_tool_calls_false_ends_the_call_at_the_first_tool_calls_close(stack):
    client, keys, tok = stack["client"], stack["keys"], stack["tok"]
    oai = api(stack, "single-0")
    r = oai.chat.completions.create(model="policy", messages=CONV[:1], tools=[CALC_TOOL], parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    c0 = episode(client, keys, "single-0").calls[0]
    # exactly what was sampled: up to the closing tag, not the end-of-turn token that would have followed
    assert c0.stop_string == "</tool_call>" and tok.decode(c0.tokens) == turn(tok, 1)
    back = {
        "role": "assistant",
        "content": None,
        "tool_calls": [c.model_dump() for c in r.choices[0].message.tool_calls],
    }
    nxt = oai.chat.completions.create(
        model="policy", messages=[*CONV[:1], back, CONV[2]], tools=[CALC_TOOL], max_tokens=4
    )
    c1 = episode(client, keys, "single-0").calls[nxt.streamrl["call"]]
    # the turn was cut before its end token: the bridge closes it
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + len(c0.tokens) + 1] == [
        *c0.prompt_ids,
        *c0.tokens,
        stack["tok"].convert_tokens_to_ids("<|im_end|>"),
    ]

"""Anthropic Messages end to end: the stock `anthropic` client against the gateway, a real rollout worker
(subprocess), a scripted chat model that really calls the calculator; a weight sync under a streamed call, and a
gateway killed -9 under one."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import pytest
from transformers import AutoTokenizer

from services.gateway.chat import template_messages
from tests.gateway.test_gateway import call_tokens, describe, in_thread
from tests.support.chat_models import CALC_TOOL, calc_conversation, scripted_chat_model
from tests.support.gateway_agents import ANTHROPIC_CALC_TOOL, anthropic_calc_agent
from tests.support.gateway_stack import (
    episode,
    gateway_killed_under_a_streamed_agent,
    live_stack,
    start_agent_episode,
)
from tests.support.procs import wait_until
from tests.support.rollout_harness import acks, send

pytestmark = [pytest.mark.slow(seconds=90), pytest.mark.timeout(900)]
TASK = {"question": "2+3?", "answer": "5"}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return scripted_chat_model(tmp_path_factory.mktemp("chat"), [(calc_conversation(2, 3), [CALC_TOOL])])


@pytest.fixture(scope="module")
def stack(chat_dir, redis_server):
    """One run: a rollout worker (slowed a little, so a sync can land mid-call) and an in-process gateway."""
    with live_stack(redis_server.url, chat_dir, "gw-messages", "rwm", step_delay_ms=20) as stack:
        yield stack


class _Base:
    """What the runner hands an agent: an openai-like client's base_url and api_key."""

    def __init__(self, base_url: str, api_key: str = "test"):
        self.base_url, self.api_key = base_url, api_key


def messages_api(base_url: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="test", **kw)


def assert_exact(stack, eid: str) -> None:
    """Three calls, each extending the one before; the one training row is exactly the generated ids, in the
    same ids as a full render of the conversation (never re-tokenized)."""
    ep = episode(stack["client"], stack["keys"], eid)
    assert [ep.calls[i].extends for i in range(3)] == [-1, 0, 1] and not ep.branches, describe(ep)
    generated = [t for i in range(3) for t in ep.calls[i].tokens]
    assert ep.prompt_ids + ep.tokens == ep.calls[2].prompt_ids + ep.calls[2].tokens
    assert [t for t, m in zip(ep.tokens, ep.mask) if m] == generated
    tok = AutoTokenizer.from_pretrained(stack["dir"])
    rendered = tok.apply_chat_template(template_messages(calc_conversation(2, 3)), tools=[CALC_TOOL], tokenize=False)
    assert tok.decode(ep.prompt_ids + ep.tokens) + "\n" == rendered


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_anthropic_client_runs_a_two_turn_tool_episode_on_exactly_the_generated_ids(stack, stream):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    eid = f"msg-{int(stream)}"
    start_agent_episode(client, keys, eid, TASK)
    out = anthropic_calc_agent(_Base(gw.base_url(eid)), TASK, stream=stream)
    assert out == {"reward": 1.0, "details": {"turns": 3, "answer": "answer: 5", "stop_reason": "end_turn"}}
    assert_exact(stack, eid)


def test_a_retry_gets_the_same_message_and_tool_use_ids_and_generates_nothing(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "msg-retry", TASK)
    api = messages_api(gw.base_url("msg-retry"))
    ask = dict(
        model="policy",
        max_tokens=96,
        messages=[{"role": "user", "content": "2+3?"}],
        tools=[ANTHROPIC_CALC_TOOL],
        extra_body={"temperature": 0},
        metadata={"user_id": "u1"},
        extra_headers={"anthropic-version": "2023-06-01"},
    )
    first = api.messages.create(**ask)
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert [(b.type, b.name, b.input) for b in first.content] == [("tool_use", "calc", {"e": "2+3"})]
    call = episode(client, keys, "msg-retry").calls[0]
    assert first.usage.input_tokens == len(call.prompt_ids) and first.usage.output_tokens == len(call.tokens)
    again = api.messages.create(**{**ask, "extra_headers": {"x-stainless-retry-count": "1"}})
    assert again.model_dump() == first.model_dump() and first.content[0].id == f"toolu_{call.index}_0"
    # the retry was answered from the stream
    assert client.hget(keys.call_index("msg-retry"), "#n") == b"1"
    # streamed (create(stream=True), raw events), a retry of the same call: the same answer as events
    events = list(api.messages.create(stream=True, **{**ask, "extra_headers": {"x-stainless-retry-count": "2"}}))
    assert [e.type for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0].message.id == first.id and events[0].message.usage.input_tokens == len(call.prompt_ids)
    assert events[1].content_block.id == first.content[0].id and events[2].delta.type == "input_json_delta"
    assert json.loads(events[2].delta.partial_json) == {"e": "2+3"}
    assert events[4].delta.stop_reason == "tool_use" and events[4].usage.output_tokens == len(call.tokens)
    assert client.hget(keys.call_index("msg-retry"), "#n") == b"1"


def test_a_weight_sync_under_a_streamed_messages_call_gives_one_complete_answer_on_exact_ids(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "msg-sync", TASK)
    t, out = in_thread(lambda: anthropic_calc_agent(_Base(gw.base_url("msg-sync")), TASK, stream=True))
    wait_until(lambda: call_tokens(client, keys, "msg-sync", 0) >= 4, what="call 0 generating")
    n_pause, n_load = len(acks(client, keys, "pause")), len(acks(client, keys, "load"))
    send(client, keys, "pause", sync="ms1")
    wait_until(lambda: len(acks(client, keys, "pause")) > n_pause, what="pause ack")
    send(client, keys, "load", sync="ms1", version=3, path=str(Path(stack["dir"]) / "model.safetensors"))
    wait_until(lambda: len(acks(client, keys, "load")) > n_load, what="load ack")
    send(client, keys, "resume", sync="ms1")
    t.join(timeout=120)
    assert out["result"]["reward"] == 1.0, describe(episode(client, keys, "msg-sync"))
    c0 = episode(client, keys, "msg-sync").calls[0]
    assert c0.aborts and c0.aborts[0]["reason"] == "pause" and c0.resumes and 3 in c0.versions
    assert_exact(stack, "msg-sync")


def test_the_anthropic_example_agent_runs_against_the_gateway(stack):
    from examples.calc_anthropic import agent

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "msg-example", {"prompt": "2+3?", "answer": 5})
    assert agent(_Base(gw.base_url("msg-example")), {"prompt": "2+3?", "answer": 5})["reward"] == 1.0
    ep = episode(client, keys, "msg-example")
    assert len(ep.calls) == 3 and not ep.branches


def test_a_gateway_killed_under_a_streamed_messages_call_reruns_the_agent_and_the_episode_finishes(stack, chat_dir):
    """The anthropic client does not retry a stream that breaks: the agent raises, the runner sees a lost gateway
    (httpx's transport error) and runs the agent again once a gateway answers; nothing is generated twice."""
    ep = gateway_killed_under_a_streamed_agent(
        stack, chat_dir, "tests.support.gateway_agents:streamed_anthropic_calc_agent", "msgkill", TASK
    )
    assert sorted(ep.calls) == [0, 1, 2]


def test_a_named_tool_choice_is_prefilled_and_a_multi_token_stop_sequence_ends_the_answer(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "msg-choice-0", TASK)
    api = messages_api(gw.base_url("msg-choice-0"))
    ask = [{"role": "user", "content": "2+3?"}]
    forced = api.messages.create(
        model="policy",
        max_tokens=96,
        messages=ask,
        tools=[ANTHROPIC_CALC_TOOL],
        tool_choice={"type": "tool", "name": "calc"},
        extra_body={"temperature": 0},
    )
    assert forced.stop_reason == "tool_use" and [b.name for b in forced.content if b.type == "tool_use"] == ["calc"]
    call = episode(client, keys, "msg-choice-0").calls[0]
    # the forced opening is prompt-side: logged as the call's prompt, never sampled
    tok = AutoTokenizer.from_pretrained(stack["dir"])
    assert tok.decode(call.prompt_ids).endswith('"name": "calc", "arguments": ')
    assert '"name"' not in tok.decode(call.tokens)
    # a stop sequence of several tokens: the call ends at the token completing it, the text is cut before it
    cut = api.messages.create(
        model="policy",
        max_tokens=96,
        messages=ask,
        tools=[ANTHROPIC_CALC_TOOL],
        stop_sequences=['"calc"'],
        extra_body={"temperature": 0},
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == '"calc"'
    text = "".join(b.text for b in cut.content if b.type == "text")
    call = episode(client, keys, "msg-choice-0").calls[1]
    full = tok.decode(call.tokens, skip_special_tokens=True)
    assert full.endswith('"calc"') and text == full[: -len('"calc"')]

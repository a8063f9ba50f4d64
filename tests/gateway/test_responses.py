"""The Responses API (``/v1/responses``) end to end: the stock `openai` client and the OpenAI Agents SDK against a
real rollout worker, through weight syncs and a gateway killed -9 under a streamed call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from services.gateway.runner import _append_last
from services.trainer.batch import build_batch
from shared.protocol.episode.log import EpisodeLog
from tests.support.chat_models import CALC_TOOL, calc_conversation, scripted_chat_model
from tests.support.gateway_agents import RESPONSES_CALC_TOOL, responses_calc_agent, responses_turn
from tests.support.gateway_stack import (
    episode,
    gateway_killed_under_a_streamed_agent,
    live_stack,
    start_agent_episode,
)
from tests.support.procs import wait_until
from tests.support.rollout_harness import acks, send

pytestmark = [pytest.mark.slow(seconds=15), pytest.mark.timeout(900)]
TASK = {"question": "2+3?", "answer": "5"}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return scripted_chat_model(tmp_path_factory.mktemp("chat"), [(calc_conversation(2, 3), [CALC_TOOL])])


@pytest.fixture(scope="module")
def stack(chat_dir, redis_server):
    """One run: a rollout worker (slowed a little, so a sync can land mid-call) and an in-process gateway."""
    with live_stack(redis_server.url, chat_dir, "gw-responses", "rr1", step_delay_ms=20) as stack:
        yield stack


def oai(base_url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="test", **kw)


def assert_one_exact_chain(stack, eid: str, n: int = 3) -> None:
    """The episode's calls extend each other, and its one training row trains on exactly the generated ids."""
    client, keys = stack["client"], stack["keys"]
    ep = episode(client, keys, eid)
    assert [ep.calls[i].extends for i in range(n)] == list(range(-1, n - 1)) and not ep.branches, ep.calls
    generated = [t for i in range(n) for t in ep.calls[i].tokens]
    assert ep.prompt_ids + ep.tokens == ep.calls[n - 1].prompt_ids + ep.calls[n - 1].tokens
    assert [t for t, m in zip(ep.tokens, ep.mask) if m] == generated
    if ep.status != "finished":
        _append_last(EpisodeLog(client, keys, "test"), eid, "finished", {"reason": "stop", "reward": 1.0})
    ep = episode(client, keys, eid)
    batch = build_batch([[ep]], pad_id=0)
    assert batch.input_ids[0][: len(ep.prompt_ids) + len(ep.tokens)].tolist() == ep.prompt_ids + ep.tokens
    start = len(ep.prompt_ids) - 1
    targets = batch.targets[0][start : start + len(ep.tokens)].tolist()
    assert [t for t, m in zip(targets, ep.mask) if m] == generated


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_turns_of_function_call_output_extend_the_first_call_exactly(stack, stream):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    eid = f"resp-{'s' if stream else 'w'}-0"
    start_agent_episode(client, keys, eid, TASK)
    task = {**TASK, "stream": stream, "responses": []}
    out = responses_calc_agent(oai(gw.base_url(eid)), task)
    assert out == {"reward": 1.0, "details": {"answer": "answer: 5"}}
    first, _, last = task["responses"]
    assert [i.type for i in first.output] == ["function_call"] and first.status == "completed"
    assert first.output[0].name == "calc" and json.loads(first.output[0].arguments) == {"e": "2+3"}
    assert last.output[0].type == "message" and last.output_text == "answer: 5"
    ep = episode(client, keys, eid)
    assert first.usage.output_tokens == len(ep.calls[0].tokens)
    assert last.usage.input_tokens == len(ep.calls[2].prompt_ids)
    assert last.usage.input_tokens_details.cached_tokens == len(ep.calls[2].prompt_ids) - len(ep.calls[2].new_ids)
    if stream:
        events = last.streamrl_events
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "answer: 5"
        kinds = [e.type for e in first.streamrl_events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert_one_exact_chain(stack, eid)


def test_previous_response_id_extends_the_call_it_names_and_a_foreign_id_is_refused(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "prev-0", TASK)
    api = oai(gw.base_url("prev-0"))
    ask = dict(model="policy", tools=[RESPONSES_CALC_TOOL], temperature=0, max_output_tokens=96)
    reply = api.responses.create(input="2+3?", **ask)
    ids = [reply.id]
    for turn in range(2):
        [call] = [i for i in reply.output if i.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
        reply = responses_turn(api, previous_response_id=reply.id, input=[result], stream=turn == 1, **ask)
        ids.append(reply.id)
    assert reply.output_text == "answer: 5" and reply.previous_response_id == ids[1]
    assert len(set(ids)) == 3 and all(i.startswith(f"resp_{k}_") for k, i in enumerate(ids))
    assert_one_exact_chain(stack, "prev-0")
    start_agent_episode(client, keys, "prev-1", TASK)
    other = oai(gw.base_url("prev-1"))
    for wrong in (ids[0], "resp_0_0123456789abcdef", "nonsense"):
        with pytest.raises(openai.BadRequestError) as err:
            other.responses.create(previous_response_id=wrong, input="hi", **ask)
        assert err.value.body["param"] == "previous_response_id", err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        other.responses.create(input="hi", tools=[{"type": "web_search"}], model="policy")
    assert err.value.body["param"] == "tools[0].type"
    assert not episode(client, keys, "prev-1").calls


def _sdk_agent(base_url: str, responses: bool, sent: list):
    """The calc agent on the Agents SDK; the bodies its client sends are appended to ``sent``."""
    import httpx
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, function_tool

    @function_tool
    def calc(e: str) -> str:
        """evaluate"""
        return str(eval(e, {}, {}))

    async def record(request):
        sent.append(json.loads(request.content))

    sdk = openai.AsyncOpenAI(
        base_url=base_url, api_key="test", http_client=httpx.AsyncClient(event_hooks={"request": [record]})
    )
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    return Agent(
        name="calc",
        tools=[calc],
        model=kind(model="policy", openai_client=sdk),
        model_settings=ModelSettings(temperature=0, max_tokens=96),
    )


@pytest.mark.parametrize("how", ["responses", "responses-streamed", "responses-chained", "chat"])
def test_the_openai_agents_sdk_runs_an_exact_chain(stack, how):
    from agents import RunConfig, Runner

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    eid = f"sdk-{how}-0"
    start_agent_episode(client, keys, eid, TASK)
    sent = []
    agent = _sdk_agent(gw.base_url(eid), responses=how != "chat", sent=sent)
    config = RunConfig(tracing_disabled=True)
    if how == "responses-streamed":

        async def streamed():
            run = Runner.run_streamed(agent, "2+3?", run_config=config)
            async for _ in run.stream_events():
                pass
            return run

        result = asyncio.run(streamed())
    else:
        # chained: each call names the one before (previous_response_id) and sends only the new items
        chained = how == "responses-chained"
        result = Runner.run_sync(agent, "2+3?", run_config=config, auto_previous_response_id=chained)
    assert result.final_output == "answer: 5"
    if how == "responses-chained":
        ids = [r.response_id for r in result.raw_responses]
        assert [int(i.split("_")[1]) for i in ids] == [0, 1, 2]
        assert [b.get("previous_response_id") for b in sent] == [None, *ids[:2]]
        assert [[i["type"] for i in b["input"]] for b in sent[1:]] == [["function_call_output"]] * 2
    assert_one_exact_chain(stack, eid)


def test_a_weight_sync_under_a_streamed_response_gives_one_complete_answer_and_exact_ids(stack):
    import threading

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "rsync-0", TASK)
    out = {}
    t = threading.Thread(
        target=lambda: out.update(r=responses_calc_agent(oai(gw.base_url("rsync-0")), {**TASK, "stream": True})),
        daemon=True,
    )
    t.start()
    tokens = lambda: len(c.tokens) if (c := episode(client, keys, "rsync-0").calls.get(0)) else 0  # noqa: E731
    wait_until(lambda: tokens() >= 4, what="call 0 generating")
    n_pause, n_load = len(acks(client, keys, "pause")), len(acks(client, keys, "load"))
    send(client, keys, "pause", sync="rs1")
    wait_until(lambda: len(acks(client, keys, "pause")) > n_pause, what="pause ack")
    send(client, keys, "load", sync="rs1", version=3, path=str(Path(stack["dir"]) / "model.safetensors"))
    wait_until(lambda: len(acks(client, keys, "load")) > n_load, what="load ack")
    send(client, keys, "resume", sync="rs1")
    t.join(timeout=120)
    assert out["r"]["reward"] == 1.0
    c0 = episode(client, keys, "rsync-0").calls[0]
    assert c0.aborts and c0.aborts[0]["reason"] == "pause" and c0.resumes and 3 in c0.versions
    assert_one_exact_chain(stack, "rsync-0")


def test_a_gateway_killed_under_a_streamed_response_reruns_the_agent_and_the_episode_finishes(stack, chat_dir):
    ep = gateway_killed_under_a_streamed_agent(
        stack, chat_dir, "tests.support.gateway_agents:streamed_responses_calc_agent", "rgw", TASK
    )
    assert [ep.calls[i].extends for i in range(3)] == [-1, 0, 1]


def test_the_agents_sdk_example_runs_against_the_gateway(stack):
    from examples.calc_agents_sdk import agent

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "sdkex-0", {"prompt": "2+3?", "answer": 5})
    out = agent(oai(gw.base_url("sdkex-0")), {"prompt": "2+3?", "answer": 5})
    assert out["reward"] == 1.0, out
    ep = episode(client, keys, "sdkex-0")
    assert [ep.calls[i].extends for i in range(len(ep.calls))] == list(range(-1, len(ep.calls) - 1))


def test_a_response_cut_by_max_output_tokens_is_incomplete(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "cut-0", TASK)
    api = oai(gw.base_url("cut-0"))
    ask = dict(model="policy", input="2+3?", temperature=0, max_output_tokens=4)
    whole = api.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 4 and whole.output[0].type == "message"
    events = list(api.responses.create(stream=True, **ask))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.output_text == whole.output_text

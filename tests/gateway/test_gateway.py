"""The gateway end to end: a stock `openai` client, real rollout workers (subprocesses), real rq agents
workers, weight syncs and kill -9 of every process that serves a call."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from services.driver import agents as driver_agents
from services.gateway.__main__ import build
from services.gateway.asks import Asks
from services.gateway.chat import template_messages
from services.gateway.runner import _append_last
from services.trainer.batch import build_batch
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import Keys
from shared.protocol.streams import calls as calls_codec
from shared.protocol.streams import metrics
from shared.protocol.streams import samples as samples_codec
from shared.runtime import faults, logs
from shared.runtime.config.keys import Config
from tests.support.chat_models import CALC_TOOL, calc_conversation, scripted_chat_model
from tests.support.gateway_agents import calc_agent
from tests.support.gateway_stack import (
    InProcessGateway,
    env_for,
    episode,
    free_port,
    gateway_killed_under_a_streamed_agent,
    live_stack,
    start_agent_episode,
    wait_alive,
    wait_http,
)
from tests.support.procs import kill9, run_module, spawn, stop, wait_until
from tests.support.rollout_harness import acks, send

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TASK = {"question": "2+3?", "answer": "5"}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return scripted_chat_model(tmp_path_factory.mktemp("chat"), [(calc_conversation(2, 3), [CALC_TOOL])])


@pytest.fixture(scope="module")
def stack(chat_dir, redis_server):
    """One run: a rollout worker (slowed a little, so a sync can land mid-call) and an in-process gateway."""
    with live_stack(redis_server.url, chat_dir, "gw-stack", "rw1", step_delay_ms=20) as stack:
        yield stack


def oai(base_url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="test", **kw)


def in_thread(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn(*args)), daemon=True)
    t.start()
    return t, out


def describe(ep) -> str:
    return "\n".join(
        f"{e.seq} {e.kind} v{e.policy} {e.worker} "
        + str({k: (len(v) if isinstance(v, list) else v) for k, v in e.data.items() if k != "messages"})
        for e in ep.events
    )


def call_tokens(client, keys, eid, index):
    ep = episode(client, keys, eid)
    call = ep.calls.get(index)
    return len(call.tokens) if call else 0


def test_multi_turn_tool_episode_survives_a_weight_sync_and_trains_on_exactly_the_generated_ids(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "sync-0", TASK)
    t, out = in_thread(calc_agent, oai(gw.base_url("sync-0")), TASK)
    wait_until(lambda: call_tokens(client, keys, "sync-0", 0) >= 4, what="call 0 generating")
    send(client, keys, "pause", sync="s1")
    wait_until(lambda: acks(client, keys, "pause"), what="pause ack")
    send(client, keys, "load", sync="s1", version=1, path=str(Path(stack["dir"]) / "model.safetensors"))
    wait_until(lambda: acks(client, keys, "load"), what="load ack")
    send(client, keys, "resume", sync="s1")
    t.join(timeout=120)
    result = out["result"]
    ep = episode(client, keys, "sync-0")
    assert result == {"reward": 1.0, "details": {"turns": 3, "answer": "answer: 5"}}, describe(ep)
    c0 = ep.calls[0]
    assert c0.aborts and c0.aborts[0]["reason"] == "pause" and c0.resumes and set(c0.versions) == {0, 1}
    assert [ep.calls[i].extends for i in range(3)] == [-1, 0, 1] and not ep.branches
    # token exactness: the one training row is every call's exact prompt and completion ids
    generated = [t for i in range(3) for t in ep.calls[i].tokens]
    assert ep.prompt_ids + ep.tokens == ep.calls[2].prompt_ids + ep.calls[2].tokens
    assert [t for t, m in zip(ep.tokens, ep.mask) if m] == generated
    tok = AutoTokenizer.from_pretrained(stack["dir"])
    rendered = tok.apply_chat_template(template_messages(calc_conversation(2, 3)), tools=[CALC_TOOL], tokenize=False)
    # same as a full render, never re-tokenized
    assert tok.decode(ep.prompt_ids + ep.tokens) + "\n" == rendered
    _append_last(EpisodeLog(client, keys, "test"), "sync-0", "finished", {"reason": "stop", "reward": 1.0})
    batch = build_batch([[episode(client, keys, "sync-0")]], pad_id=0)
    row = batch.input_ids[0][: len(ep.prompt_ids) + len(ep.tokens)].tolist()
    assert row == ep.prompt_ids + ep.tokens
    # target index of the first response token
    start = len(ep.prompt_ids) - 1
    targets = batch.targets[0][start : start + len(ep.tokens)].tolist()
    # the trained positions: exactly these ids
    assert [t for t, m in zip(targets, ep.mask) if m] == generated
    # (greedy here: kept out of the loss, docs/training.md)
    assert batch.greedy_tokens == len(generated)


def test_streaming_deltas_and_a_retry_answered_from_the_stream(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "stream-0", TASK)
    api = oai(gw.base_url("stream-0"))
    body = dict(
        model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC_TOOL], temperature=0, max_tokens=96
    )
    chunks = list(api.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [c.function.name for c in calls] == ["calc"] and json.loads(calls[0].function.arguments) == {"e": "2+3"}
    assert chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the client's retry of the same request: answered from the stream
    again = api.chat.completions.create(**body, extra_headers={"x-stainless-retry-count": "1"})
    assert again.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments
    assert client.hget(keys.call_index("stream-0"), "#n") == b"1"
    assert again.usage.completion_tokens == chunks[-1].usage.completion_tokens


def _call_of(answer) -> int:
    return answer.model_extra["streamrl"]["call"]


def test_a_retry_is_answered_from_the_stream_a_deliberate_repeat_is_sampled_anew_and_a_rerun_finds_its_calls(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "ask-0", TASK)
    api = oai(gw.base_url("ask-0"))
    body = dict(model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC_TOOL], max_tokens=24)
    first = api.chat.completions.create(**body)
    retried = api.chat.completions.create(**body, extra_headers={"x-stainless-retry-count": "2"})
    # a second opinion: the same messages asked again on purpose
    second = api.chat.completions.create(**body)
    keyed = [api.chat.completions.create(**body, extra_headers={"Idempotency-Key": "k-1"}) for _ in range(2)]
    assert [_call_of(a) for a in (first, retried, second, *keyed)] == [0, 0, 1, 2, 2]
    assert client.hget(keys.call_index("ask-0"), "#n") == b"3"
    # the agent runner runs the agent again (a crash): its k-th identical ask is the k-th call, from the log
    Asks(client, keys).new_run("ask-0")
    rerun = [api.chat.completions.create(**body) for _ in range(2)]
    assert [_call_of(a) for a in rerun] == [0, 1] and client.hget(keys.call_index("ask-0"), "#n") == b"3"
    assert rerun[1].choices[0].message == second.choices[0].message


def test_n_choices_are_calls_of_their_own_and_each_chain_trains_as_its_own_row(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "n-0", TASK)
    api = oai(gw.base_url("n-0"))
    ask = [{"role": "user", "content": "2+3?"}]
    reply = api.chat.completions.create(model="policy", messages=ask, tools=[CALC_TOOL], n=3, temperature=1.0)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    calls = reply.model_extra["streamrl"]["calls"]
    assert len(set(calls)) == 3
    ep = episode(client, keys, "n-0")
    assert all(ep.calls[i].extends == -1 and ep.calls[i].prompt_ids == ep.calls[calls[0]].prompt_ids for i in calls)
    assert reply.usage.completion_tokens == sum(len(ep.calls[i].tokens) for i in calls)
    # the agent goes on from the second choice: that chain extends the second choice's call
    chosen = reply.choices[1].message
    follow = ask + [chosen.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
    api.chat.completions.create(model="policy", messages=follow, tools=[CALC_TOOL], temperature=1.0, max_tokens=8)
    ep = episode(client, keys, "n-0")
    last = max(ep.calls)
    # (identical choices are interchangeable: the newest that answered the chosen message is the parent)
    parent = ep.calls[last].extends
    assert parent in calls and ep.calls[parent].tokens == ep.calls[calls[1]].tokens
    assert len(ep.rows) == 3
    rows = sorted(tuple(r.prompt_ids + r.tokens) for r in ep.rows)
    chains = [ep.calls[i] for i in calls if i != parent] + [ep.calls[last]]
    assert rows == sorted(tuple(c.prompt_ids + c.tokens) for c in chains)
    # streamed: each choice's deltas under its index, then one usage chunk for all
    chunks = list(
        api.chat.completions.create(
            model="policy", messages=ask, n=2, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"] * 2
    assert chunks[-1].usage.completion_tokens == 12


def test_the_example_agent_runs_unchanged_against_the_gateway(stack):
    from examples.calc import agent

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "example-0", {"prompt": "2+3?", "answer": 5})
    out = agent(oai(gw.base_url("example-0")), {"prompt": "2+3?", "answer": 5})
    assert out["reward"] == 1.0
    ep = episode(client, keys, "example-0")
    assert len(ep.calls) == 3 and not ep.branches


def test_a_rewritten_history_forks_and_each_chain_trains_as_its_own_row(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "fork-0", TASK)
    api = oai(gw.base_url("fork-0"))
    ask = [{"role": "user", "content": "2+3?"}]
    first = api.chat.completions.create(model="policy", messages=ask, tools=[CALC_TOOL]).choices[0].message
    follow = ask + [first.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
    # extends call 0
    api.chat.completions.create(model="policy", messages=follow, tools=[CALC_TOOL])
    rewritten = [{"role": "user", "content": "2+3? Use the tool."}, {"role": "tool", "content": "5"}]
    # a fork
    api.chat.completions.create(model="policy", messages=rewritten, tools=[CALC_TOOL], max_tokens=8)
    ep = episode(client, keys, "fork-0")
    assert [ep.calls[i].extends for i in range(3)] == [-1, 0, -1]
    assert len(ep.rows) == 2 and ep.rows[0].tokens == ep.calls[2].tokens
    assert ep.rows[1].prompt_ids + ep.rows[1].tokens == ep.calls[1].prompt_ids + ep.calls[1].tokens


def test_a_call_that_changes_temperature_starts_a_new_chain(stack):
    """A row trains under one sampling transform: a follow-up at another temperature is a new chain (a fork),
    and each row carries its own calls' temperature."""
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "temp-0", TASK)
    api = oai(gw.base_url("temp-0"))
    messages = [{"role": "user", "content": TASK["question"]}]
    first = (
        api.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=96)
        .choices[0]
        .message
    )
    messages += [
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "5"},
    ]
    api.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL], temperature=0.5, max_tokens=8)
    ep = episode(client, keys, "temp-0")
    assert ep.calls[1].extends == -1 and len(ep.branches) == 1
    assert ep.sampling["temperature"] == 0.5 and ep.branches[0].sampling["temperature"] == 0.0


def test_completions_endpoint_extends_a_call(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "cmpl-0", TASK)
    api = oai(gw.base_url("cmpl-0"))
    first = api.completions.create(model="policy", prompt="2+3", max_tokens=8, temperature=0)
    assert first.choices[0].finish_reason in ("stop", "length") and first.usage.completion_tokens >= 1
    ep = episode(client, keys, "cmpl-0")
    context = ep.calls[0].prompt_ids + ep.calls[0].tokens
    api.completions.create(model="policy", prompt=context + [10, 11], max_tokens=4, temperature=0)
    ep = episode(client, keys, "cmpl-0")
    assert ep.calls[1].extends == 0 and ep.calls[1].new_ids == [10, 11]


def test_token_ids_and_logprobs_when_asked_with_vllms_field_names(stack):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "ids-0", TASK)
    api = oai(gw.base_url("ids-0"))
    chat = api.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "2+3?"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    ).model_dump()
    call = episode(client, keys, "ids-0").calls[0]
    assert chat["prompt_token_ids"] == call.prompt_ids and chat["choices"][0]["token_ids"] == call.tokens
    assert [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]] == call.logprobs
    plain = api.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "2+3?"}],
        max_tokens=8,
        temperature=0,
        # the same call again (the client's retry), from the stream
        extra_headers={"x-stainless-retry-count": "1"},
    ).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["streamrl"]["call"] == 0
    cmpl = api.completions.create(
        model="policy", prompt="2+3", max_tokens=4, temperature=0, logprobs=0, extra_body={"return_token_ids": True}
    ).model_dump()
    call = episode(client, keys, "ids-0").calls[1]
    choice = cmpl["choices"][0]
    assert choice["prompt_token_ids"] == call.prompt_ids and choice["token_ids"] == call.tokens
    assert choice["logprobs"]["token_logprobs"] == call.logprobs and len(choice["logprobs"]["tokens"]) == len(
        call.tokens
    )
    with pytest.raises(openai.BadRequestError, match="logprobs: the episode stream keeps the sampled token's"):
        api.completions.create(model="policy", prompt="2+3", max_tokens=4, temperature=0, logprobs=2)


def test_gateway_killed_mid_call_the_clients_retry_is_answered_without_generating_again(stack, chat_dir):
    client, keys = stack["client"], stack["keys"]
    port = free_port()
    env = env_for(stack["url"], keys, chat_dir, gateway_port=port, gateway_timeout=120)
    gateway = spawn("services.gateway", env=env)
    wait_http(port)
    start_agent_episode(client, keys, "gwkill-0", TASK)
    api = oai(f"http://127.0.0.1:{port}/ep/gwkill-0/v1", max_retries=8)
    body = dict(
        model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC_TOOL], temperature=0, max_tokens=96
    )
    t, out = in_thread(lambda: api.chat.completions.create(**body))
    wait_until(lambda: call_tokens(client, keys, "gwkill-0", 0) >= 4, what="call generating")
    kill9(gateway)
    gateway = spawn("services.gateway", env=env)
    try:
        t.join(timeout=120)
        reply = out["result"]
        assert reply.choices[0].finish_reason == "tool_calls"
        # one call made, the retry matched it
        assert client.hget(keys.call_index("gwkill-0"), "#n") == b"1"
        ep = episode(client, keys, "gwkill-0")
        assert len([e for e in ep.events if e.kind == "call"]) == 1
        assert reply.usage.completion_tokens == len(ep.calls[0].tokens)
    finally:
        stop(gateway)


def test_a_client_that_says_nothing_and_sends_again_after_the_gateway_died_is_answered_from_the_call(stack, chat_dir):
    """No retry header, no idempotency key: the same request again, to the gateway that replaced the one that took
    it and died before answering, is that call's retry; once answered, the same request is a new ask."""
    client, keys = stack["client"], stack["keys"]
    port = free_port()
    env = env_for(stack["url"], keys, chat_dir, gateway_port=port, gateway_timeout=120)
    gateway = spawn("services.gateway", env=env)
    wait_http(port)
    start_agent_episode(client, keys, "gwplain-0", TASK)
    url = f"http://127.0.0.1:{port}/ep/gwplain-0/v1/chat/completions"
    body = dict(
        model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=[CALC_TOOL], temperature=0, max_tokens=96
    )

    def plain():
        try:
            return httpx.post(url, json=body, timeout=120)
        except httpx.TransportError as exc:
            return exc

    t, out = in_thread(plain)
    wait_until(lambda: call_tokens(client, keys, "gwplain-0", 0) >= 4, what="call generating")
    kill9(gateway)
    t.join(timeout=30)
    assert isinstance(out["result"], httpx.TransportError)
    gateway = spawn("services.gateway", env=env)
    try:
        wait_http(port)
        again = httpx.post(url, json=body, timeout=120).json()
        assert again["streamrl"]["call"] == 0 and client.hget(keys.call_index("gwplain-0"), "#n") == b"1"
        assert again["usage"]["completion_tokens"] == len(episode(client, keys, "gwplain-0").calls[0].tokens)
        # answered now: the same request once more is a second opinion
        assert httpx.post(url, json=body, timeout=120).json()["streamrl"]["call"] == 1
    finally:
        stop(gateway)


def test_agent_runner_killed_minus_9_reruns_and_no_call_is_generated_twice(stack, chat_dir, tmp_path):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    hold = tmp_path / "go"
    cfg = Config(
        run=keys.run,
        agent="tests.support.gateway_agents:calc_agent",
        gateway_port=gw.port,
        temperature=0,
        heartbeat_ttl=2,
        group_size=1,
    )
    env = env_for(stack["url"], keys, chat_dir, heartbeat_ttl=2, agent=cfg.agent, gateway_port=gw.port)
    a = spawn("services.gateway.agents_worker", "--worker-id", "ag1", env=env)
    driver_agents.enqueue_group(cfg, client, keys, "dur", {**TASK, "hold": str(hold)}, 1)
    wait_until(
        lambda: (
            client.exists(keys.episode("dur-0"))
            and sum(c.done for c in episode(client, keys, "dur-0").calls.values()) == 2
        ),
        what="two calls done",
    )
    kill9(a)
    hold.write_text("go")
    b = spawn("services.gateway.agents_worker", "--worker-id", "ag2", env=env)
    try:
        wait_until(lambda: client.xlen(keys.samples) >= 1, timeout=120, what="group published")
        ep = episode(client, keys, "dur-0")
        assert ep.status == "finished" and ep.reward == 1.0
        # each call made once
        assert sorted(e.data["call"] for e in ep.events if e.kind == "call") == [0, 1, 2]
        requests = [
            r
            for r in (calls_codec.decode_request(i, f) for i, f in client.xrange(keys.calls))
            if r.episode_id == "dur-0"
        ]
        # the re-run's first two calls were answered from the stream
        assert len(requests) == 3
        assert [s.group_id for s in samples_codec.read_all(client, keys.samples)[0]] == ["dur"]
        assert ep.events[-1].worker == "ag2"
        # rq's books: the killed worker's job is not left started (rq would later call it failed, abandoned)
        q = driver_agents.queue(client, keys)
        first = driver_agents.job_id(keys.run, "dur-0")
        assert first not in q.started_job_registry.get_job_ids()
        assert q.failed_job_registry.get_job_ids() == []
        assert first in q.canceled_job_registry.get_job_ids()
        assert q.fetch_job(first).meta["superseded_by"] == driver_agents.job_id(keys.run, "dur-0", 1)
    finally:
        stop(b)


def test_a_gateway_killed_under_a_streamed_call_reruns_the_agent_and_the_episode_finishes(stack, chat_dir):
    """A raw openai agent streams its calls; the gateway is killed -9 while one streams (the client does not retry
    a broken stream: the agent raises APIConnectionError). The runner runs the agent again once a gateway answers:
    the cut call is answered whole from its stream, nothing is generated twice, the episode finishes and folds."""
    gateway_killed_under_a_streamed_agent(
        stack, chat_dir, "tests.support.gateway_agents:streamed_calc_agent", "sgw", TASK
    )


def test_an_agents_worker_killed_as_it_takes_a_job_is_found_in_rqs_books_and_the_episode_runs(stack, chat_dir):
    """A kill between rq's dequeue and the runner's first write (found by `--chaos` on an agent run): the job is
    started in rq's books and nowhere else. Another worker's reaper runs it again; nothing is lost or failed."""
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    cfg = Config(
        run=keys.run,
        agent="tests.support.gateway_agents:calc_agent",
        gateway_port=gw.port,
        temperature=0,
        heartbeat_ttl=2,
        group_size=1,
    )
    env = env_for(stack["url"], keys, chat_dir, heartbeat_ttl=2, agent=cfg.agent, gateway_port=gw.port)
    # the taker's fault fires on the first job it takes, which must be this test's: an episode an earlier test's
    # stopped worker cut short (in agents:running, or a job started in rq's books) would be re-run first, at the
    # front of the queue (seen: dur-0-r3). Those are forgotten here: none of this test's business
    q = driver_agents.queue(client, keys)
    client.delete(keys.agents_running)
    for job_id in q.started_job_registry.get_job_ids(cleanup=False):
        q.started_job_registry.remove(job_id)
    q.empty()
    a = spawn(
        "services.gateway.agents_worker", "--worker-id", "taker", env={**env, **faults.spec("agents", "job_started")}
    )
    driver_agents.enqueue_group(cfg, client, keys, "taken", TASK, 1)
    # it killed itself holding the job
    assert a.wait(120) == -9
    first = driver_agents.job_id(keys.run, "taken-0")
    assert first in q.started_job_registry.get_job_ids(cleanup=False) and not client.hexists(
        keys.agents_running, "taken-0"
    )
    b = spawn("services.gateway.agents_worker", "--worker-id", "finder", env=env)
    try:
        wait_until(
            lambda: "taken" in {s.group_id for s in samples_codec.read_all(client, keys.samples)[0]},
            timeout=120,
            what="group published",
        )
        ep = episode(client, keys, "taken-0")
        assert ep.status == "finished" and ep.reward == 1.0 and ep.events[-1].worker == "finder"
        assert first not in q.started_job_registry.get_job_ids(cleanup=False)
        assert q.failed_job_registry.get_job_ids() == []
        assert q.fetch_job(first).meta["superseded_by"] == driver_agents.job_id(keys.run, "taken-0", 1)
        assert [s.group_id for s in samples_codec.read_all(client, keys.samples)[0]].count("taken") == 1
    finally:
        stop(b)


def test_a_tool_running_across_a_weight_sync_ends_while_paused_and_the_episode_completes(stack):
    """Tools run in the agent, which a sync never pauses: the rollout worker pauses and loads new weights
    while a tool runs; the tool runs to its end while the worker is still paused (the pause does not hold
    it), and after the resume the agent's next call completes the episode."""
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "slowtool-0", TASK)
    started, release, ended = threading.Event(), threading.Event(), threading.Event()
    t, out = in_thread(
        calc_agent,
        oai(gw.base_url("slowtool-0")),
        {**TASK, "tool_started": started, "tool_release": release, "tool_ended": ended},
    )
    assert started.wait(120), "the agent never reached its tool call"
    n_pause, n_load = len(acks(client, keys, "pause")), len(acks(client, keys, "load"))
    send(client, keys, "pause", sync="s-slowtool")
    wait_until(lambda: len(acks(client, keys, "pause")) > n_pause, what="pause ack")
    send(client, keys, "load", sync="s-slowtool", version=7, path=str(Path(stack["dir"]) / "model.safetensors"))
    wait_until(lambda: len(acks(client, keys, "load")) > n_load, what="load ack")
    release.set()
    assert ended.wait(30), "the tool did not end while the rollout worker was paused"
    # the agent's next call waits for the resume
    assert t.is_alive()
    send(client, keys, "resume", sync="s-slowtool")
    t.join(timeout=120)
    assert not t.is_alive(), "the agent did not finish after the resume"
    assert out["result"]["reward"] == 1.0, describe(episode(client, keys, "slowtool-0"))
    # the answer was generated under the loaded version
    assert 7 in episode(client, keys, "slowtool-0").versions


def test_an_agents_worker_runs_agent_concurrency_episodes_at_once(stack, chat_dir, tmp_path):
    client, keys = stack["client"], stack["keys"]
    hold = tmp_path / "go"
    cfg = Config(
        run=keys.run, agent="tests.support.gateway_agents:held_agent", gateway_port=stack["gw"].port, group_size=1
    )
    w = spawn(
        "services.gateway.agents_worker",
        "--worker-id",
        "agc",
        env=env_for(stack["url"], keys, chat_dir, agent_concurrency=3, agent=cfg.agent, gateway_port=stack["gw"].port),
    )
    try:
        for i in range(3):
            driver_agents.enqueue_group(cfg, client, keys, f"conc{i}", {**TASK, "hold": str(hold)}, 1)
        running = lambda: {k for k in client.hkeys(keys.agents_running) if k.startswith(b"conc")}
        wait_until(lambda: len(running()) == 3, what="three agent episodes running at once in one worker")
        hold.write_text("go")
        wait_until(lambda: not running(), what="the three episodes ended")
        published = {s.group_id for s in samples_codec.read_all(client, keys.samples)[0]}
        assert {"conc0", "conc1", "conc2"} <= published
        # one 'agent' metrics record per ended episode, through the stream's codec (a kind history reads)
        records = metrics.history(client, keys, tmp_path / "no-run-folder", kinds=("agent",))["agent"]
        ended = [r for r in records if r["episode"].startswith("conc")]
        assert len({r["episode"] for r in ended}) == len(ended) == 3 and all(r["status"] == "finished" for r in ended)
    finally:
        stop(w)
    # a warm stop
    assert w.returncode == 0


def test_replay_continue_reruns_an_agent_from_a_chosen_call_and_writes_nothing_to_the_run(stack, tmp_path):
    """`streamrl replay EP --continue --from-call 1`: the agent runs again on a scratch stack; call 0 is answered
    from the copied stream, calls 1 and 2 are generated again with v0 (greedy; the stack's worker holds the same
    weights under whatever version earlier tests loaded: the same tokens), the reward comes back, and the run's own
    streams are untouched."""
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    start_agent_episode(client, keys, "again-0", TASK, agent="tests.support.gateway_agents:calc_agent")
    assert calc_agent(oai(gw.base_url("again-0")), TASK)["reward"] == 1.0
    _append_last(EpisodeLog(client, keys, "test"), "again-0", "finished", {"reason": "stop", "reward": 1.0})
    before = {k: client.xlen(k) for k in (keys.episode("again-0"), keys.calls)}
    original = episode(client, keys, "again-0")
    env = {**stack["env"], "STREAMRL_RUN_DIR": str(tmp_path / "runs")}
    replay = ("services.ops.cli.main", "replay", "again-0", "--continue")
    out = run_module(*replay, "--from-call", "1", "--version", "0", "--json", env=env, timeout=600)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    r = json.loads(out.stdout)
    assert r["from_call"] == 1 and r["reward"] == 1.0 and not r["error"]
    assert sorted(map(int, r["calls"])) == [0, 1, 2]
    for i in range(3):
        assert r["calls"][str(i)]["tokens"] == original.calls[i].tokens
    # call 0 came from the copied stream
    assert r["generated_by_replay"] == [1, 2]
    # generated again as the continuation of call 0 from the stream
    assert r["calls"]["1"]["extends"] == 0
    # nothing written to the run
    assert {k: client.xlen(k) for k in before} == before
    bad = run_module(*replay, "--from-call", "9", env=env, timeout=120)
    assert bad.returncode != 0 and b"--from-call 9" in bad.stderr and b"calls 0..2" in bad.stderr


def test_rollout_worker_killed_minus_9_mid_call_another_takes_the_call_over(chat_dir, redis_server, client):
    keys = Keys("gw-takeover")
    env = env_for(redis_server.url, keys, chat_dir, heartbeat_ttl=2, step_delay_ms=60, temperature=0)
    first = spawn("services.rollout", "--worker-id", "rA", env=env)
    cfg = Config(run=keys.run, model_dir=chat_dir, redis_url=redis_server.url, gateway_timeout=120)
    with InProcessGateway(build(cfg, client, logs.get("gateway-test"))) as gw:
        wait_alive(client, keys, "rollout", "rA")
        start_agent_episode(client, keys, "tk-0", TASK)
        body = dict(
            model="policy",
            messages=[{"role": "user", "content": "2+3?"}],
            tools=[CALC_TOOL],
            temperature=0,
            max_tokens=96,
        )
        t, out = in_thread(lambda: oai(gw.base_url("tk-0")).chat.completions.create(**body))
        wait_until(lambda: call_tokens(client, keys, "tk-0", 0) >= 4, what="call generating")
        kill9(first)
        second = spawn("services.rollout", "--worker-id", "rB", env=env)
        try:
            t.join(timeout=150)
            reply = out["result"]
            ep = episode(client, keys, "tk-0")
            call = ep.calls[0]
            assert call.resumes and call.resumes[-1]["takeover_from"] == "rA" and call.resumes[-1]["worker"] == "rB"
            assert reply.choices[0].finish_reason == "tool_calls"
            assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"e": "2+3"}
            # greedy: not one token generated twice
            assert reply.usage.completion_tokens == len(call.tokens)
        finally:
            stop(second)


def test_a_stopping_gateway_answers_its_held_calls_503_retry_and_exits_without_a_traceback(
    redis_url, client, keys, chat_dir, tmp_path
):
    """At the end of a run (or a restart) the gateway is told to stop with calls held open: each is answered 503
    with x-should-retry within a second (a gateway that runs answers the retry from the stream), so uvicorn's
    graceful shutdown ends in time instead of cancelling them (a traceback per call)."""
    import os
    import signal

    port = free_port()
    gateway = spawn(
        "services.gateway",
        env=env_for(redis_url, keys, chat_dir, gateway_port=port, gateway_timeout=120),
        log=tmp_path / "gateway.log",
    )
    wait_http(port)
    start_agent_episode(client, keys, "held-0", TASK)
    api = oai(f"http://127.0.0.1:{port}/ep/held-0/v1", max_retries=0)

    def call():
        try:
            return api.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "2+3?"}], temperature=0, max_tokens=8
            )
        except openai.APIStatusError as exc:
            return exc

    t, out = in_thread(call)
    wait_until(lambda: client.exists(keys.calls) and client.xlen(keys.calls) >= 1, what="the call requested")
    # no rollout worker serves this run: the call is held
    os.killpg(gateway.pid, signal.SIGTERM)
    t.join(15)
    err = out.get("result")
    assert isinstance(err, openai.APIStatusError) and err.status_code == 503, err
    assert err.response.headers.get("x-should-retry") == "true" and "gateway_stopping" in err.response.text
    assert gateway.wait(15) == 0
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()


def test_a_stopping_agents_worker_gives_running_episodes_a_grace_then_exits_0(stack, chat_dir, tmp_path):
    """SIGTERM (honcho ending the run) with an episode that cannot end (its agent waits): the worker takes no new
    job, waits STOP_GRACE_S, and exits 0 with one line naming the episode cut short (a reaper runs it again if the
    run goes on), instead of waiting until honcho's kill -9."""
    import os
    import signal

    from services.gateway.agents_worker import STOP_GRACE_S

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    cfg = Config(run=keys.run, agent="tests.support.gateway_agents:held_agent", gateway_port=gw.port, group_size=1)
    log = tmp_path / "agents.log"
    a = spawn(
        "services.gateway.agents_worker",
        "--worker-id",
        "ag-stop",
        log=log,
        env=env_for(stack["url"], keys, chat_dir, agent=cfg.agent, gateway_port=gw.port),
    )
    driver_agents.enqueue_group(cfg, client, keys, "stopping", {**TASK, "hold": str(tmp_path / "never")}, 1)
    wait_until(lambda: client.hexists(keys.agents_running, "stopping-0"), what="the episode running")
    os.killpg(a.pid, signal.SIGTERM)
    assert a.wait(STOP_GRACE_S + 10) == 0
    text = log.read_text()
    assert "1 agent episode(s) cut short" in text and "stopping-0" in text and "Traceback" not in text
    # left for a reaper
    assert client.hexists(keys.agents_running, "stopping-0")


def test_a_call_broken_while_the_agents_worker_stops_cuts_the_episode_short_not_failed(stack, chat_dir, tmp_path):
    """At the run's end the gateway and the agents workers stop together: an agent call that breaks then (a
    connection error, here after the worker's SIGTERM) is the run's end, not the agent failing. The episode gets no
    terminal event and stays in agents:running for a reaper; the worker exits 0."""
    import os
    import signal

    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    cfg = Config(run=keys.run, agent="tests.support.gateway_agents:cut_by_stop_agent", gateway_port=gw.port)
    log = tmp_path / "agents.log"
    a = spawn(
        "services.gateway.agents_worker",
        "--worker-id",
        "ag-cut",
        log=log,
        env=env_for(stack["url"], keys, chat_dir, agent=cfg.agent, gateway_port=gw.port),
    )
    hold = tmp_path / "go"
    task = {**TASK, "hold": str(hold), "closed_url": f"http://127.0.0.1:{free_port()}/v1"}
    driver_agents.enqueue_group(cfg.replace(group_size=1), client, keys, "cut", task, 1)
    wait_until(lambda: client.hexists(keys.agents_running, "cut-0"), what="the episode running")

    def warmed() -> bool:
        call = episode(client, keys, "cut-0").calls.get(0) if client.exists(keys.episode("cut-0")) else None
        return call is not None and call.done

    # the agent's first (real) call answered: it waits on the hold file now
    wait_until(warmed, what="the agent's first call")
    os.killpg(a.pid, signal.SIGTERM)
    # the call breaks once the worker's signal handler has run (it says so)
    wait_until(lambda: log.exists() and "stopping: an agent call" in log.read_text(), what="the worker stopping")
    hold.touch()
    assert a.wait(15) == 0
    text = log.read_text()
    assert "cut short by the run's end" in text and "Traceback" not in text, text
    ep = episode(client, keys, "cut-0")
    assert not ep.done and ep.status == "running"
    assert client.hexists(keys.agents_running, "cut-0")
    assert not client.hget(keys.agents_ended, "failed")

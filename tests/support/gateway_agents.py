"""Agents for gateway tests, written as a user would: a stock `openai` client, native tool calls."""

from __future__ import annotations

import json
import os
import time

from tests.support.chat_models import CALC_TOOL


def calc_agent(client, task: dict) -> dict:
    """Ask, run every tool call the model makes (calc), answer; ``task['hold']``: after two calls, wait until
    that file exists (a test kills the process running this agent there); ``task['tool_release']`` (a
    threading.Event): the first tool call is a slow tool that sets ``task['tool_started']`` and runs until the
    test sets ``tool_release``, then sets ``task['tool_ended']``."""
    messages = [{"role": "user", "content": task["question"]}]
    turns, slow_tool_done = 0, False
    for turn in range(4):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=task.get("max_tokens", 96)
        )
        turns += 1
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            if task.get("tool_release") and not slow_tool_done:
                task["tool_started"].set()
                assert task["tool_release"].wait(120), "the test never released the slow tool"
                task["tool_ended"].set()
                slow_tool_done = True
            expr = json.loads(call.function.arguments)["e"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expr, {}, {}))})
        if task.get("hold") and turns == 2:
            while not os.path.exists(task["hold"]):
                time.sleep(0.05)
    answer = message.content or ""
    return {
        "reward": 1.0 if answer.strip() == f"answer: {task['answer']}" else 0.0,
        "details": {"turns": turns, "answer": answer},
    }


def held_agent(client, task: dict) -> float:
    """No LLM call: waits until the file ``task['hold']`` exists (a test counts how many run at once)."""
    while not os.path.exists(task["hold"]):
        time.sleep(0.05)
    return 1.0


def streamed_calc_agent(client, task: dict) -> dict:
    """``calc_agent`` with every call streamed (``stream=True``), as a raw openai agent writes it: the client
    does not retry a stream that breaks, so a gateway that dies under a call raises APIConnectionError here."""
    from examples.calc import gather

    messages = [{"role": "user", "content": task["question"]}]
    for turn in range(4):
        message = gather(
            client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC_TOOL], temperature=0, max_tokens=96, stream=True
            )
        )
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for c in message["tool_calls"]:
            expr = json.loads(c["function"]["arguments"])["e"]
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(eval(expr, {}, {}))})
    answer = message["content"]
    return {"reward": 1.0 if answer.strip() == f"answer: {task['answer']}" else 0.0, "details": {"answer": answer}}


# CALC_TOOL as the Responses API writes a function tool (no "function" wrapper)
RESPONSES_CALC_TOOL = {"type": "function", **CALC_TOOL["function"]}


def responses_turn(client, **kw):
    """One ``client.responses.create``: the Response, whole or (``stream=True``) the one its stream completes with;
    streamed, the events' types come with it in ``response.streamrl_events`` (a list)."""
    if not kw.get("stream"):
        return client.responses.create(**kw)
    events = list(client.responses.create(**kw))
    final = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    assert len(final) == 1, [e.type for e in events]
    # (a pydantic model with extra fields allowed)
    final[0].streamrl_events = events
    return final[0]


def responses_calc_agent(client, task: dict) -> dict:
    """``calc_agent`` on the Responses API: the history as input items (the answer's output items sent back, a
    function_call_output per call); ``task['stream']``: every call streamed."""
    items: list = [{"role": "user", "content": task["question"]}]
    responses = []
    for turn in range(4):
        reply = responses_turn(
            client,
            model="policy",
            input=items,
            tools=[RESPONSES_CALC_TOOL],
            temperature=0,
            max_output_tokens=96,
            stream=bool(task.get("stream")),
        )
        responses.append(reply)
        items += [item.model_dump(exclude_none=True) for item in reply.output]
        calls = [item for item in reply.output if item.type == "function_call"]
        if not calls:
            break
        for call in calls:
            expr = json.loads(call.arguments)["e"]
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": str(eval(expr, {}, {}))})
    answer = reply.output_text
    task.get("responses", []).extend(responses)
    return {"reward": 1.0 if answer.strip() == f"answer: {task['answer']}" else 0.0, "details": {"answer": answer}}


def streamed_responses_calc_agent(client, task: dict) -> dict:
    """``responses_calc_agent`` with every call streamed: a gateway that dies under one raises APIConnectionError."""
    return responses_calc_agent(client, {**task, "stream": True})


ANTHROPIC_CALC_TOOL = {
    "name": CALC_TOOL["function"]["name"],
    "description": CALC_TOOL["function"]["description"],
    "input_schema": CALC_TOOL["function"]["parameters"],
}


def anthropic_calc_agent(client, task: dict, stream: bool = False) -> dict:
    """``calc_agent`` with the stock `anthropic` client (Messages, tool_use and tool_result blocks); ``stream``:
    every call through ``messages.stream``, the answer its final message."""
    from examples.calc_anthropic import anthropic_client

    api = anthropic_client(client)
    messages = [{"role": "user", "content": task["question"]}]
    turns = 0
    for turn in range(4):
        # (this client has no temperature argument; the API takes it)
        ask = dict(
            model="policy",
            max_tokens=96,
            messages=messages,
            tools=[ANTHROPIC_CALC_TOOL],
            extra_body={"temperature": 0},
        )
        if stream:
            with api.messages.stream(**ask) as events:
                reply = events.get_final_message()
        else:
            reply = api.messages.create(**ask)
        turns += 1
        messages.append({"role": "assistant", "content": reply.content})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": str(eval(b.input["e"], {}, {}))} for b in uses
        ]
        messages.append({"role": "user", "content": results})
    answer = "".join(b.text for b in reply.content if b.type == "text")
    return {
        "reward": 1.0 if answer.strip() == f"answer: {task['answer']}" else 0.0,
        "details": {"turns": turns, "answer": answer, "stop_reason": reply.stop_reason},
    }


def streamed_anthropic_calc_agent(client, task: dict) -> dict:
    """``anthropic_calc_agent`` streamed: a gateway that dies under a stream breaks it (httpx's transport error)."""
    return anthropic_calc_agent(client, task, stream=True)


def wrong_api_agent(client, task: dict) -> float:
    """Written against an API the gateway does not serve: every episode fails with the gateway's 404."""
    client.post("/nonexistent", body={"model": "policy", "input": str(task)}, cast_to=object)
    return 1.0


def cut_by_stop_agent(client, task: dict) -> float:
    """Waits until the file ``task['hold']`` exists (the test stops the worker first), then its next call breaks:
    a connection error while the worker stops, as a call in flight at the run's end (its base URL: a closed port)."""
    broken = client.with_options(base_url=task["closed_url"], max_retries=0, timeout=5)
    # one real call first: the client's lazy imports and first request cost seconds on a loaded box, and the broken
    # call must land within the worker's stop grace
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    while not os.path.exists(task["hold"]):
        time.sleep(0.05)
    broken.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return 1.0

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


def wrong_api_agent(client, task: dict) -> float:
    """Written against an API the gateway does not serve: every episode fails with the gateway's 404."""
    client.post("/nonexistent", body={"model": "policy", "input": str(task)}, cast_to=object)
    return 1.0


def cut_by_stop_agent(client, task: dict) -> float:
    """Waits until the file ``task['hold']`` exists (the test stops the worker first), then its next call breaks:
    a connection error while the worker stops, as a call in flight at the run's end (its base URL: a closed port)."""
    while not os.path.exists(task["hold"]):
        time.sleep(0.05)
    broken = client.with_options(base_url=task["closed_url"], max_retries=0, timeout=5)
    broken.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return 1.0

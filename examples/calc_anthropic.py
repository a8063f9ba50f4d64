"""A user agent for streamrl, written with the stock `anthropic` package: the arithmetic task of examples/calc.py,
with a calculator as a native tool, spoken through the gateway's Anthropic Messages route. Train it:
`streamrl run --agent examples.calc_anthropic:agent`."""

import re

import anthropic

from examples.calc import calc

TOOLS = [
    {
        "name": "calc",
        "description": "Evaluate + - * on integers",
        "input_schema": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
    }
]


def anthropic_client(client) -> anthropic.Anthropic:
    """The Anthropic client for the episode streamrl hands an agent its openai client for: the same gateway and key,
    the base URL without its ``/v1`` (the anthropic client appends ``/v1/messages``)."""
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key=client.api_key)


def agent(client, task: dict, stream: bool = False) -> dict:
    api = anthropic_client(client)
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        ask = dict(model="policy", max_tokens=96, messages=messages, tools=TOOLS)
        if stream:
            with api.messages.stream(**ask) as events:
                reply = events.get_final_message()
        else:
            reply = api.messages.create(**ask)
        messages.append({"role": "assistant", "content": reply.content})
        if reply.stop_reason != "tool_use":
            break
        results = [
            {"type": "tool_result", "tool_use_id": block.id, "content": calc(str(block.input.get("e", "")))}
            for block in reply.content
            if block.type == "tool_use"
        ]
        messages.append({"role": "user", "content": results})
    text = "".join(block.text for block in reply.content if block.type == "text")
    numbers = re.findall(r"-?\d+", text)
    return {"reward": float(bool(numbers) and numbers[-1] == str(task["answer"])), "details": {"turns": len(messages)}}


def stream_agent(client, task: dict) -> dict:
    """`agent` with every call streamed (``messages.stream``). Train it:
    `streamrl run --agent examples.calc_anthropic:stream_agent`."""
    return agent(client, task, stream=True)

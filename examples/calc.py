"""A user agent for streamrl, written with the stock `openai` package: the arithmetic task,
with a calculator as a native tool. Train it: `streamrl run --agent examples.calc:agent`."""

import json
import re

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate + - * on integers",
            "parameters": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
        },
    }
]


def calc(expr: str) -> str:
    # + - * only ("**" is a power: 9**9**9 would not end)
    if not re.fullmatch(r"[\d+\-* ()]{1,40}", expr) or "**" in expr:
        return "error: bad expression"
    # the policy writes the expression: "6+" is its mistake, answered as any wrong call is, not an agent crash
    try:
        return str(eval(expr, {}, {}))
    except SyntaxError:
        return "error: bad expression"


def agent(client, task: dict) -> dict:
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            expr = json.loads(call.function.arguments or "{}").get("e", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(expr))})
    numbers = re.findall(r"-?\d+", message.content or "")
    return {"reward": float(bool(numbers) and numbers[-1] == str(task["answer"])), "details": {"turns": len(messages)}}


def gather(stream) -> dict:
    """The assistant message a streamed chat completion adds up to: its content and its tool calls, from deltas."""
    content, calls = "", {}
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta and delta.content) or ""
        for c in (delta and delta.tool_calls) or []:
            call = calls.setdefault(
                c.index, {"id": c.id, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["function"]["name"] += c.function.name or ""
            call["function"]["arguments"] += c.function.arguments or ""
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})}


def stream_agent(client, task: dict) -> dict:
    """`agent` with every call streamed (``stream=True``), deltas gathered as a chat UI would: the same episodes,
    trained the same way. Train it: `streamrl run --agent examples.calc:stream_agent`."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        message = gather(
            client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96, stream=True)
        )
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            expr = json.loads(call["function"]["arguments"] or "{}").get("e", "")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calc(str(expr))})
    numbers = re.findall(r"-?\d+", message["content"])
    return {"reward": float(bool(numbers) and numbers[-1] == str(task["answer"])), "details": {"turns": len(messages)}}

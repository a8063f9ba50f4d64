"""The calculator agent written with each agent framework the gateway is tested against, each the way that
framework's docs show: ``agent(client, task)`` like examples/calc.py, the framework's own client built from
``client.base_url`` and ``client.api_key`` (the episode's base URL and key). Train one:
``streamrl run --agent tests.support.framework_agents:langgraph_agent``.

The tool is the same everywhere: ``calc(e)``, described "evaluate", its one string parameter ``e`` (the scripted
test model, tests/support/chat_models.py, was taught that schema)."""

from __future__ import annotations

import json
import os
import re
import warnings

# the tool's schema, as the raw clients send it (CALC_TOOL of tests/support/chat_models.py)
CALC_SCHEMA = {"type": "object", "properties": {"e": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate", "parameters": CALC_SCHEMA}}]
MODEL = "policy"


def calc(e: str) -> str:
    """evaluate"""
    return str(eval(e, {}, {})) if re.fullmatch(r"[\d+\-* ()]{1,40}", e) else "error: bad expression"


def _reward(answer: str, task: dict) -> dict:
    numbers = re.findall(r"-?\d+", answer or "")
    return {"reward": float(bool(numbers) and numbers[-1] == str(task["answer"])), "details": {"answer": answer}}


def _base(client) -> str:
    return str(client.base_url).rstrip("/")


def openai_agent(client, task: dict) -> dict:
    """Raw `openai` chat completions, native tool calls, every reply sent back as it came."""
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        message = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            e = json.loads(call.function.arguments or "{}").get("e", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(e))})
    return _reward(message.content, task)


def openai_stream_agent(client, task: dict) -> dict:
    """Raw `openai`, streamed (``stream=True`` with usage in the last chunk), deltas gathered into the message."""
    from examples.calc import gather

    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        message = gather(
            client.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
            )
        )
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            e = json.loads(call["function"]["arguments"] or "{}").get("e", "")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calc(str(e))})
    return _reward(message["content"], task)


def langgraph_agent(client, task: dict) -> dict:
    """LangGraph's prebuilt ReAct agent over `langchain-openai`'s ChatOpenAI, the tool a ``@tool``."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    @tool("calc", args_schema=CALC_SCHEMA)
    def calc_tool(e: str) -> str:
        """evaluate"""
        return calc(e)

    llm = ChatOpenAI(base_url=_base(client), api_key=client.api_key, model=MODEL)
    # LangGraph 1.x points to its successor, langchain.agents.create_agent, in the `langchain` package (not a
    # dependency here); the prebuilt agent works the same until LangGraph 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        graph = create_react_agent(llm, [calc_tool])
    out = graph.invoke({"messages": [("user", task["prompt"])]}, {"recursion_limit": 10})
    return _reward(out["messages"][-1].content, task)


def pydantic_ai_agent(client, task: dict) -> dict:
    """`pydantic-ai`: an Agent over OpenAIChatModel with an OpenAIProvider pointed at the episode, run_sync."""
    from pydantic_ai import Agent, Tool
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=_base(client), api_key=client.api_key))
    tool = Tool.from_schema(calc, name="calc", description="evaluate", json_schema=CALC_SCHEMA)
    agent = Agent(model, tools=[tool])
    return _reward(agent.run_sync(task["prompt"]).output, task)


def litellm_agent(client, task: dict) -> dict:
    """`litellm.completion` with ``model="openai/<name>"`` and ``api_base`` (its OpenAI-compatible route)."""
    # no network: litellm's model cost map from its package, not fetched
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        reply = litellm.completion(
            model=f"openai/{MODEL}", api_base=_base(client), api_key=client.api_key, messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            e = json.loads(call.function.arguments or "{}").get("e", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(e))})
    return _reward(message.content, task)

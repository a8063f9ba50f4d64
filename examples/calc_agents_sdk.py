"""`examples/calc.py`'s agent (the arithmetic task, a calculator tool, the same reward) written with the OpenAI Agents
SDK on its default Responses API model. Train it: `streamrl run --agent examples.calc_agents_sdk:agent`."""

import asyncio
import re

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

from examples.calc import calc as evaluate


@function_tool
def calc(e: str) -> str:
    """Evaluate + - * on integers."""
    return evaluate(e)


def agent(client, task: dict, stream: bool = False) -> dict:
    # the SDK wants an async client: one on the episode's URL and key, from the stock client streamrl hands in
    sdk = openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key)
    bot = Agent(
        name="calc",
        tools=[calc],
        model=OpenAIResponsesModel(model="policy", openai_client=sdk),
        model_settings=ModelSettings(max_tokens=96),
    )
    # four model calls at most, as examples/calc.py; no traces sent anywhere
    run = dict(max_turns=4, run_config=RunConfig(tracing_disabled=True))
    try:
        result = (
            asyncio.run(_streamed(bot, task["prompt"], run)) if stream else Runner.run_sync(bot, task["prompt"], **run)
        )
    # out of turns, or (the SDK raises it) an answer cut at max_tokens: a wrong answer, trained as one
    except (MaxTurnsExceeded, ModelBehaviorError) as exc:
        return {"reward": 0.0, "details": {"turns": 4, "ended": exc.__class__.__name__}}
    numbers = re.findall(r"-?\d+", str(result.final_output or ""))
    reward = float(bool(numbers) and numbers[-1] == str(task["answer"]))
    return {"reward": reward, "details": {"turns": len(result.raw_responses)}}


async def _streamed(bot: Agent, prompt: str, run: dict):
    result = Runner.run_streamed(bot, prompt, **run)
    async for _ in result.stream_events():
        pass
    return result


def stream_agent(client, task: dict) -> dict:
    """`agent` with every model call streamed (``Runner.run_streamed``). Train it:
    `streamrl run --agent examples.calc_agents_sdk:stream_agent`."""
    return agent(client, task, stream=True)

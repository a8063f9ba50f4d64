"""The agent frameworks that speak OpenAI chat completions, each a short real agent for the calculator task
(tests/support/framework_agents.py) run through a live gateway and a real rollout worker, with the scripted
calculator model: the episode ends with reward 1, its training row is exactly the ids the calls generated (each
call after the first extends the one before), and no call was generated twice."""

from __future__ import annotations

import openai
import pytest

from services.gateway.runner import _append_last
from services.ops.check.checker import _entries, episode_stats
from services.trainer.batch import build_batch
from shared.protocol.episode.log import EpisodeLog
from tests.support import framework_agents
from tests.support.chat_models import CALC_TOOL, calc_conversation, scripted_chat_model
from tests.support.gateway_stack import episode, live_stack, start_agent_episode

pytestmark = [pytest.mark.slow(seconds=30), pytest.mark.timeout(600)]
TASK = {"prompt": "2+3?", "answer": "5"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    """One run: a rollout worker and an in-process gateway serving the scripted calculator model, greedy."""
    chat_dir = scripted_chat_model(tmp_path_factory.mktemp("chat"), [(calc_conversation(2, 3), [CALC_TOOL])])
    with live_stack(redis_server.url, chat_dir, "gw-frameworks", "fw1", step_delay_ms=0) as stack:
        yield stack


@pytest.mark.parametrize(
    "name",
    ["openai_agent", "openai_stream_agent", "langgraph_agent", "pydantic_ai_agent", "litellm_agent"],
)
def test_a_framework_agent_trains_on_exactly_the_ids_it_was_given(stack, name):
    client, keys, gw = stack["client"], stack["keys"], stack["gw"]
    eid = f"{name.replace('_', '')}-0"
    start_agent_episode(client, keys, eid, TASK)
    api = openai.OpenAI(base_url=gw.base_url(eid), api_key="test")
    result = getattr(framework_agents, name)(api, dict(TASK))
    ep = episode(client, keys, eid)
    assert result["reward"] == 1.0, (result, ep.calls)
    calls = [ep.calls[i] for i in sorted(ep.calls)]
    # ask, check, answer: each call after the first extends the one before, one chain
    assert [c.extends for c in calls] == [-1, 0, 1] and not ep.branches, [c.extends for c in calls]
    generated = [t for c in calls for t in c.tokens]
    # no call generated twice: three calls requested, and the stream's policy tokens are theirs, each once
    assert int(client.hget(keys.call_index(eid), "#n")) == 3
    assert episode_stats(_entries(client.xrange(keys.episode(eid)))).policy_tokens == len(generated)
    _append_last(EpisodeLog(client, keys, "test"), eid, "finished", {"reason": "stop", "reward": result["reward"]})
    ep = episode(client, keys, eid)
    (row,) = ep.rows
    assert row.prompt_ids + row.tokens == calls[-1].prompt_ids + calls[-1].tokens
    # the training row's sampled ids: exactly the calls' generated ids
    batch = build_batch([[ep]], pad_id=0)
    start = len(row.prompt_ids) - 1
    targets = batch.targets[0][start : start + len(row.tokens)].tolist()
    assert [t for t, m in zip(targets, row.mask) if m] == generated

"""A mixture-of-experts policy behind the gateway: a call's routes are kept like its tokens (one per completion
token, what a forward of the call's prompt + completion routes), and a stop string that cuts the completion cuts
its routes at the same token."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.arch_models import make_arch_model
from tests.support.gateway_stack import episode, live_stack, start_agent_episode
from tests.support.moe_episodes import Forward

pytestmark = [pytest.mark.slow(seconds=40), pytest.mark.timeout(600)]
CHAT = [{"role": "user", "content": "What is the sum? 3+4"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    moe_dir = make_arch_model("qwen3-moe", tmp_path_factory.mktemp("moe-chat"))
    with live_stack(redis_server.url, moe_dir, "gw-moe", "rmoe") as stack:
        yield {**stack, "tok": AutoTokenizer.from_pretrained(moe_dir)}


def test_a_calls_routes_are_logged_with_its_tokens_and_cut_with_them_by_a_stop_string(stack):
    client, keys, tok = stack["client"], stack["keys"], stack["tok"]
    start_agent_episode(client, keys, "moe-0")
    oai = openai.OpenAI(base_url=stack["gw"].base_url("moe-0"), api_key="test", max_retries=5)
    whole = oai.chat.completions.create(model="policy", messages=CHAT, max_tokens=10)
    call = episode(client, keys, "moe-0").calls[whole.streamrl["call"]]
    assert len(call.tokens) >= 4 and len(call.routes) == len(call.tokens)
    assert np.array_equal(np.stack(call.routes), Forward(stack["dir"]).routes(call.prompt_ids, call.tokens))
    # greedy: the same ask with a stop string completed by the completion's fourth token ends there
    stop = tok.decode(call.tokens[2:4], skip_special_tokens=True)
    assert stop.strip(), "the greedy completion decodes to text at tokens 2-3"
    cut = oai.chat.completions.create(model="policy", messages=CHAT, max_tokens=10, stop=[stop])
    short = episode(client, keys, "moe-0").calls[cut.streamrl["call"]]
    assert short.stop_string == stop and len(short.tokens) < len(call.tokens)
    assert short.tokens == call.tokens[: len(short.tokens)] and len(short.routes) == len(short.tokens)
    assert np.array_equal(np.stack(short.routes), np.stack(call.routes[: len(short.tokens)]))

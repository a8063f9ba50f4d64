"""bench/learning/staleness_agent.py: calc.py's episodes in process, at staleness fixed exactly."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.learning.staleness_agent_cell import after_call, calc_reward, generate, run_agent_cell  # noqa: E402
from bench.learning.staleness_cell import Setup, split_task  # noqa: E402
from examples.calc import TOOLS  # noqa: E402
from services.gateway.chat import Renderer  # noqa: E402
from services.ops.launch.default_model import AGENT_CONTEXT, DEFAULT_MODEL  # noqa: E402
from services.ops.launch.tiny_model import load_tokenizer, make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent") / "m"
    # random init
    make_tiny_model(d, **dict(DEFAULT_MODEL, max_position_embeddings=AGENT_CONTEXT), seed=0)
    return str(d)


def test_a_tool_call_is_answered_by_calc_in_a_tool_turn(agent_model):
    r = Renderer(load_tokenizer(agent_model))
    call = r.encode('<tool_call>{"name": "calc", "arguments": {"e": "3+4+5"}}</tool_call>') + [r.end_id]
    bridge, content = after_call(r, call, 0)
    assert content is None and r.tok.decode(bridge) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    # the call ran out of tokens before its end-of-turn: the bridge closes it
    cut, _ = after_call(r, call[:-1], 0)
    assert cut == [r.end_id] + bridge
    bridge, content = after_call(r, r.encode("the sum is 12") + [r.end_id], 0)
    assert bridge is None and content == "the sum is 12" and calc_reward(content, "12") == 1.0
    assert calc_reward("12 or 13", "12") == 0.0 and calc_reward(None, "12") == 0.0


def test_cached_generation_is_the_full_forward_greedy(agent_model):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(agent_model)
    model = AutoModelForCausalLM.from_pretrained(agent_model, dtype=torch.float32).eval()
    r = Renderer(tok)
    prompts = [r.full([{"role": "user", "content": p}], TOOLS) for p in ("3+4=", "1+2+3=", "5+6=")]
    got = generate(model, prompts, r.stop_ids, 0.0, None, max_tokens=12)
    for p, ids in zip(prompts, got):
        seq = torch.tensor([p])
        with torch.no_grad():
            for _ in range(len(ids)):
                seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert seq[0, len(p) :].tolist() == ids


def test_agent_batches_come_from_version_v_minus_eta(agent_model):
    pool, held = split_task(2, 4)
    setup = Setup.from_defaults(steps=4, lr=5e-5, batch_groups=1, group_size=2, eval_every=2, eval_last=1)
    cell = run_agent_cell(agent_model, 2, "token-truncate", 0, setup, held[:2], pool)
    assert cell["behaviour_versions"] == [0, 0, 0, 1] and cell["snapshots_kept"] == 3
    assert [v for v, _ in cell["eval_curve"]] == [4] and len(cell["tool_call_share"]) == 4
    # the cell goes to --cells-out as it is
    json.dumps(cell)

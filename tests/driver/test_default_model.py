"""The default model: made once per recipe (task, format, seed, warm start), remade when a run wants another,
and for agent runs laid out exactly as the gateway lays out `examples/calc.py`'s episodes."""

from __future__ import annotations

import json

from services.gateway import toolparse
from services.gateway.chat import Renderer
from services.ops.launch import default_model
from services.ops.launch.default_model import CALC_TOOL, agent_sft_examples, ensure_default_model
from services.ops.launch.tiny_model import CHAT_WORDS, build_tokenizer, load_tokenizer
from shared.runtime.config.keys import Config


def test_the_agent_warm_start_uses_the_example_agents_tool():
    from examples.calc import TOOLS

    # else the warm start teaches a system prompt the example never sends
    assert TOOLS == [CALC_TOOL]


def test_agent_warm_start_rows_are_the_gateways_ids_and_learn_only_the_models_turns():
    tok = build_tokenizer(chat_words=True)
    r = Renderer(tok)
    ((ids, labels),) = agent_sft_examples([{"prompt": "3+4=", "answer": "7"}], tok)
    prompt = r.full([{"role": "user", "content": "3+4="}], [CALC_TOOL])
    assert ids[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {-100}
    learned = [i for i, l in zip(ids, labels) if l != -100]
    assert all(l in (-100, i) for i, l in zip(ids, labels))
    first = learned[: learned.index(r.end_id) + 1]
    # what the gateway answers the agent for that completion
    message, problems = r.assistant(first, 0)
    assert not problems and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"e": "3+4"}
    # the agent sends the answer back with the tool's result: the gateway appends the bridge, then the model answers
    bridge = r.bridge(True, [{"role": "tool", "tool_call_id": "call_0_0", "content": "7"}], [CALC_TOOL])
    assert ids == prompt + first + bridge + tok.encode("7", add_special_tokens=False) + [r.end_id]
    assert tok.decode(learned[len(first) :], skip_special_tokens=True) == "7"
    assert toolparse.parse(tok.decode(first, skip_special_tokens=True)).calls[0]["name"] == "calc"


def test_the_agent_warm_start_answers_without_the_tool_on_the_share_it_is_told():
    tok = build_tokenizer(chat_words=True)
    r = Renderer(tok)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    calls = lambda examples: sum(  # noqa: E731
        tok.decode([i for i, l in zip(ids, labels) if l != -100]).startswith("<tool_call>") for ids, labels in examples
    )
    assert calls(agent_sft_examples(rows, tok)) == 100
    assert calls(agent_sft_examples(rows, tok, tool_share=0.0)) == 0
    half = agent_sft_examples(rows, tok, tool_share=0.5, seed=3)
    assert 30 <= calls(half) <= 70
    # the same draw for the same seed, another for another
    assert (
        half
        == agent_sft_examples(rows, tok, tool_share=0.5, seed=3)
        != agent_sft_examples(rows, tok, tool_share=0.5, seed=4)
    )
    # an answer at once: the prompt, then the answer and the end of the turn, learned
    direct = next(
        (ids, labels)
        for ids, labels in half
        if labels[-2:] == ids[-2:]
        and r.end_id in ids[-1:]
        and not tok.decode([i for i, l in zip(ids, labels) if l != -100]).startswith("<tool_call>")
    )
    prompt = r.full([{"role": "user", "content": "0+0="}], [CALC_TOOL])
    assert len(direct[0]) - len(prompt) <= 3


def test_calc_answers_a_broken_expression_as_an_error_not_an_exception():
    from examples.calc import calc

    assert calc("3+4") == "7"
    # a policy's half-copied expression, a power that would not end, a division: the tool's error, the episode goes on
    assert calc("6+") == calc("2**99") == calc("(1") == calc("8/2") == "error: bad expression"


def test_the_default_model_is_remade_only_when_a_run_wants_another_recipe(tmp_path, capsys):
    model_dir = str(tmp_path / "tiny")
    plain = Config(run="dm", model_dir=model_dir)
    agent = Config(run="dm", model_dir=model_dir, agent="examples.calc:agent")
    context = lambda: json.loads((tmp_path / "tiny" / "config.json").read_text())["max_position_embeddings"]

    assert ensure_default_model(plain, warm_steps=0) is True
    assert context() == default_model.DEFAULT_MODEL["max_position_embeddings"]
    # the same recipe: reused
    assert ensure_default_model(plain, warm_steps=0) is False
    # a run takes whatever warm start make-model was given
    assert ensure_default_model(plain) is False
    # an agent run needs the chat format and the context
    assert ensure_default_model(agent, warm_steps=0) is True
    assert context() == default_model.AGENT_CONTEXT
    # its tokenizer has the chat words; the plain model's had not
    assert len(load_tokenizer(model_dir)) == 103 + len(CHAT_WORDS)
    assert "was made for" in capsys.readouterr().err
    assert json.loads((tmp_path / "tiny" / default_model.RECIPE_FILE).read_text())["format"] == "agent"
    # made before recipes were recorded: remade, not trusted
    (tmp_path / "tiny" / default_model.RECIPE_FILE).unlink()
    assert ensure_default_model(agent, warm_steps=0) is True


def test_a_run_on_the_default_model_remakes_it_for_its_recipe(tmp_path, monkeypatch):
    """What `streamrl run` checks before anything starts (``ensure_model``): the README's agent example after the
    default run found the plain model (256-token context) and every agent call was refused as too long; the run's
    own check now remakes the default model for the agent recipe, and reuses it for the same one."""
    # the default model_dir, models/tiny, is relative to where the run starts
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(default_model, "DEFAULT_WARM_STEPS", 0)
    monkeypatch.setattr(default_model, "AGENT_WARM_STEPS", 0)
    context = lambda: json.loads((tmp_path / "models" / "tiny" / "config.json").read_text())["max_position_embeddings"]
    default_model.ensure_model(Config(run="dm"))
    assert context() == default_model.DEFAULT_MODEL["max_position_embeddings"]
    default_model.ensure_model(Config(run="dm", agent="examples.calc:agent"))
    assert context() == default_model.AGENT_CONTEXT
    made = (tmp_path / "models" / "tiny" / "config.json").stat().st_mtime_ns
    default_model.ensure_model(Config(run="dm", agent="examples.calc:agent"))
    # the same recipe: reused
    assert (tmp_path / "models" / "tiny" / "config.json").stat().st_mtime_ns == made

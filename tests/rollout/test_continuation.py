"""`streamrl replay <episode> --continue`: re-running an episode's continuation
from any event, with the stream's own seed, with a chosen policy version."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from services.ops.launch.tiny_model import make_tiny_model
from services.rollout.engine import make_engine
from services.rollout.episodes import continuation as cont
from services.rollout.jobs import rewards
from services.trainer.publish import publish, sha256
from shared.protocol.episode.events import Event
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.helpers import finished, raw, started, tokens
from tests.support.procs import run_module
from tests.support.rollout_harness import make_worker, samples, tick_until


def streamrl(env, *args):
    return run_module("services.ops.cli.main", *args, env=env, timeout=120)


@pytest.fixture
def finished_run(client, keys, tiny_model_dir):
    """A real worker rolls out one greedy and one sampled episode to the end, flushing every 4 tokens."""
    cfg = Config(
        run=keys.run, model_dir=tiny_model_dir, max_tokens=24, tools="", flush_tokens=4, flush_ms=1e6, temperature=0.0
    )
    enqueue(
        client,
        keys,
        [
            PromptGroup("greedy", 1, prompt="7*6="),
            PromptGroup("sampled", 1, prompt="9+3=", sampling={"temperature": 1.0, "top_k": 20}),
        ],
    )
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 2)
    return cfg, EpisodeLog(client, keys, "reader")


def _engine_and_tok(model_dir):
    return make_engine("torch", model_dir, max_batch_size=1), AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("episode_id", ["greedy-0", "sampled-0"])
def test_same_version_from_the_middle_reproduces_the_tail(finished_run, tiny_model_dir, episode_id):
    cfg, log = finished_run
    entries = log.read(episode_id)
    original = log.replay(episode_id)
    assert original.status == "finished" and len(original.tokens) == 24
    token_seqs = [e.seq for e in original.events if e.kind == "tokens"]
    assert len(token_seqs) >= 4
    mid = token_seqs[len(token_seqs) // 2 - 1]
    prefix = cont.prefix_at(entries, mid)
    assert 0 < len(prefix.episode.tokens) < len(original.tokens)
    engine, tok = _engine_and_tok(tiny_model_dir)
    result = cont.continue_from(prefix, engine, tok, rewards.load(cfg.reward_fn))
    kept = len(prefix.episode.tokens)
    assert result.prefix_tokens == kept
    assert result.tokens == original.tokens[kept:]
    assert result.logprobs == pytest.approx(original.logprobs[kept:], abs=1e-4)
    assert result.finish_reason == original.finish_reason and result.reward == original.reward
    assert set(result.versions) == {0}
    # nothing written to the episode's stream
    assert len(log.read(episode_id)) == len(entries)


def test_from_the_start_regenerates_the_whole_response(finished_run, tiny_model_dir):
    cfg, log = finished_run
    original = log.replay("sampled-0")
    engine, tok = _engine_and_tok(tiny_model_dir)
    result = cont.continue_from(cont.prefix_at(log.read("sampled-0"), 0), engine, tok, rewards.load(cfg.reward_fn))
    assert result.prefix_tokens == 0 and result.tokens == original.tokens


def test_other_version_tags_every_new_token_and_writes_nothing(
    finished_run, client, keys, cli_env, tiny_model_dir, tmp_path
):
    cfg, log = finished_run
    # same architecture, different weights
    make_tiny_model(tmp_path / "other", seed=7)
    weights = tmp_path / "v000003.safetensors"
    (tmp_path / "other" / "model.safetensors").rename(weights)
    publish(client, keys, 3, weights, sha256(weights), step=3)
    before = {k: client.xlen(k) for k in (keys.episode("greedy-0"), keys.samples, keys.versions)}
    env = {**cli_env, "STREAMRL_MODEL_DIR": tiny_model_dir}
    out = streamrl(env, "replay", "greedy-0", "--continue", "--from-seq", "2", "--version", "3", "--json")
    assert out.returncode == 0, out.stderr.decode()
    data = json.loads(out.stdout)
    original = log.replay("greedy-0")
    kept = data["prefix_tokens"]
    assert (
        data["from_seq"] == 2
        and data["version"] == 3
        and kept == len(cont.prefix_at(log.read("greedy-0"), 2).episode.tokens)
    )
    assert len(data["tokens"]) == 24 - kept and set(data["versions"]) == {3}
    # other weights, other greedy tail
    assert data["tokens"] != original.tokens[kept:]
    assert data["finish_reason"] == "length" and data["reward"] is not None
    assert {k: client.xlen(k) for k in before} == before
    text = streamrl(env, "replay", "greedy-0", "--continue", "--from-seq", "2", "--no-text")
    assert text.returncode == 0, text.stderr.decode()
    assert "identical" in text.stdout.decode() and "nothing written to Redis" in text.stdout.decode()


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope", "--continue"], "no episode 'nope'"),
        (["e1", "--continue", "--from-seq", "9"], "--from-seq 9: out of range; episode e1 holds events 0..2"),
        (["e1", "--continue", "--from-seq", "2"], "that is the episode's 'finished' event"),
        (
            ["e1", "--continue", "--version", "4"],
            "--version 4: unknown policy version; published versions: none yet (0 is model_dir)",
        ),
        (["e1", "--continue", "--weights", "/no/such.safetensors", "--version", "1"], "no such file"),
        (["e1", "--from-seq", "1"], "go with --continue"),
    ],
)
def test_bad_input_is_one_line(client, keys, cli_env, args, message):
    for _, fields in raw([started(), tokens(1, [30, 31]), finished(2)]):
        client.xadd(keys.episode("e1"), fields)
    out = streamrl(cli_env, "replay", *args, "--no-text")
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err


def test_prefix_at_defaults_and_pending_tool_call():
    events = [
        started(),
        tokens(1, [30, 31]),
        Event("tool_call", 0, "w", 2, {"call_id": "c1", "name": "calc", "args": "6*7"}),
        Event("tool_result", 0, "w", 3, {"call_id": "c1", "ok": True, "output": "42", "ids": [40, 41]}),
        tokens(4, [32], policy=1),
        finished(5),
    ]
    entries = raw(events)
    # default: the last event before the finish
    p = cont.prefix_at(entries)
    assert p.from_seq == 4 and p.episode.tokens == [30, 31, 40, 41, 32] and p.turn_start == 4
    assert p.policy == 1 and p.pending_call is None and p.remaining == 32 - 3
    at_call = cont.prefix_at(entries, 2)
    assert at_call.pending_call == {"call_id": "c1", "name": "calc", "args": "6*7", "seq": 2}
    # unfinished: default is the last event
    assert cont.prefix_at(entries[:5]).from_seq == 4
    with pytest.raises(cont.ContinuationError, match="out of range"):
        cont.prefix_at(entries, -1)


@pytest.fixture(scope="module")
def calc_model_dir(tmp_path_factory) -> str:
    from tests.support.models import overfit

    out = make_tiny_model(tmp_path_factory.mktemp("calc"), seed=1)
    # one script
    return overfit(out, [("C:", "<call>calc: 6*7</call><result>42</result>answer: 42")], steps=100)


def test_tool_calls_run_in_process_also_from_a_pending_call(calc_model_dir):
    tok = AutoTokenizer.from_pretrained(calc_model_dir)
    engine = make_engine("torch", calc_model_dir, max_batch_size=1)
    prompt = tok.encode("C:", add_special_tokens=False)
    sampling = {"temperature": 0.0, "max_tokens": 80, "stop_token_ids": [tok.eos_token_id], "seed": 1}
    start = Event(
        "started",
        0,
        "w",
        0,
        {
            "episode_id": "c",
            "group_id": "c",
            "index": 0,
            "prompt_ids": prompt,
            "sampling": sampling,
            "task": {"answer": "42"},
        },
    )
    reward = rewards.load("services.rollout.jobs.rewards:arithmetic")
    fresh = cont.continue_from(cont.prefix_at(raw([start]), 0), engine, tok, reward, {"calc"})
    assert [(c["name"], c["args"], c["ok"], c["output"]) for c in fresh.tool_calls] == [("calc", "6*7", True, "42")]
    assert fresh.finish_reason == "stop" and fresh.reward == 1.0
    assert tok.decode(fresh.tokens, skip_special_tokens=True) == "<call>calc: 6*7</call><result>42</result>answer: 42"
    assert 0 < fresh.mask.count(0) == len(tok.encode("<result>42</result>", add_special_tokens=False))
    # the stream stopped between the call and its result: the continuation answers the call first
    call = tok.encode("<call>calc: 6*7</call>", add_special_tokens=False)
    events = [start, tokens(1, call), Event("tool_call", 0, "w", 2, {"call_id": "c1", "name": "calc", "args": "6*7"})]
    pending = cont.continue_from(cont.prefix_at(raw(events)), engine, tok, reward, {"calc"})
    assert pending.tool_calls[0]["call_id"] == "c1" and pending.tool_calls[0]["output"] == "42"
    assert tok.decode(pending.tokens, skip_special_tokens=True) == "<result>42</result>answer: 42"
    assert pending.reward == 1.0
    # without the tool enabled the call is an error result, and the episode goes on
    unknown = cont.continue_from(cont.prefix_at(raw(events)), engine, tok, reward, set())
    assert unknown.tool_calls[0]["ok"] is False and "unknown tool 'calc'" in unknown.tool_calls[0]["output"]


def test_a_version_published_as_a_delta_is_made_from_the_chain_for_a_continuation(tmp_path):
    import hashlib

    import torch

    from services.trainer.publish import frozen, serialize, write_weights
    from shared.protocol.streams.versions import Version
    from shared.protocol.weights import delta as weight_delta

    model = torch.nn.Linear(64, 64)
    write_weights(model, tmp_path, 1, "bfloat16")
    base = (tmp_path / "v000001.safetensors").read_bytes()
    with torch.no_grad():
        model.weight[0, :4] += 1.0
    target = serialize(frozen(model, "bfloat16"), 2)
    (tmp_path / "v000002.delta").write_bytes(weight_delta.encode(base, target, 2, 1))
    digest = hashlib.sha256(target).hexdigest()
    path = tmp_path / "v000002.safetensors"
    assert cont.resolve_version([Version(2, str(path), digest, 2, 0.0)], 2, "m") == (str(path), digest)
    assert path.read_bytes() == target
    with pytest.raises(cont.ContinuationError, match="--version 3: weights v3: .* not the published"):
        (tmp_path / "v000003.delta").write_bytes(weight_delta.encode(target, target, 3, 2))
        cont.resolve_version([Version(3, str(tmp_path / "v000003.safetensors"), "0" * 64, 3, 0.0)], 3, "m")

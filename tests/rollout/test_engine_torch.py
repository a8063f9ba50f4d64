"""The built-in torch engine on a real tiny Llama: sampling, resumability,
continuous batching, log-prob correctness and weight swaps."""

from __future__ import annotations

import sys
import time

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from services.ops.launch.tiny_model import (
    CHARACTERS,
    CHAT_TOKENS,
    CHAT_WORDS,
    SPECIAL_TOKENS,
    build_tokenizer,
    load_tokenizer,
    make_tiny_model,
)
from services.rollout.engine import Chunk, EngineError, SamplingParams, TorchEngine, make_engine
from services.rollout.engine.sampler import final_logprobs, sample

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> TorchEngine:
    return TorchEngine(tiny_model_dir, max_batch_size=8)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


class Collector:
    """Gathers chunks per request while stepping an engine."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}
        self.finish: dict[str, str] = {}
        self.versions: set[int] = set()

    def take(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            self.tokens.setdefault(c.request_id, []).extend(c.token_ids)
            self.logprobs.setdefault(c.request_id, []).extend(c.logprobs)
            self.versions.add(c.version)
            if c.finish_reason:
                assert c.request_id not in self.finish, "a request finished twice"
                self.finish[c.request_id] = c.finish_reason

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.take(self.engine.step())

    def drain(self) -> Collector:
        while self.engine.has_unfinished():
            self.step()
        return self


Run = tuple[list[int], list[float], str]


def run_alone(engine: TorchEngine, prompt: list[int], params: SamplingParams, n: int) -> Run:
    engine.add_request("solo", prompt, params, n)
    out = Collector(engine).drain()
    return out.tokens["solo"], out.logprobs["solo"], out.finish["solo"]


def assert_close(a: list[float], b: list[float], tol: float = 1e-4) -> None:
    assert len(a) == len(b)
    assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) < tol


def reference_logprobs(model, prompt: list[int], response: list[int], p: SamplingParams) -> list[float]:
    """Independent recomputation: one plain forward, then the sampling transform row by row."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    out = []
    for row, token in zip(logits, response):
        # greedy: the behaviour is one-hot at the argmax (shared/protocol/episode/logprobs.py)
        if p.temperature == 0:
            out.append(0.0 if int(row.argmax()) == token else float("-inf"))
            continue
        x = row / p.temperature
        if p.top_k:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        probs, order = torch.softmax(x, -1).sort(descending=True)
        cut = order[(probs.cumsum(-1) - probs) >= p.top_p]
        x[cut] = float("-inf")
        out.append(float(torch.log_softmax(x, -1)[token]))
    return out


# --- tokenizer and model files ---------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_tokenizer_vocab_and_special_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 3 + len(CHARACTERS) + len(CHAT_TOKENS) == 103
    assert tok.encode("a b", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "a b"]
    assert tok.decode([1, *tok.encode("hi", add_special_tokens=False), 2], skip_special_tokens=True) == "hi"
    assert tok.encode("\u00e9", add_special_tokens=False) == tok.encode("?", add_special_tokens=False)


def test_chat_words_are_one_token_each_and_plain_tasks_stay_characters(tok):
    # the plain model's tokenizer has none: its embedding rows, hence its random init, are what they were before
    assert len(tok) == 103
    tok = build_tokenizer(chat_words=True)
    call = '<tool_call>{"name": "calc", "arguments": {"e": "7+1"}}</tool_call>'
    ids = tok.encode(call, add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[:2]] == ["<tool_call>", '{"name": ']
    assert tok.decode([ids[-1]]) == "</tool_call>"
    assert tok.decode(ids) == call and len(ids) < len(call) / 2
    assert all(len(tok.encode(w, add_special_tokens=False)) == 1 for w in CHAT_WORDS)
    # the plain task and its answers: one token a character, as before the chat words
    assert tok.encode("17+5=22", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "17+5=22"]


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=CHARACTERS, max_size=80))
def test_tokenizer_round_trip(tok, text):
    # the text of a special token ("<eos>") encodes as that token, as with every HF tokenizer
    assume(not any(special in text for special in SPECIAL_TOKENS + CHAT_TOKENS))
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_make_tiny_model_is_deterministic(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=7)
    b = make_tiny_model(tmp_path / "b", seed=7)
    c = make_tiny_model(tmp_path / "c", seed=8)
    read = lambda d: (tmp_path / d / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)


# --- sampling ---------------------------------------------------------------


def test_same_seed_same_output_different_seed_differs(engine):
    a = run_alone(engine, PROMPTS[0], SamplingParams(seed=1), 24)
    b = run_alone(engine, PROMPTS[0], SamplingParams(seed=1), 24)
    c = run_alone(engine, PROMPTS[0], SamplingParams(seed=2), 24)
    assert a == b
    assert a[0] != c[0]
    assert a[2] == "length" and len(a[0]) == 24


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=3),
        SamplingParams(temperature=0.7, top_k=10, seed=4),
        SamplingParams(temperature=1.3, top_p=0.8, seed=5),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.6, seed=6),
        SamplingParams(temperature=0, seed=7),
    ],
)
def test_logprobs_match_full_forward(engine, model, params):
    tokens, logprobs, _ = run_alone(engine, PROMPTS[2], params, 30)
    assert_close(logprobs, reference_logprobs(model, PROMPTS[2], tokens, params))


def test_sampler_draws_from_the_final_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12).expand(6000, 12)
    params = [SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=3)] * 6000
    tokens, logprobs = sample(logits, params, list(range(6000)))
    final = final_logprobs(logits[:1], params[:1])[0]
    probs = final.exp()
    freq = torch.bincount(torch.tensor(tokens), minlength=12) / 6000
    assert torch.all(freq[probs == 0] == 0)
    assert (freq - probs).abs().max() < 0.03
    # the log-probs themselves, not exp then log again: that round trip differs in the last bit on some CPUs
    assert logprobs == [float(final[t]) for t in tokens]


def test_greedy_is_argmax_and_deterministic(engine, model):
    greedy = SamplingParams(temperature=0, seed=1)
    tokens, _, _ = run_alone(engine, PROMPTS[1], greedy, 20)
    assert run_alone(engine, PROMPTS[1], SamplingParams(temperature=0, seed=99), 20)[0] == tokens
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[1] + tokens])).logits[0, len(PROMPTS[1]) - 1 : -1]
    assert logits.argmax(-1).tolist() == tokens


def test_top_k_one_and_tiny_top_p_equal_greedy(engine):
    greedy = run_alone(engine, PROMPTS[0], SamplingParams(temperature=0), 20)[0]
    assert run_alone(engine, PROMPTS[0], SamplingParams(top_k=1, seed=11), 20)[0] == greedy
    assert run_alone(engine, PROMPTS[0], SamplingParams(top_p=1e-6, seed=12), 20)[0] == greedy


def test_stop_token_included_and_budget_is_length(engine):
    free, _, reason = run_alone(engine, PROMPTS[3], SamplingParams(seed=21), 40)
    assert reason == "length"
    stop = free[6]
    tokens, _, reason = run_alone(engine, PROMPTS[3], SamplingParams(seed=21, stop_token_ids=(stop,)), 40)
    assert reason == "stop"
    assert tokens == free[: free.index(stop) + 1]


def test_max_model_len_ends_with_length(tiny_model_dir):
    small = TorchEngine(tiny_model_dir, max_model_len=12)
    tokens, _, reason = run_alone(small, PROMPTS[2], SamplingParams(seed=1), 100)
    assert (len(tokens), reason) == (12 - len(PROMPTS[2]), "length")
    with pytest.raises(EngineError, match=r"'too-long'.*12 tokens.*max_model_len=12"):
        small.add_request("too-long", list(range(3, 15)), SamplingParams(), 5)
    assert not small.has_unfinished()


def test_max_model_len_defaults_to_position_embeddings(engine):
    assert engine.max_model_len == 512 and engine.version == 0


def test_bad_requests_are_rejected(engine):
    with pytest.raises(EngineError, match="max_new_tokens"):
        engine.add_request("r", [5], SamplingParams(), 0)
    with pytest.raises(EngineError, match="top_p"):
        engine.add_request("r", [5], SamplingParams(top_p=0), 3)
    engine.add_request("dup", [5], SamplingParams(), 3)
    with pytest.raises(EngineError, match="already"):
        engine.add_request("dup", [5], SamplingParams(), 3)
    engine.abort_all()
    assert not engine.has_unfinished()


# --- continuous batching and abort/resume -------------------------------------


def requests() -> list[tuple[str, list[int], SamplingParams, int]]:
    return [
        ("a", PROMPTS[0], SamplingParams(seed=31), 30),
        ("b", PROMPTS[1], SamplingParams(temperature=0.8, top_k=15, seed=32), 25),
        ("c", PROMPTS[2], SamplingParams(temperature=1.2, top_p=0.9, seed=33), 35),
        ("d", PROMPTS[3], SamplingParams(temperature=0), 20),
    ]


@pytest.fixture(scope="module")
def solo_runs(engine) -> dict[str, Run]:
    return {rid: run_alone(engine, prompt, p, n) for rid, prompt, p, n in requests()}


@pytest.mark.parametrize("max_batch_size", [8, 2])
def test_continuous_batching_matches_solo_runs(tiny_model_dir, engine, solo_runs, max_batch_size):
    eng = engine if max_batch_size == 8 else TorchEngine(tiny_model_dir, max_batch_size=max_batch_size)
    out = Collector(eng)
    for i, (rid, prompt, p, n) in enumerate(requests()):
        eng.add_request(rid, prompt, p, n)
        # later requests join while earlier ones are mid-decode
        out.step(i + 2)
    out.drain()
    for rid, (tokens, logprobs, reason) in solo_runs.items():
        assert out.tokens[rid] == tokens
        assert_close(out.logprobs[rid], logprobs)
        assert out.finish[rid] == reason


@pytest.mark.parametrize("k", [0, 1, 5, 17])
def test_abort_and_resume_reproduces_uninterrupted_run(engine, solo_runs, k):
    """Abort request 'c' after k steps while others run, resume it from its partial response."""
    out = Collector(engine)
    for rid, prompt, p, n in requests():
        engine.add_request(rid, prompt, p, n)
    out.step(k)
    rest = engine.abort("c")
    assert rest is not None and rest.finish_reason == "abort"
    out.take([rest])
    partial = out.tokens.get("c", [])
    assert len(partial) == k and out.finish["c"] == "abort"
    _, prompt, params, n = requests()[2]
    out.step(3)
    engine.add_request("c2", prompt + partial, params, n - len(partial), start_index=len(partial))
    out.drain()
    tokens, logprobs, reason = solo_runs["c"]
    assert partial + out.tokens["c2"] == tokens
    assert_close(out.logprobs.get("c", []) + out.logprobs["c2"], logprobs)
    assert out.finish["c2"] == reason
    for rid in "abd":
        assert out.tokens[rid] == solo_runs[rid][0]


def test_rows_leave_the_batch_and_padding_is_trimmed(tiny_model_dir):
    eng = TorchEngine(tiny_model_dir)
    eng.add_request("long", list(range(3, 43)), SamplingParams(), 50)
    eng.add_request("short", PROMPTS[1], SamplingParams(), 50)
    for _ in range(3):
        eng.step()
    runner = eng.runner
    assert runner.rows == ["long", "short"] and runner.mask.shape == (2, 42)
    eng.abort("long")
    eng.step()
    assert runner.rows == ["short"] and runner.mask.shape == (1, len(PROMPTS[1]) + 3)
    assert all(layer.keys.shape[2] == runner.mask.shape[1] for layer in runner.cache.layers)
    eng.abort_all()
    assert runner.rows == [] and runner.cache is None


def test_abort_waiting_unknown_and_all(tiny_model_dir):
    eng = TorchEngine(tiny_model_dir, max_batch_size=1)
    eng.add_request("run", PROMPTS[0], SamplingParams(), 10)
    eng.add_request("wait", PROMPTS[1], SamplingParams(), 10)
    assert [c.request_id for c in eng.step()] == ["run"]
    assert eng.abort("wait") == Chunk("wait", [], [], 0, "abort")
    assert eng.abort("nope") is None
    eng.add_request("wait2", PROMPTS[1], SamplingParams(), 10)
    chunks = eng.abort_all()
    assert {c.request_id: c.finish_reason for c in chunks} == {"run": "abort", "wait2": "abort"}
    assert not eng.has_unfinished() and eng.step() == []


# --- weights ----------------------------------------------------------------


def test_load_weights_changes_version_and_outputs(tiny_model_dir, model, tmp_path):
    eng = TorchEngine(tiny_model_dir)
    params = SamplingParams(seed=41)
    before = run_alone(eng, PROMPTS[0], params, 20)
    torch.manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn_like(v) for k, v in model.state_dict().items()}
    save_file(perturbed, str(tmp_path / "model.safetensors"))

    eng.add_request("busy", PROMPTS[0], params, 5)
    with pytest.raises(EngineError, match="in flight"):
        eng.load_weights(str(tmp_path), 3)
    eng.abort_all()

    eng.load_weights(str(tmp_path), 3)
    assert eng.version == 3
    eng.add_request("x", PROMPTS[0], params, 20)
    out = Collector(eng).drain()
    assert out.versions == {3}
    assert out.tokens["x"] != before[0]

    bad = tmp_path / "bad.safetensors"
    save_file({"model.nope.weight": torch.zeros(2)}, str(bad))
    with pytest.raises(EngineError, match="missing.*unexpected: model.nope.weight"):
        eng.load_weights(str(bad), 4)
    wrong_shape = tmp_path / "shape.safetensors"
    save_file({**perturbed, "lm_head.weight": torch.zeros(3, 3)}, str(wrong_shape))
    with pytest.raises(EngineError, match="lm_head.weight"):
        eng.load_weights(str(wrong_shape), 4)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not a safetensors file")
    with pytest.raises(EngineError, match="cannot read weights"):
        eng.load_weights(str(garbage), 4)
    with pytest.raises(EngineError, match="no safetensors"):
        eng.load_weights(str(tmp_path / "absent"), 4)
    assert eng.version == 3
    eng.load_weights(f"{tiny_model_dir}/model.safetensors", 5)
    assert run_alone(eng, PROMPTS[0], params, 20) == before


def test_cuda_engine_matches_cpu(tiny_model_dir, solo_runs):
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="CUDA is not available"):
            TorchEngine(tiny_model_dir, device="cuda")
        return
    eng = TorchEngine(tiny_model_dir, device="cuda")
    out = Collector(eng)
    for rid, prompt, p, n in requests():
        eng.add_request(rid, prompt, p, n)
    out.drain()
    for rid, (tokens, logprobs, _) in solo_runs.items():
        assert out.tokens[rid] == tokens
        assert_close(out.logprobs[rid], logprobs, 1e-3)


# --- factory ----------------------------------------------------------------


def test_make_engine(tiny_model_dir, monkeypatch):
    assert isinstance(make_engine("torch", tiny_model_dir, max_batch_size=2), TorchEngine)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(EngineError, match=r"vllm is not installed: pip install '\.\[vllm\]'"):
        make_engine("vllm", tiny_model_dir)
    with pytest.raises(EngineError, match="unknown engine 'tgi'"):
        make_engine("tgi", tiny_model_dir)


def test_the_simulated_slow_engine_costs_its_delays_and_loads_the_real_weights(tiny_model_dir, model, tmp_path):
    """SIMULATED costs for benchmarks (engine/slow.py): a fixed sleep per step and per load, around the real engine."""
    save_file({k: v + 0.5 for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    eng = make_engine("torch", tiny_model_dir, step_delay_ms=1, load_delay_ms=300)
    plain = make_engine("torch", tiny_model_dir)
    assert type(plain) is TorchEngine and type(eng) is not TorchEngine
    t0 = time.monotonic()
    eng.load_weights(str(tmp_path), 2)
    assert time.monotonic() - t0 >= 0.3 and eng.version == eng.inner.version == 2
    eng.add_request("x", PROMPTS[0], SamplingParams(seed=3), 4)
    assert Collector(eng).drain().versions == {2}

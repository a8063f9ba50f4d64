"""Engine benchmark (issue 6): the torch engine vs vLLM on the same tiny model, one run.

    .venv-vllm/bin/python bench/engine_vllm.py [--quick] [--hidden 128] [--layers 2] [--json]

Needs vLLM (CPU build in .venv-vllm, see docs/vllm.md). Builds a tiny random
Llama (head size 32, which vLLM's CPU attention needs) in a temp dir and drives
both engines through the engine contract the rollout worker uses
(add_request / step / abort_all / load_weights), in one process, interleaved
(torch, vllm, then vllm, torch, ...), median over repetitions:

1. Rollout throughput: R requests (prompt P tokens, T new tokens each,
   temperature 1), all added at once, ``step()`` until done: generated tokens/s.
2. Pause: with R requests mid-generation (T/2 tokens in), ``abort_all()``
   (what a worker does on pause) and the resume cost: re-adding every request
   from prompt + tokens so far until each has its next token (re-prefill).
3. Weight reload: ``load_weights`` of a published version (one safetensors file).

vLLM runs in float32 (the trainer's dtype, like the torch engine) and, for
reference, in bfloat16 (what ``dtype=auto`` picks on the CPU build) for throughput only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from services.rollout.engine import SamplingParams, make_engine  # noqa: E402


def throughput(engine, n_req: int, prompt_len: int, new_tokens: int, seed: int) -> float:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=new_tokens)
    for i in range(n_req):
        engine.add_request(f"r{seed}-{i}", [1] + [20 + (i + j) % 60 for j in range(prompt_len - 1)], params, new_tokens)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for c in engine.step())
    elapsed = time.perf_counter() - t0
    assert tokens == n_req * new_tokens, (tokens, n_req * new_tokens)
    return tokens / elapsed


def pause_resume(engine, n_req: int, prompt_len: int, new_tokens: int, seed: int) -> tuple[float, float]:
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=new_tokens)
    prompts = {f"p{seed}-{i}": [1] + [20 + (i + j) % 60 for j in range(prompt_len - 1)] for i in range(n_req)}
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params, new_tokens)
    while min(len(v) for v in got.values()) < new_tokens // 2:
        for c in engine.step():
            got[c.request_id] += c.token_ids
    t0 = time.perf_counter()
    for c in engine.abort_all():
        got[c.request_id] += c.token_ids
    abort_s = time.perf_counter() - t0
    assert not engine.has_unfinished()
    t0 = time.perf_counter()
    for rid, ids in prompts.items():
        engine.add_request(rid, ids + got[rid], params, new_tokens - len(got[rid]), start_index=len(got[rid]))
    waiting = set(prompts)
    while waiting:
        waiting -= {c.request_id for c in engine.step() if c.token_ids}
    resume_s = time.perf_counter() - t0
    engine.abort_all()
    return abort_s, resume_s


def reload(engine, paths: list[str], version: int) -> float:
    t0 = time.perf_counter()
    engine.load_weights(paths[version % 2], version)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    reps = 2 if args.quick else args.reps

    import torch
    import vllm
    from safetensors.torch import load_file, save_file

    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    model_dir = make_tiny_model(
        tmp / "model",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 32,
        intermediate_size=4 * args.hidden,
    )
    base = load_file(f"{model_dir}/model.safetensors")
    paths = []
    for v in range(2):
        gen = torch.Generator().manual_seed(v)
        path = tmp / f"v{v:06d}.safetensors"
        save_file(
            {k: (t + 0.01 * torch.randn(t.shape, generator=gen)).contiguous() for k, t in base.items()}, str(path)
        )
        paths.append(str(path))

    t0 = time.perf_counter()
    engines = {"torch": make_engine("torch", model_dir, max_batch_size=args.requests)}
    start = {"torch": time.perf_counter() - t0}
    for name, dtype in (("vllm", "float32"), ("vllm-bf16", "bfloat16")):
        t0 = time.perf_counter()
        engines[name] = make_engine(
            "vllm",
            model_dir,
            max_batch_size=args.requests,
            vllm_args=json.dumps({"dtype": dtype, "kv_cache_memory_bytes": 256 << 20}),
        )
        start[name] = time.perf_counter() - t0
    dtypes = {
        name: str(e.llm.model_config.dtype).removeprefix("torch.") for name, e in engines.items() if name != "torch"
    }

    # warm-up: first calls allocate, build kernels, fill caches
    for e in engines.values():
        throughput(e, 4, args.prompt, 8, seed=999)
        pause_resume(e, 4, args.prompt, 8, seed=998)
        reload(e, paths, 1)
        reload(e, paths, 0)

    res: dict[str, dict[str, list[float]]] = {
        n: {"tok_s": [], "abort_ms": [], "resume_ms": [], "reload_ms": []} for n in engines
    }
    order = list(engines)
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            e = engines[name]
            res[name]["tok_s"].append(throughput(e, args.requests, args.prompt, args.tokens, seed=rep))
            if name == "vllm-bf16":
                continue
            a, r = pause_resume(e, args.requests, args.prompt, args.tokens, seed=100 + rep)
            res[name]["abort_ms"].append(a * 1e3)
            res[name]["resume_ms"].append(r * 1e3)
            res[name]["reload_ms"].append(reload(e, paths, rep + 1) * 1e3)
    med = {n: {k: statistics.median(v) if v else float("nan") for k, v in r.items()} for n, r in res.items()}
    # per-rep ratios (the two were measured back to back), then their median: steadier on a shared box
    ratio = {
        k: statistics.median(v / t for v, t in zip(res["vllm"][k], res["torch"][k]))
        for k in ("tok_s", "abort_ms", "resume_ms", "reload_ms")
    }
    ratio["bf16_tok_s"] = statistics.median(b / v for b, v in zip(res["vllm-bf16"]["tok_s"], res["vllm"]["tok_s"]))
    for e in engines.values():
        if hasattr(e, "close"):
            e.close()

    if args.json:
        print(json.dumps({"median": med, "ratios": ratio, "start_s": start, "dtypes": dtypes, "reps": res}, indent=1))
        return
    print(
        f"vllm {vllm.__version__}, torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    )
    print(
        f"tiny Llama: hidden {args.hidden}, {args.layers} layers, head size 32, vocab 100; "
        f"{args.requests} requests x {args.prompt} prompt tokens -> {args.tokens} new tokens, temperature 1; "
        f"median of {reps} interleaved reps"
    )
    print(
        f"{'engine':20} | {'start s':>7} | {'rollout tok/s':>13} | {'abort_all ms':>12} | {'resume ms':>9} | "
        f"{'reload ms':>9}"
    )
    for name, m in med.items():
        label = name if name == "torch" else f"{name} ({dtypes[name]})"
        print(
            f"{label:20} | {start[name]:7.1f} | {m['tok_s']:13,.0f} | {m['abort_ms']:12.2f} | "
            f"{m['resume_ms']:9.1f} | {m['reload_ms']:9.1f}"
        )
    print(
        f"vllm/torch (float32), median of per-rep ratios: rollout tok/s x{ratio['tok_s']:.2f}, "
        f"abort_all time x{ratio['abort_ms']:.2f}, resume time x{ratio['resume_ms']:.2f}, "
        f"reload time x{ratio['reload_ms']:.2f}; vllm bf16/fp32 tok/s x{ratio['bf16_tok_s']:.2f}"
    )
    print(
        "per-rep rollout tok/s: "
        + "; ".join(f"{n} " + " ".join(f"{x:,.0f}" for x in r["tok_s"]) for n, r in res.items())
    )
    print(
        "(abort_all = what a worker does on pause; resume = re-add every request from prompt + tokens so far "
        "until each has its next token; reload = load_weights of one safetensors file incl. vLLM's prefix-cache reset)"
    )


if __name__ == "__main__":
    main()

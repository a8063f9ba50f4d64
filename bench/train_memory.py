"""Peak trainer memory and tokens/s of one training step, for a ~100M-parameter random-init Llama, under the
trainer's memory options (services/trainer/model.py): fp32, bf16 autocast, gradient checkpointing, LoRA.

Each option runs in its own fresh process (a clean peak): load the policy through ``load_policy`` (the
trainer's code), one warm-up step, then ``--steps`` timed steps of the trainer's shape (forward, fp32
log-probs of the targets, backward, clip, AdamW). Peak memory: on CPU the process's resident set sampled
every 2 ms minus what it held before the model was loaded; on CUDA ``torch.cuda.max_memory_allocated``.
Printed side by side as ratios to fp32 from the same run.

    python bench/train_memory.py                 # CPU, 1 timed step of 2 x 128 tokens
    python bench/train_memory.py --device cuda --batch 8 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPTIONS = {
    "fp32": {},
    "bf16-autocast": {"dtype": "bfloat16"},
    "grad-checkpointing": {"grad_checkpointing": True},
    "lora-r16": {"lora_rank": 16, "lora_alpha": 32.0},
}
MODEL = dict(
    hidden_size=768,
    num_hidden_layers=10,
    num_attention_heads=12,
    num_key_value_heads=12,
    intermediate_size=2048,
    vocab_size=16000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def make_model(path: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


class PeakRSS:
    def __init__(self):
        import psutil

        self.proc, self.peak, self.stop = psutil.Process(), 0, False
        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def done(self) -> int:
        self.stop = True
        self.thread.join()
        return self.peak - self.base


def one(model_dir: str, option: str, device: str, batch: int, seq: int, steps: int) -> dict:
    import torch

    from services.trainer.model import load_policy
    from shared.protocol.episode.logprobs import token_logprobs
    from shared.runtime.config.keys import Config

    torch.manual_seed(0)
    meter = PeakRSS() if device == "cpu" else None
    policy = load_policy(Config(model_dir=model_dir, device=device, **OPTIONS[option]))
    model = policy.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99), weight_decay=0.0)
    ids = torch.randint(3, MODEL["vocab_size"], (batch, seq), device=policy.device)
    attn = torch.ones_like(ids)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()

    def step():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        loss = -token_logprobs(logits, ids[:, 1:]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    # warm-up: optimizer state allocated, kernels chosen
    step()
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = meter.done() if meter else torch.cuda.max_memory_allocated()
    trainable = sum(p.numel() for p in policy.trainable_parameters())
    return {
        "option": option,
        "peak_mb": peak / 2**20,
        "tokens_per_s": batch * seq * steps / seconds,
        "trainable": trainable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one option may take (then left out)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL_DIR", "OPTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one(args.one[0], args.one[1], args.device, args.batch, args.seq, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        n = make_model(Path(tmp) / "model")
        print(
            f"random-init Llama, {n / 1e6:.0f}M parameters; {args.batch} x {args.seq} tokens per step, "
            f"{args.steps} timed steps after 1 warm-up, device {args.device}, {args.threads} threads",
            flush=True,
        )
        rows = []
        for option in OPTIONS:
            try:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--one",
                        str(Path(tmp) / "model"),
                        option,
                        "--device",
                        args.device,
                        "--batch",
                        str(args.batch),
                        "--seq",
                        str(args.seq),
                        "--steps",
                        str(args.steps),
                        "--threads",
                        str(args.threads),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                    env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
                )
            except subprocess.TimeoutExpired:
                print(f"{option}: over {args.timeout:.0f} s, left out", flush=True)
                continue
            if out.returncode:
                sys.exit(f"{option} failed:\n{out.stderr[-2000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print(f"{'option':<20}{'peak MB':>10}{'x fp32':>8}{'tokens/s':>10}{'x fp32':>8}{'trainable':>12}")
    for r in rows:
        print(
            f"{r['option']:<20}{r['peak_mb']:>10.0f}{r['peak_mb'] / base['peak_mb']:>8.2f}"
            f"{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base['tokens_per_s']:>8.2f}{r['trainable'] / 1e6:>11.1f}M"
        )


if __name__ == "__main__":
    main()

"""Real tiny torch models for tests: random init, or overfit on a few scripts
so that greedy decoding writes exactly what a test needs (e.g. a tool call)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.ops.launch.tiny_model import make_tiny_model


def fit_rows(
    model_dir: str | Path, model, pad_id: int, rows: list[tuple[list[int], int]], steps: int, lr: float
) -> str:
    """Train ``model`` on rows of (token ids, index of the first labelled token), save it to ``model_dir``."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, start) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, start : len(row)] = torch.tensor(row[start:])
        mask[i, : len(row)] = 1
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(str(model_dir))
    return str(model_dir)


def overfit(model_dir: str | Path, texts: list[tuple[str, str]], steps: int = 300, lr: float = 3e-3) -> str:
    """Train the model at ``model_dir`` in place on (prompt, response) pairs,
    response followed by <eos>, until greedy decoding reproduces them."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = []
    for prompt, response in texts:
        p = tok.encode(prompt, add_special_tokens=False)
        r = tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]
        rows.append((p + r, len(p)))
    return fit_rows(model_dir, model, tok.pad_token_id, rows, steps, lr)


def scripted_model(out_dir: str | Path, texts: list[tuple[str, str]]) -> str:
    make_tiny_model(str(out_dir), seed=1)
    return overfit(out_dir, texts)


def nudged_weights(model_dir: str | Path, out: Path, version: int) -> tuple[Path, str]:
    """A real new version for sync tests: the model with every weight moved by 0.01 x ``version``, written as the
    trainer writes it (safetensors, sha256)."""
    from services.trainer.publish import write_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * version)
    return write_weights(model, out, version)

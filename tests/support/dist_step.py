"""The same two-minibatch training step on the same batch, in one process (``python -m tests.support.dist_step``) or
data-parallel (``torchrun --nproc-per-node 2 -m tests.support.dist_step``): tests/trainer/test_distributed.py compares
the weights. Rank 0 builds the batch and sends it as the trainer does (distributed.broadcast, broadcast_batch).

    python -m tests.support.dist_step MODEL_DIR OUT_DIR   ->  OUT_DIR/<optimizer>.safetensors and <optimizer>.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from services.trainer import distributed
from services.trainer.batch import build_batch
from services.trainer.step import StepConfig, train_on_batch
from shared.protocol.episode.fold import fold
from tests.support.helpers import finished, raw, started, tokens

# optimizer -> StepConfig
RUNS = {"sgd": dict(micro_batch_tokens=0), "adamw": dict(micro_batch_tokens=40)}


def make_groups() -> list[list]:
    """Three groups of 2, 3 and 2 episodes (7 rows: the ranks' shares differ), lengths 3 to 14 tokens."""
    rng = random.Random(7)
    groups = []
    for g, size in enumerate((2, 3, 2)):
        eps = []
        for i in range(size):
            prompt = [rng.randrange(3, 90) for _ in range(3 + rng.randrange(3))]
            ids = [rng.randrange(3, 90) for _ in range(3 + rng.randrange(12))]
            events = [
                started(episode_id=f"g{g}-{i}", prompt=prompt),
                tokens(1, ids, logprobs=[-rng.random() * 3 for _ in ids]),
                finished(2, reward=float(i % 2)),
            ]
            eps.append(fold(raw(events)))
        groups.append(eps)
    return groups


def main(model_dir: str, out: str) -> None:
    launched = distributed.launched()
    shard = distributed.init(torch.device("cpu")) if launched else distributed.LOCAL
    for name, step_kw in RUNS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tied = distributed.tied_names(model)
        if launched:
            distributed.shard_model(model)
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.1)
            if name == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)
        )
        batch = build_batch(make_groups(), pad_id=0) if shard.main else None
        if launched:
            ids = [(f"{g}-0", f"g{g}", [f"g{g}-{i}" for i in range(n)]) for g, n in enumerate((2, 3, 2))]
            message = distributed.broadcast(shard, distributed.step_message(ids, batch) if shard.main else None)
            batch = distributed.broadcast_batch(shard, message, batch)
        stats = train_on_batch(model, opt, batch, StepConfig(ppo_minibatches=2, **step_kw), shard=shard)
        state = (
            distributed.full_state(model, tied)
            if launched
            else {k: v for k, v in model.state_dict().items() if k not in tied}
        )
        if shard.main:
            save_file({k: v.contiguous() for k, v in state.items()}, str(Path(out) / f"{name}.safetensors"))
            (Path(out) / f"{name}.json").write_text(json.dumps(stats))
    distributed.close(sync=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Data-parallel training under torchrun: the process group, the sharded model, rank 0's command channel.

``torchrun --nproc-per-node N -m services.trainer ...`` starts N trainer processes (env RANK, WORLD_SIZE).
Rank 0 is the trainer of the single-process path: it alone reads the samples stream, replays and judges
groups, owns ``consumed``/``taken``, the ledger, the acknowledgements, the gate refunds, the version events
and the heartbeat. The other ranks follow: each waits for rank 0's next command and joins its collectives.

The channel: a command is JSON bytes in a uint8 tensor, broadcast from rank 0 (its length first, as an
int64 tensor); no pickle (``broadcast_object_list`` would unpickle). A ``step`` command carries the batch's
(entry id, group id, episode ids) list and the batch's shape; the batch tensors follow in one float64
broadcast (every value exact: token ids < 2**53, float32 -> float64 -> float32). Every rank then holds the
same batch, plans the same minibatches and trains its share of each one's rows (services/trainer/step.py).

The model is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``: each decoder layer, then the root);
it runs on CPU with gloo (torch 2.13) and on GPUs with nccl.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.trainer.batch import Batch

# a collective waiting longer fails; an idle rank 0 sends `idle` well before
TIMEOUT = timedelta(minutes=30)
# how often an idle rank 0 tells the followers it is alive
IDLE_EVERY_S = 60.0
_FIELDS = (
    ("input_ids", torch.long, "BL"),
    ("attention_mask", torch.long, "BL"),
    ("targets", torch.long, "BT"),
    ("loss_mask", torch.float32, "BT"),
    ("behav_logp", torch.float32, "BT"),
    ("versions", torch.long, "BT"),
    ("advantages", torch.float32, "B"),
    ("temperature", torch.float32, "B"),
    ("top_k", torch.long, "B"),
    ("top_p", torch.float32, "B"),
    ("rewards", torch.float32, "B"),
)
# Batch's int fields, in order
_COUNTS = ("policy_failures", "greedy_tokens", "stale_tokens_masked", "version")


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks; ``LOCAL`` is the single process (every reduction the identity)."""

    rank: int = 0
    size: int = 1
    # where collectives' tensors live (cuda under nccl)
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)


LOCAL = Shard()


def launched() -> bool:
    """Under torchrun (or anything that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: torch.device) -> Shard:
    """Join the process group: gloo on CPU, nccl on CUDA (each rank on GPU ``LOCAL_RANK``)."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return Shard(dist.get_rank(), dist.get_world_size(), device)


def close(sync: bool = False) -> None:
    """Leave the process group. ``sync`` (a clean exit, every rank here): wait for the others first, because gloo
    aborts a rank ("terminate called without an active exception") whose peer tears its pairs down mid-exit."""
    if dist.is_initialized():
        if sync and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def tied_names(model) -> set[str]:
    """State-dict names that repeat an earlier tensor (a tied lm_head): published once, as single-process does."""
    seen, tied = set(), set()
    for name, value in model.state_dict().items():
        if value.data_ptr() in seen:
            tied.add(name)
        seen.add(value.data_ptr())
    return tied


def shard_model(model) -> None:
    """FSDP2 in place: each decoder layer its own unit (weights gathered layer by layer), then the root."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)


def full_state(model, drop: set[str]) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU, on rank 0 ({} elsewhere); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.contiguous() for k, v in state.items() if k not in drop}


def all_finite(model, shard: Shard) -> bool:
    """Every weight finite, on every rank (each checks its local shard). A NaN or an infinity makes its tensor's sum
    non-finite: one reduction per tensor instead of a mask as large as the model; only a non-finite sum (which finite
    weights can give only by overflowing float32's range) is checked element by element."""
    local = all(
        bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
        for t in (getattr(p, "_local_tensor", p).detach() for p in model.parameters())
    )
    return shard.sum([0.0 if local else 1.0])[0] == 0.0


def as_float(value) -> float:
    """A reduced scalar (a DTensor under FSDP2) as a python float."""
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


# --- rank 0's commands
def encode(message: dict) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)


def decode(data: torch.Tensor) -> dict:
    try:
        message = json.loads(bytes(data.cpu().numpy()).decode())
    except ValueError as exc:
        raise RuntimeError(f"trainer rank command: not JSON ({exc})") from None
    if not isinstance(message, dict) or "op" not in message:
        raise RuntimeError(f"trainer rank command: expected an object with 'op', got {str(message)[:80]!r}")
    return message


def broadcast(shard: Shard, message: dict | None = None) -> dict:
    """Rank 0 sends ``message``; every rank returns it."""
    data = encode(message).to(shard.device) if shard.main else None
    size = torch.tensor([data.numel() if shard.main else 0], dtype=torch.long, device=shard.device)
    dist.broadcast(size, 0)
    if not shard.main:
        data = torch.empty(int(size), dtype=torch.uint8, device=shard.device)
    dist.broadcast(data, 0)
    return decode(data)


def step_message(groups: list[tuple[str, str, list[str]]], batch: Batch) -> dict:
    return {
        "op": "step",
        "groups": [list(g) for g in groups],
        "episode_ids": batch.episode_ids,
        "shape": list(batch.input_ids.shape),
        # routing replay: [layers, top_k] of the batch's routes, sent after the other tensors
        "routes": None if batch.routes is None else list(batch.routes.shape[2:]),
        **{k: getattr(batch, k) for k in _COUNTS},
    }


def broadcast_batch(shard: Shard, message: dict, batch: Batch | None = None) -> Batch:
    """After a ``step`` message: rank 0 sends ``batch``'s tensors, every rank returns the batch."""
    b, width = message["shape"]
    routed = message.get("routes")
    dims = {"BL": (b, width), "BT": (b, width - 1), "B": (b,), "BTR": (b, width - 1, *(routed or (0, 0)))}
    fields = _FIELDS + ((("routes", torch.int16, "BTR"),) if routed else ())
    sizes = [int(torch.Size(dims[kind]).numel()) for _, _, kind in fields]
    if shard.main:
        flat = torch.cat([getattr(batch, name).reshape(-1).double() for name, _, _ in fields]).to(shard.device)
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float64, device=shard.device)
    dist.broadcast(flat, 0)
    parts = flat.cpu().split(sizes)
    tensors = [part.to(dtype).reshape(dims[kind]) for part, (_, dtype, kind) in zip(parts, fields)]
    routes = tensors.pop() if routed else None
    return Batch(*tensors, list(message["episode_ids"]), *(int(message[k]) for k in _COUNTS), routes=routes)

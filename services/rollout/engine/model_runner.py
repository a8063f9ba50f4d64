"""The only part of the torch engine that touches the model: loading, weight
swaps, prefill and batched incremental decoding over one shared KV cache.

Rows of the batch are requests. Every row is left-padded to the common cache
length; the 2-D attention mask hides the padding and explicit position_ids
give each row its own positions, so rows of different lengths decode together
and can join (prefill, then merge with left padding) or leave (drop the row,
then trim all-padding columns) between decode steps."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache, DynamicLayer

from services.rollout.engine.base import EngineError
from shared.protocol.episode.routes import canonical
from shared.runtime.moe.routers import Routers, RoutingUnsupported


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {device!r} requested but CUDA is not available")
    return dev


class ModelRunner:
    def __init__(
        self, model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32, routing_replay: bool = False
    ):
        self.device = resolve_device(device)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load model from {model_dir!r}: {exc}") from exc
        self._check_servable(model.config, model_dir)
        self.model = model.to(self.device).eval()
        # a mixture of experts with routing_replay on: every forward records its routers' choices
        self.routers = None
        if routing_replay:
            try:
                self.routers = Routers.of(self.model)
            except RoutingUnsupported as exc:
                raise EngineError(f"model at {model_dir!r}: {exc}") from None
        if self.routers is not None:
            self.routers.recording = True
        self.route_shape = self.routers.shape if self.routers is not None else None
        # the KV cache's name, in and out: `cache` from transformers 5.24, `past_key_values` before (deprecated
        # in 5.24, gone in 5.40; vLLM 0.32 pins transformers < 5.20, so both are in use)
        self.cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.pad_id = self.model.config.pad_token_id or 0
        self.rows: list[str] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    @torch.inference_mode()
    def prefill(self, requests: list[tuple[str, list[int]]]) -> torch.Tensor:
        """Run the prompts of new rows in one left-padded forward, merge their cache
        into the batch, and return their last-position logits [n, V]."""
        width = max(len(ids) for _, ids in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, (_, tokens) in enumerate(requests):
            ids[i, width - len(tokens) :] = torch.tensor(tokens)
            mask[i, width - len(tokens) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, self.cache_name)
        self._check_layers(cache)
        self._merge([rid for rid, _ in requests], cache, mask, mask.sum(-1))
        return out.logits[:, -1]

    @torch.inference_mode()
    def decode(self, last_tokens: list[int]) -> torch.Tensor:
        """Feed each row its last sampled token (in ``self.rows`` order); return next-token logits [B, V]."""
        ids = torch.tensor(last_tokens, dtype=torch.long, device=self.device)[:, None]
        mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=self.positions[:, None],
            use_cache=True,
            **{self.cache_name: self.cache},
        )
        self.cache, self.mask, self.positions = getattr(out, self.cache_name), mask, self.positions + 1
        return out.logits[:, -1]

    def last_routes(self, rows: int) -> np.ndarray | None:
        """The last forward's routes at each of its ``rows`` rows' last position, [rows, layers, top_k] in the log's
        form (shared/protocol/episode/routes.py); None when this runner records none."""
        if self.routers is None:
            return None
        return canonical(self.routers.last_rows(rows).cpu().numpy(), self.route_shape)

    def remove(self, request_ids: Iterable[str]) -> None:
        gone = set(request_ids) & set(self.rows)
        if not gone:
            return
        keep = [i for i, rid in enumerate(self.rows) if rid not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.reset()
            return
        index = torch.tensor(keep, device=self.device)
        used = self.mask[index].any(0).nonzero()
        first = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask, self.positions = self.mask[index, first:], self.positions[index]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, first:], layer.values[index, :, first:]

    def reset(self) -> None:
        self.rows, self.cache = [], None
        self.mask = self.mask[:0, :0]
        self.positions = self.positions[:0]

    @torch.inference_mode()
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into the model, all or nothing; tied weights may be left out."""
        own = self.model.state_dict()
        provided = {own[k].data_ptr() for k in tensors if k in own}
        missing = sorted(k for k in own if k not in tensors and own[k].data_ptr() not in provided)
        unexpected = sorted(k for k in tensors if k not in own)
        mismatched = sorted(
            f"{k} {tuple(v.shape)} != {tuple(own[k].shape)}"
            for k, v in tensors.items()
            if k in own and v.shape != own[k].shape
        )
        problems = [
            f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", mismatched))
            if items
        ]
        if problems:
            raise EngineError("weights do not match the model: " + "; ".join(problems))
        for k, v in tensors.items():
            own[k].copy_(v.to(dtype=own[k].dtype, device=own[k].device))

    def _merge(self, rows: list[str], cache: DynamicCache, mask: torch.Tensor, lengths: torch.Tensor) -> None:
        if self.cache is None:
            self.rows, self.cache, self.mask, self.positions = rows, cache, mask, lengths
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers):
            old.keys = torch.cat([_pad_left(old.keys, width, 2), _pad_left(new.keys, width, 2)])
            old.values = torch.cat([_pad_left(old.values, width, 2), _pad_left(new.values, width, 2)])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])
        self.positions = torch.cat([self.positions, lengths])
        self.rows = self.rows + rows

    @staticmethod
    def _check_servable(config, model_dir: str) -> None:
        """Refuse at start a model whose KV cache is not plain full attention (sliding windows and the like):
        the batch merges and trims every layer's cache by position, which such a cache does not allow."""
        window = getattr(config.get_text_config(), "sliding_window", None)
        works = (
            "engine 'vllm' serves it; or, while prompt + max_tokens stay within the window, set \"layer_types\" "
            'to "full_attention" for every layer in its config.json and keep "sliding_window" (a null '
            "sliding_window breaks the model)"
        )
        try:
            layers = DynamicCache(config=config).layers
        # e.g. sliding_window null on a model whose layers slide
        except (TypeError, ValueError) as exc:
            raise EngineError(
                f"the torch engine cannot serve the model at {model_dir!r}: its KV cache cannot be "
                f"built ({str(exc).splitlines()[0]}; sliding_window={window}); {works}"
            ) from None
        kinds = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
        if kinds:
            raise EngineError(
                f"the torch engine cannot serve the model at {model_dir!r}: its cache has {kinds} layers "
                f"(sliding_window={window}); it supports full-attention KV caches only: {works}"
            )

    @staticmethod
    def _check_layers(cache: DynamicCache) -> None:
        kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
        if kinds:
            raise EngineError(f"the torch engine supports full-attention KV caches only, got {sorted(kinds)}")


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [extra, 0]
    return F.pad(t, pad)

"""Whether a model is a mixture of experts, and the shape of its expert routes, read from its Hugging Face config.

The one place the engines and the trainer decide it, so they agree on which layers count as MoE layers (the
``layers`` of a route array) and on top-k. Reads the config's fields only; no model is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.protocol.episode.routes import RouteShape


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _text(config: Any) -> Any:
    """The language model's config: a multimodal config keeps it in ``text_config``."""
    return _field(config, "text_config") or config


def _positive_int(config: Any, name: str) -> int:
    value = _field(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model config field {name!r}: expected a positive integer for a MoE model, got {value!r}")
    return value


def _experts(config: Any) -> int:
    """Experts per MoE layer; 0 for a dense model (no expert count, or Qwen-MoE's num_experts=0)."""
    experts = _field(config, "num_experts")
    for other in ("num_local_experts", "n_routed_experts"):
        if experts is None:
            experts = _field(config, other)
    if not experts:
        return 0
    return _positive_int({"num_experts": experts}, "num_experts")


def moe_layers(config: Any) -> tuple[int, ...]:
    """Indices of the decoder layers whose MLP is a mixture of experts, in order (route layer j is the j-th of
    them); empty for a dense model. A layer is a MoE layer unless ``mlp_only_layers`` names it or it falls between
    ``decoder_sparse_step`` strides (Qwen-MoE: layer i is sparse when (i + 1) % step == 0); configs without those
    fields (Mixtral, OLMoE) have every layer sparse; a DeepSeek-style config keeps its first
    ``first_k_dense_replace`` layers dense."""
    config = _text(config)
    if not _experts(config):
        return ()
    num_layers = _positive_int(config, "num_hidden_layers")
    step = _field(config, "decoder_sparse_step", 1)
    step = _positive_int({"decoder_sparse_step": 1 if step is None else step}, "decoder_sparse_step")
    dense_only = _field(config, "mlp_only_layers", None) or ()
    if not isinstance(dense_only, (list, tuple, set)) or not all(isinstance(i, int) for i in dense_only):
        raise ValueError(f"model config field 'mlp_only_layers': expected a list of layer indices, got {dense_only!r}")
    dense_only = set(dense_only)
    first = _field(config, "first_k_dense_replace", 0) or 0
    return tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0 and i >= first)


def route_shape_of(config: Any) -> RouteShape | None:
    """The routes of the model ``config`` describes (a transformers ``PretrainedConfig`` or a config.json dict);
    None for a dense model. Raises ValueError in one line naming the field when a MoE config is malformed.

    Experts per layer: ``num_experts`` (Qwen3-MoE, OLMoE) or ``num_local_experts`` (Mixtral); top-k:
    ``num_experts_per_tok``; layers: those ``moe_layers`` counts."""
    layers = moe_layers(config)
    if not layers:
        return None
    config = _text(config)
    experts = _experts(config)
    top_k = _positive_int(config, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"model config field 'num_experts_per_tok': {top_k} exceeds the {experts} experts per layer")
    return RouteShape(layers=len(layers), top_k=top_k, experts=experts)

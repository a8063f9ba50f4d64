"""The routers of a mixture-of-experts model: found, recorded while sampling, and forced while training (R3).

Every family listed in ``SOFTMAX_TOP_K`` routes alike: its router module returns ``(logits, scores, indices)`` where
``indices`` are the top-k experts of ``softmax(logits)`` and ``scores`` their probabilities, renormalised over the
k when the module's ``norm_topk_prob`` is true (the families without the attribute always renormalise). One forward
hook per router serves both uses:

- recording keeps each router's ``indices`` of the last forward (the rollout engine takes the rows it sampled);
- forcing replaces ``indices`` with the logged ones where a row has a route, and recomputes ``scores`` from the
  router's own logits at those experts, so the gate weights still train (their gradient flows through the
  chosen experts' probabilities) while the choice stays the behaviour policy's. It also notes where the router's
  own choice differs (``moved``): the route mismatch replay removes, measured on the same forward.

A model with another router is refused where routing replay is asked for (``RoutingUnsupported``), and
``Routers.check_replay`` proves on a real forward that forcing a model's own choices reproduces its logits.
"""

from __future__ import annotations

import torch

from shared.protocol.episode.routes import RouteShape

# router classes whose choice is the top-k of a softmax over the experts (see the module docstring)
SOFTMAX_TOP_K = (
    "Qwen2MoeTopKRouter",
    "Qwen3MoeTopKRouter",
    "Qwen3_5MoeTopKRouter",
    "Qwen3NextTopKRouter",
    "MixtralTopKRouter",
    "OlmoeTopKRouter",
    "FlexOlmoTopKRouter",
)


class RoutingUnsupported(ValueError):
    """The model is a mixture of experts whose router this module cannot record or force."""


def _looks_like_router(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Router") or name.endswith("TopKRouter") or name.endswith("TopkRouter")


class Routers:
    """The routers of one model, in layer order, with the hooks that record and force their choices."""

    def __init__(self, model: torch.nn.Module):
        found = [m for m in model.modules() if _looks_like_router(m)]
        unknown = sorted({type(m).__name__ for m in found if type(m).__name__ not in SOFTMAX_TOP_K})
        if unknown:
            raise RoutingUnsupported(
                f"routing replay does not know this model's router ({', '.join(unknown)}; it knows "
                f"{', '.join(SOFTMAX_TOP_K)}): set routing_replay = false"
            )
        self.modules = found
        experts = {int(m.num_experts) for m in found}
        top_k = {int(m.top_k) for m in found}
        if len(experts) > 1 or len(top_k) > 1:
            raise RoutingUnsupported(
                f"routing replay needs one expert count and one top-k across layers, this model has experts "
                f"{sorted(experts)}, top-k {sorted(top_k)}: set routing_replay = false"
            )
        self.shape = RouteShape(len(found), top_k.pop(), experts.pop()) if found else None
        # per layer: the indices [tokens, k] of the last forward (recording)
        self.recorded: list[torch.Tensor | None] = [None] * len(found)
        self.recording = False
        # [tokens, L, k] long, -1 where the router chooses itself; flattened like the routers' input (forcing)
        self.forced: torch.Tensor | None = None
        # [tokens] whether the router would have chosen other experts than the forced ones in some layer
        self.moved: torch.Tensor | None = None
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(found)]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "Routers | None":
        """The model's routers, or None for a dense model."""
        routers = cls(model)
        if routers.shape is None:
            routers.remove()
            return None
        return routers

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def force(self, routes: torch.Tensor | None) -> None:
        """Route the next forwards' positions through ``routes`` [batch, seq, L, k] (-1: the router's own choice);
        None: every router chooses. Stays set until changed, so a backward that recomputes the forward
        (activation checkpointing) routes as the forward did."""
        self.forced = None if routes is None else routes.reshape(-1, *routes.shape[-2:])
        self.moved = None if routes is None else torch.zeros(self.forced.shape[0], dtype=torch.bool)

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, indices = output
            if self.recording:
                self.recorded[layer] = indices.detach()
            if self.forced is None:
                return None
            forced = self.forced[:, layer].to(indices.device)
            if forced.shape != indices.shape:
                raise RuntimeError(
                    f"routing replay: routes for {forced.shape[0]} positions, the router saw {indices.shape[0]}"
                )
            use = forced[:, :1] >= 0
            own = indices.detach().sort(dim=-1).values != forced.sort(dim=-1).values
            self.moved |= (use[:, 0] & own.any(dim=-1)).cpu()
            chosen = torch.where(use, forced, indices)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", True):
                probs = probs / probs.sum(dim=-1, keepdim=True)
            return logits, probs.to(scores.dtype), chosen

        return hook

    def last_rows(self, batch: int) -> torch.Tensor:
        """The recorded choices at each row's last position of the last forward: [batch, L, k] long."""
        return torch.stack([r.view(batch, -1, r.shape[-1])[:, -1] for r in self.recorded], dim=1)

    @torch.no_grad()
    def check_replay(self, model: torch.nn.Module, vocab: int, length: int = 16) -> float:
        """Forward a random sequence recording its routes, then again forcing them: the largest logit difference
        (0 where forcing reproduces the router; ``RoutingUnsupported`` above 1e-4)."""
        ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
        device = next(model.parameters()).device
        ids = ids.to(device)
        self.recording, saved = True, self.forced
        self.forced = None
        try:
            plain = model(input_ids=ids).logits.float()
            routes = torch.stack(self.recorded, dim=1).view(2, length, self.shape.layers, self.shape.top_k)
            self.force(routes)
            forced = model(input_ids=ids).logits.float()
        finally:
            self.recording, self.forced = False, saved
        diff = float((plain - forced).abs().max())
        if diff > 1e-4:
            raise RoutingUnsupported(
                f"routing replay does not reproduce this model's routing (logits differ by {diff:.2e} when its own "
                f"choices are forced): set routing_replay = false"
            )
        return diff

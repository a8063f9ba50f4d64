"""`streamrl replay --routes --version V`: the experts another version's routers choose for an episode's tokens,
beside the logged ones, and how many layers changed: how far a mixture-of-experts policy's routing has moved since
the version that sampled (what routing replay holds fixed in training). Reads the run; writes nothing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from services.ops.replay.text import ReplayError, model_dir, replay_version
from shared.protocol.episode.fold import Episode
from shared.protocol.episode.routes import canonical, changed_layers


def routes_under(cfg, args, log, ep: Episode) -> tuple[str, list]:
    """(label of the version, the route [layers, top_k] its routers choose at each response token's position; None
    where the logged token has no route) for version ``args.version`` (or ``--weights``)."""
    import torch

    from services.rollout.engine import EngineError, make_engine
    from services.rollout.episodes import continuation as cont

    if not any(r is not None for r in ep.routes):
        raise ReplayError(f"episode {ep.episode_id}: no routes logged (a dense policy, or routing_replay off)")
    try:
        path, sha, label = replay_version(cfg, args, log, args.version)
        engine = make_engine("torch", model_dir(cfg), device="cpu", max_batch_size=1, routing_replay=True)
        cont.load_version(engine, args.version, path, sha)
    except (cont.ContinuationError, EngineError, ValueError) as exc:
        raise ReplayError(f"episode {ep.episode_id}: {exc}") from None
    runner = engine.runner
    ids = ep.prompt_ids + ep.tokens
    with torch.inference_mode():
        runner.model(input_ids=torch.tensor([ids]))
    every = canonical(torch.stack(runner.routers.recorded, dim=1).numpy(), runner.route_shape)
    start = len(ep.prompt_ids) - 1
    return label, [None if r is None else every[start + j] for j, r in enumerate(ep.routes)]


def compare(cfg, log, ep: Episode, version: int) -> dict:
    """What the UI's episode page colours by: the logged routes beside version ``version``'s, per response token
    (``layers_changed``: None where a token has no route), with the summary line."""
    args = SimpleNamespace(version=version, weights=None)
    label, other = routes_under(cfg, args, log, ep)
    moved = changed(ep, other)
    return {
        "version": label,
        "routes": [None if r is None else r.tolist() for r in other],
        "layers_changed": moved,
        "summary": summary(label, moved),
    }


def changed(ep: Episode, other: list) -> list[int | None]:
    """Per response token: the layers whose experts differ between its logged route and ``other``'s."""
    return [
        None if r is None or o is None else int(changed_layers(r[None], o[None])[0]) for r, o in zip(ep.routes, other)
    ]


def summary(label: str, moved: list[int | None]) -> str:
    held = np.array([m for m in moved if m is not None])
    if not len(held):
        return f"routes under {label}: no routed token"
    return (
        f"routes under {label}: {int((held > 0).sum())} of {len(held)} routed tokens go through other experts in at "
        f"least one layer (mean {held.mean():.2f} layers changed)"
    )

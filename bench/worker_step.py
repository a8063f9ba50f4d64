"""Where one rollout worker's engine step goes, on the SIMULATED GPU engine of bench/rollout_scaling.py.

    PYTHONPATH=. python bench/worker_step.py [--seconds 15] [--step-delay-ms 20]

One real RolloutWorker, in this process, with the same config as a rollout_scaling worker (default flush
settings, batch 64, `step_delay_ms`: the engine sleeps that long after each step, SIMULATED GPU time), against an
embedded Redis, with the prompts queue kept full. Timers wrap the engine's own step (the tiny model's forward and
sampling, run on this CPU), the worker's synchronous flushes (``Episodes.flush``: encode plus one pipeline round
trip, waited for at once) and, where the worker has one, its wait for the step writer (``StepWriter.wait``: the
step's batch, written on a thread while the next engine step ran; only what is left of its round trip when that
step ends is waited for). Printed per engine step: wall time, this process's CPU, the engine's CPU, the flushes'
wall and CPU time, the writer wait, tokens, and Redis commands by type (INFO commandstats).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cpu  # noqa: E402
from bench.rollout_scaling import groups, header  # noqa: E402
from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from services.ops.launch.tiny_model import load_tokenizer, make_tiny_model  # noqa: E402
from services.rollout.engine import make_engine  # noqa: E402
from services.rollout.worker import RolloutWorker  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams.prompts import enqueue  # noqa: E402
from shared.runtime import logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402


def timed(fn, acc: dict, wall: str | None, cpu_key: str):
    def wrapper(*a, **k):
        t0, c0 = time.monotonic(), time.process_time()
        try:
            return fn(*a, **k)
        finally:
            acc[cpu_key] += time.process_time() - c0
            if wall:
                acc[wall] += time.monotonic() - t0

    return wrapper


def count_round_trips(acc: dict) -> None:
    """Count every packet of commands the process sends to Redis (a single command or a whole pipeline: one round
    trip each), by thread: the main thread waits for its own; the step writer's travel beside the next step."""
    import threading

    import redis.connection

    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self, *a, **k):
        key = "trips_main" if threading.current_thread() is threading.main_thread() else "trips_other"
        acc[key] = acc.get(key, 0) + 1
        return send(self, *a, **k)

    redis.connection.AbstractConnection.send_packed_command = counted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="measured time (after 3 s of warm-up)")
    p.add_argument("--step-delay-ms", type=float, default=20.0, help="SIMULATED GPU cost of one engine step (sleep)")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.step_delay_ms <= 0:
        p.error(f"--seconds and --step-delay-ms: expected > 0, got {args.seconds}, {args.step_delay_ms}")
    args.max_tokens = Config().max_tokens
    import torch

    # as the worker processes (OMP_NUM_THREADS=1)
    torch.set_num_threads(1)
    logs.setup("warning")
    print(header(args).replace("rollout only (no trainer)", "one worker in this process"))
    print(f"load average at start: {cpu.load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="streamrl-step-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_tiny_model(tmp / "tiny")
        server = EmbeddedRedis(tmp / "redis").start()
        try:
            client = connect(server.url)
            cfg = Config(run="step", model_dir=model_dir, tools="", step_delay_ms=args.step_delay_ms)
            engine = make_engine("torch", model_dir, max_batch_size=cfg.max_batch_size, step_delay_ms=cfg.step_delay_ms)
            worker = RolloutWorker(cfg, client, "step", engine, load_tokenizer(model_dir), logs.get("step"))
            # never runs dry
            enqueue(client, Keys(cfg.run), groups(cfg.run, 0, 5_000, cfg.group_size))
            worker.start()
            end = time.monotonic() + 3.0
            while time.monotonic() < end:
                worker.tick()
            acc = {
                "engine_cpu": 0.0,
                "flush_wall": 0.0,
                "flush_cpu": 0.0,
                "wait_wall": 0.0,
                "wait_cpu": 0.0,
                "steps": 0,
            }
            inner = engine.inner.step

            def counted():
                acc["steps"] += 1
                return inner()

            engine.inner.step = timed(counted, acc, None, "engine_cpu")
            # the flushes' owner: writes.py, or older trees
            owner = getattr(worker.episodes, "writes", worker.episodes)
            owner.flush = timed(owner.flush, acc, "flush_wall", "flush_cpu")
            # main before the step writer has none
            writer = getattr(owner, "writer", None)
            if writer is not None:
                writer.wait = timed(writer.wait, acc, "wait_wall", "wait_cpu")
            count_round_trips(acc)
            client.config_resetstat()
            tokens0, t0, c0 = worker.stats["tokens"], time.monotonic(), time.process_time()
            while time.monotonic() < t0 + args.seconds:
                worker.tick()
            wall, proc_cpu, n = time.monotonic() - t0, time.process_time() - c0, max(1, acc["steps"])
            tokens = worker.stats["tokens"] - tokens0
            trips = (acc.get("trips_main", 0), acc.get("trips_other", 0))
            stats = client.info("commandstats")
            worker.shutdown()
            client.close()
        finally:
            server.stop()
    ms = lambda x: f"{x / n * 1e3:.2f} ms"  # noqa: E731
    print(
        f"{n} engine steps in {wall:.1f} s: per step wall {ms(wall)}, process CPU {ms(proc_cpu)}, engine CPU "
        f"{ms(acc['engine_cpu'])} (the tiny model on this CPU), flushes wall {ms(acc['flush_wall'])} "
        f"({acc['flush_wall'] / wall:.0%} of wall), flushes CPU {ms(acc['flush_cpu'])}, step-writer wait "
        f"{ms(acc['wait_wall'])} ({acc['wait_wall'] / wall:.0%} of wall); {tokens / n:.1f} tokens "
        f"per step, {tokens / wall:,.0f} tokens/s; CPU per token outside the engine "
        f"{(proc_cpu - acc['engine_cpu']) / max(1, tokens) * 1e6:.0f} us"
    )
    calls = sorted(((k.removeprefix("cmdstat_"), v["calls"]) for k, v in stats.items()), key=lambda kv: -kv[1])
    print("Redis commands per engine step: " + ", ".join(f"{k} {c / n:.2f}" for k, c in calls if c / n >= 0.05))
    print(
        f"Redis round trips per engine step: {trips[0] / n:.2f} waited for by the main thread, {trips[1] / n:.2f} on "
        f"the step writer's thread (beside the next engine step)"
    )
    print(f"load average at end: {cpu.load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

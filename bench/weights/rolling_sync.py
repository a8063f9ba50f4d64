"""Rolling version changes: who stands paused during a sync, global pause vs rolling waves, side by side.

    python bench/weights/rolling_sync.py [--workers 4] [--reps 3] [--step-delay-ms 20] [--quick] [--json]

Starts its own EmbeddedRedis and N real rollout worker processes generating without pause (prompt groups enough
for the whole run, ``max_staleness`` high so the gate never holds them back), each engine step padded to
``--step-delay-ms`` (a SIMULATED GPU step; the model's CPU forward comes on top). The workers read the trainer's
folder (``weights_fetch = auto``: the fetch is a sha256 check). The syncer is the real ``Syncer`` class in this
process; versions alternate between

  global     every worker paused, loaded, resumed at once (``sync_mode = global``, the default);
  rolling    one worker at a time (``sync_mode = rolling``, ``max_loading = 1``).

Per sync, from the syncer's record and clock: the whole sync (fetch included), the longest any worker stood paused
(``max_paused_s``: one wave, pause sent to resume acked), the smallest fraction of the workers generating
(``generating_min``), and worker-seconds paused (each wave's pause + load + resume times the workers in it).
Tokens counted in time windows around a sync were tried and dropped: on this 2-core box, with every worker's CPU
forward competing, the rate before a sync varied more than the sync changed it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.harness.runs import MEDIUM, finish, keep_only, kill_all, scratch_server, wait  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from services.syncer.syncer import Syncer  # noqa: E402
from services.trainer.publish import publish, write_weights  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime import heartbeat, logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

MODES = ("global", "rolling")


def bench(client, redis_url: str, model_dir: str, root: Path, workers: int, reps: int, step_ms: int) -> dict:
    keys = Keys(f"rolling{uuid.uuid4().hex[:8]}")
    trainer_dir = root / f"{keys.run}-trainer"
    trainer_dir.mkdir()
    enqueue(client, keys, [PromptGroup(f"g{i}", 4, prompt=f"{i}+{i}=") for i in range(2000)])
    base = dict(
        run=keys.run,
        model_dir=model_dir,
        sync_timeout=600.0,
        fetch_timeout=600.0,
        heartbeat_ttl=60.0,
        max_staleness=10_000,
    )
    syncers = {
        "global": Syncer(Config(**base), client, logs.get("bench-syncer")),
        "rolling": Syncer(Config(**base, sync_mode="rolling", max_loading=1), client, logs.get("bench-syncer")),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.rollout",
                "--worker-id",
                f"W{i}",
                "--run",
                keys.run,
                "--redis-url",
                redis_url,
                "--model-dir",
                model_dir,
                "--tools",
                "",
                "--max-tokens",
                "400",
                "--max-groups-in-flight",
                "2",
                "--step-delay-ms",
                str(step_ms),
                "--heartbeat-ttl",
                "60",
                "--max-staleness",
                "10000",
                "--log-level",
                "warning",
            ],
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for i in range(workers)
    ]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    syncers["global"].set_gate(0)
    rows = []
    try:
        wait(lambda: len(heartbeat.alive_of(client, keys, "rollout")) == workers, "every worker up", procs)
        wait(
            lambda: all(int(i.get("episodes", 0)) > 0 for i in heartbeat.alive_of(client, keys, "rollout").values()),
            "every worker generating",
            procs,
        )
        for version in range(1, 2 * reps + 1):
            mode = MODES[(version - 1) % 2]
            path, digest = write_weights(model, trainer_dir, version)
            publish(client, keys, version, path, digest, step=version)
            record = syncers[mode].sync(version, str(path), digest)
            assert record["workers"] == workers and not record["missing"] and not record["refused"], record
            per_wave = workers if mode == "global" else 1
            rows.append(
                {
                    "mode": mode,
                    "version": version,
                    "sync_s": record["total_s"],
                    "paused_s": record["paused_s"],
                    "max_paused_s": record["max_paused_s"],
                    "generating_min": record["generating_min"],
                    "waves": record["waves"],
                    "worker_s_paused": record["paused_s"] * per_wave,
                }
            )
            r = rows[-1]
            print(
                f"  v{version} {mode:<8} sync {r['sync_s']:.2f} s, longest paused {r['max_paused_s']:.2f} s, "
                f"generating min {r['generating_min']:.2f}, worker-s paused {r['worker_s_paused']:.2f}",
                flush=True,
            )
            keep_only(trainer_dir, path)
        size = path.stat().st_size
    finally:
        kill_all(procs)
    fields = ("sync_s", "paused_s", "max_paused_s", "generating_min", "waves", "worker_s_paused")
    med = {m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in fields} for m in MODES}
    return {"bytes": size, "workers": workers, "reps": reps, "step_ms": step_ms, "median": med, "runs": rows}


def render(label: str, r: dict) -> str:
    out = [
        f"model: {label}, {r['bytes'] / 1e6:.1f} MB; {r['workers']} rollout worker processes, SIMULATED GPU step "
        f"{r['step_ms']} ms; medians over {r['reps']} syncs per mode, alternated in one run",
        f"{'mode':<8} | {'sync s':>7} {'paused s (sum)':>14} {'longest paused s':>16} {'waves':>5} "
        f"{'generating min':>14} {'worker-s paused':>15}",
    ]
    for m in MODES:
        x = r["median"][m]
        out.append(
            f"{m:<8} | {x['sync_s']:>7.2f} {x['paused_s']:>14.2f} {x['max_paused_s']:>16.2f} "
            f"{x['waves']:>5.0f} {x['generating_min']:>14.2f} {x['worker_s_paused']:>15.2f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="syncs per mode")
    ap.add_argument("--step-delay-ms", type=int, default=20, help="SIMULATED GPU step")
    ap.add_argument("--quick", action="store_true", help="the tiny default model instead of a 30M one")
    ap.add_argument("--json", action="store_true", help="also print the full results as JSON")
    args = ap.parse_args(argv)
    logs.setup("warning")
    t_start = time.perf_counter()
    with scratch_server(weights_in_shm=True) as (tmp, url, weights_dir):
        client = connect(url)
        label = "tiny default" if args.quick else "medium random-init (~30M parameters, float32)"
        model_dir = make_tiny_model(tmp / "model") if args.quick else make_tiny_model(tmp / "model", **MEDIUM)
        result = bench(client, url, model_dir, weights_dir, args.workers, args.reps, args.step_delay_ms)
    print(
        f"weights in {'/dev/shm' if Path('/dev/shm').is_dir() else 'a temp dir'}, read by every worker (no "
        f"download); syncer: Syncer.sync in the benchmark process; CPU, torch {torch.__version__}, "
        f"{os.cpu_count()} cores (shared box)"
    )
    rc = finish(render(label, result), t_start, result, args.json)
    from bench.harness.record import record

    g, r = result["median"]["global"], result["median"]["rolling"]
    record(
        "rolling_sync",
        [
            {
                "what": f"rolling vs global version change, {args.workers} workers: fewest generating during a sync, "
                f"longest a worker stands paused, whole sync",
                "value": f"rolling {r['generating_min']:.0%} generating, {r['max_paused_s']:.2f} s paused, sync "
                f"{r['sync_s']:.2f} s; global {g['generating_min']:.0%}, {g['max_paused_s']:.2f} s, "
                f"{g['sync_s']:.2f} s",
            }
        ],
        ["services/syncer", "services/rollout", "shared", "bench/weights/rolling_sync.py"],
        quick=args.quick,
        simulated=f"every engine step sleeps {args.step_delay_ms} ms",
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Weights pulled through relays (issue 19): bytes the trainer's weight server sends per version with N rollout workers,
from the trainer alone vs through a relay tree, side by side.

    python bench/fetch_fanout.py [--workers 6] [--fanout 2] [--reps 2] [--quick] [--json]

Starts its own EmbeddedRedis, the trainer's weight server (``shared/runtime/weights/server.py``, uvicorn in a thread
of this process, loopback HTTP, its byte counter: file bytes of 200/206 answers) and N real rollout worker processes,
each with a weights folder of its own (``--weights-fetch always``: every version is downloaded, as on another host)
and a relay on a free port (``--relay-port -1``). No prompts: the workers are idle, so the CPU goes to the transfers.
The syncer is the real ``Syncer`` class in this process (global mode); versions alternate between

  trainer only   the syncer ignores the relays (their URLs left out of what it reads of the heartbeats): every
                 worker downloads from the trainer, one fetch command for all;
  relay tree     the syncer's fetch tree of fan-out ``--fanout``: the trainer feeds ``fanout`` workers, each of
                 those ``fanout`` more (after they acked), and so on.

Per version: the trainer server's bytes sent, in copies of the file, and the fetch phase's wall time (all transfers
share one box's loopback and its cores, so that time says nothing of a network: the bytes are the figure).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.runs import MEDIUM, finish, keep_only, kill_all, scratch_server, wait  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from services.syncer.syncer import Syncer  # noqa: E402
from services.trainer.publish import publish, write_weights  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime import heartbeat, logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402
from shared.runtime.weights.server import WeightServer  # noqa: E402

MODES = ("trainer only", "relay tree")


class TrainerOnlySyncer(Syncer):
    """The real syncer, blind to the relays: what a run without relay_port does."""

    def live_workers(self) -> dict[str, dict]:
        return {w: {k: v for k, v in info.items() if k != "relay"} for w, info in super().live_workers().items()}


def bench(client, redis_url: str, model_dir: str, root: Path, workers: int, fanout: int, reps: int) -> dict:
    keys = Keys(f"fanout{uuid.uuid4().hex[:8]}")
    trainer_dir = root / f"{keys.run}-trainer"
    trainer_dir.mkdir()
    server = WeightServer(trainer_dir).start()
    cfg = Config(
        run=keys.run,
        model_dir=model_dir,
        sync_timeout=600.0,
        fetch_timeout=600.0,
        heartbeat_ttl=60.0,
        relay_fanout=fanout,
    )
    names = [f"W{i}" for i in range(workers)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.rollout",
                "--worker-id",
                w,
                "--run",
                keys.run,
                "--redis-url",
                redis_url,
                "--model-dir",
                model_dir,
                "--tools",
                "",
                "--heartbeat-ttl",
                "60",
                "--log-level",
                "warning",
                "--weights-fetch",
                "always",
                "--rollout-weights-dir",
                str(root / f"{keys.run}-{w}"),
                "--relay-port",
                "-1",
            ],
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for w in names
    ]
    syncers = {
        "trainer only": TrainerOnlySyncer(cfg, client, logs.get("bench-syncer")),
        "relay tree": Syncer(cfg, client, logs.get("bench-syncer")),
    }
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = []
    try:

        def relaying() -> int:
            return sum(1 for info in heartbeat.alive_of(client, keys, "rollout").values() if info.get("relay"))

        wait(lambda: relaying() == workers, "every worker up with its relay", procs)
        for version in range(1, 2 * reps + 1):
            mode = MODES[(version - 1) % 2]
            path, digest = write_weights(model, trainer_dir, version)
            publish(client, keys, version, path, digest, step=version, url_base=server.url)
            before = server.sent_bytes
            record = syncers[mode].sync(version, str(path), digest, server.url_of(version))
            assert record["workers"] == workers and not record["missing"] and not record["refused"], record
            sent = server.sent_bytes - before
            rows.append(
                {
                    "mode": mode,
                    "version": version,
                    "trainer_bytes": sent,
                    "copies": sent / path.stat().st_size,
                    "fetch_s": record["fetch_s"],
                    "levels": record["fetch_levels"],
                    "relayed": len(record["relayed"]),
                }
            )
            print(
                f"  v{version} {mode:<13} trainer sent {sent / 1e6:8.1f} MB = {rows[-1]['copies']:.2f} copies, "
                f"fetch {record['fetch_s']:.2f} s, {record['fetch_levels']} level(s)",
                flush=True,
            )
            keep_only(trainer_dir, path)
        size = path.stat().st_size
    finally:
        kill_all(procs)
        server.stop()
    med = {
        m: {
            k: statistics.median(r[k] for r in rows if r["mode"] == m)
            for k in ("trainer_bytes", "copies", "fetch_s", "levels", "relayed")
        }
        for m in MODES
    }
    return {
        "bytes": size,
        "workers": workers,
        "fanout": fanout,
        "reps": reps,
        "median": med,
        "runs": rows,
        "trainer_bytes_ratio": med["trainer only"]["trainer_bytes"] / med["relay tree"]["trainer_bytes"],
    }


def render(label: str, r: dict) -> str:
    out = [
        f"model: {label}, {r['bytes'] / 1e6:.1f} MB per version; {r['workers']} rollout worker processes; "
        f"relay_fanout {r['fanout']}; medians over {r['reps']} versions per mode, alternated in one run",
        f"{'mode':<13} | {'trainer MB/version':>18} {'copies':>7} {'levels':>6} {'relayed':>7} {'fetch s':>8}",
    ]
    for m in MODES:
        x = r["median"][m]
        out.append(
            f"{m:<13} | {x['trainer_bytes'] / 1e6:>18.1f} {x['copies']:>7.2f} {x['levels']:>6.0f} "
            f"{x['relayed']:>7.0f} {x['fetch_s']:>8.2f}"
        )
    out.append(f"trainer bytes per version, trainer only / relay tree: {r['trainer_bytes_ratio']:.2f}x")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--fanout", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="versions per mode")
    ap.add_argument("--quick", action="store_true", help="the tiny default model instead of a 30M one")
    ap.add_argument("--json", action="store_true", help="also print the full results as JSON")
    args = ap.parse_args(argv)
    logs.setup("warning")
    t_start = time.perf_counter()
    with scratch_server(weights_in_shm=True) as (tmp, url, weights_dir):
        client = connect(url)
        label = "tiny default" if args.quick else "medium random-init (~30M parameters, float32)"
        model_dir = make_tiny_model(tmp / "model") if args.quick else make_tiny_model(tmp / "model", **MEDIUM)
        result = bench(client, url, model_dir, weights_dir, args.workers, args.fanout, args.reps)
    print(
        f"weights folders in {'/dev/shm' if Path('/dev/shm').is_dir() else 'a temp dir'}; weight server and relays: "
        f"uvicorn threads, loopback HTTP; syncer: Syncer.sync in the benchmark process; CPU, torch "
        f"{torch.__version__}, {os.cpu_count()} cores (shared box)"
    )
    return finish(render(label, result), t_start, result, args.json)


if __name__ == "__main__":
    sys.exit(main())

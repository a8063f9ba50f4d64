"""Weights over the wire (issue 15): the rollout pause with the download before it vs inside it, side by side.

    python bench/fetch_pause.py [--quick] [--json]

Starts its own EmbeddedRedis, the weight server (``shared/runtime/weights/server.py``, uvicorn in a thread of this
process, loopback HTTP) over a "trainer" folder, and per model and case one real rollout worker process:

  downloads     a weights folder of its own (``--weights-fetch always``): every version is downloaded, verified and
                loaded from that copy (a worker on another host);
  shared        the trainer's folder (``weights_fetch = auto``, the default single-host run): nothing is downloaded,
                the fetch phase only checks the sha256.

The syncer is the real ``Syncer`` class driven in this process. Each repetition writes a new version as the trainer
does (``publish.write_weights``), publishes it with its URL and syncs it, alternating two orders:

  fetch first   the syncer's order: fetch (download and/or sha256 while the worker generates), then pause, load,
                resume;
  in the pause  the old order, ``Syncer.phases`` without "fetch": the worker's load gets (downloads, or checks) the
                file inside the pause: what the sync cost before the fetch phase existed.

Measured per sync: the phases the syncer waited for (fetch; pause + load + resume = ``paused_s``, the time generation
stood still by the syncer's clock) and pause sent -> first token of the new version (Redis server timestamps, as in
bench/sync_pause.py).
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

from bench.runs import MEDIUM, finish, keep_only, kill_all, scratch_server  # noqa: E402
from bench.sync_pause import LARGE, first_token_ms, generating, ms  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from services.syncer.syncer import Syncer  # noqa: E402
from services.trainer.publish import publish, write_weights  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams import control  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime import logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402
from shared.runtime.weights.server import WeightServer  # noqa: E402

ORDERS = {"fetch first": ("fetch", "pause", "load", "resume"), "in the pause": ("pause", "load", "resume")}


def wait(cond, what: str, worker: subprocess.Popen, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert worker.poll() is None, f"the rollout worker exited with {worker.returncode} waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


CASES = {"downloads": ["--weights-fetch", "always"], "shared": ["--weights-fetch", "auto"]}


def bench_model(client, redis_url: str, model_dir: str, label: str, root: Path, reps: int, case: str) -> dict:
    keys = Keys(f"fetch{uuid.uuid4().hex[:8]}")
    trainer_dir, own_dir = root / f"{keys.run}-trainer", root / f"{keys.run}-worker"
    trainer_dir.mkdir()
    server = WeightServer(trainer_dir).start()
    cfg = Config(
        run=keys.run,
        model_dir=model_dir,
        sync_timeout=300.0,
        fetch_timeout=300.0,
        max_staleness=10_000,
        heartbeat_ttl=30.0,
    )
    enqueue(client, keys, [PromptGroup(f"g{i}", 4, prompt=f"{i}+{i}=") for i in range(200)])
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.rollout",
            "--worker-id",
            "W",
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
            "--flush-tokens",
            "1",
            "--max-groups-in-flight",
            "2",
            "--heartbeat-ttl",
            "30",
            "--log-level",
            "warning",
            *CASES[case],
            "--rollout-weights-dir",
            str(own_dir),
        ],
        start_new_session=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    syncer = Syncer(cfg, client, logs.get("bench-syncer"))
    rows = []
    try:
        wait(lambda: generating(client, keys, 0), "the first tokens", worker)
        for version in range(1, 2 * reps + 1):
            order = list(ORDERS)[(version - 1) % 2]
            syncer.phases = ORDERS[order]
            path, digest = write_weights(model, trainer_dir, version)
            publish(client, keys, version, path, digest, step=version, url_base=server.url)
            record = syncer.sync(version, str(path), digest, server.url_of(version))
            assert record["workers"] == 1 and not record["missing"] and not record["refused"], record
            pause_ms = max(
                ms(i)
                for i, c in control.read_after(client, keys, "0-0", count=100_000)
                if isinstance(c, control.Command) and c.cmd == "pause" and c.sync == record["sync"]
            )
            first = wait(lambda: first_token_ms(client, keys, version), "generation with the new version", worker)
            rows.append(
                {
                    "order": order,
                    "version": version,
                    "fetch_s": record.get("fetch_s", 0.0),
                    "paused_s": record["paused_s"],
                    "pause_s": record["pause_s"],
                    "load_s": record["load_s"],
                    "total_s": record["total_s"],
                    "pause_to_first_token_s": (first - pause_ms) / 1000,
                }
            )
            keep_only(trainer_dir, path)
        size = path.stat().st_size
    finally:
        kill_all([worker])
        server.stop()
    med = {
        order: {
            k: statistics.median(r[k] for r in rows if r["order"] == order)
            for k in ("fetch_s", "paused_s", "pause_s", "load_s", "total_s", "pause_to_first_token_s")
        }
        for order in ORDERS
    }
    if case == "shared":
        assert not own_dir.exists(), "the worker sharing the folder downloaded something"
    return {
        "model": label,
        "case": case,
        "bytes": size,
        "reps": reps,
        "median": med,
        "runs": rows,
        "paused_ratio": med["in the pause"]["paused_s"] / med["fetch first"]["paused_s"],
        "load_ratio": med["in the pause"]["load_s"] / med["fetch first"]["load_s"],
    }


def render(results: list[dict]) -> str:
    out = [
        "Per sync, medians over the syncs of each order (alternated in one run, same worker). fetch: the phase "
        "before the pause (generation goes on); paused: the syncer's pause + load + resume = (pause: abort, flush, "
        "ack) + (load) + resume; first token: pause sent -> first token of the new version. Ratios: in the pause / "
        "fetch first.",
        f"{'model':<18} {'MB':>7} {'case':<9} {'order':<13} | {'fetch s':>7} {'paused s':>8} {'(pause':>7} "
        f"{'load)':>7} {'first token s':>13} {'sync s':>7} | paused ratio, load ratio",
    ]
    for r in results:
        for i, order in enumerate(ORDERS):
            m = r["median"][order]
            ratio = f"{r['paused_ratio']:.1f}x, {r['load_ratio']:.1f}x" if i == 0 else ""
            mb = f"{r['bytes'] / 1e6:.1f}" if i == 0 else ""
            case = r["case"] if i == 0 else ""
            out.append(
                f"{r['model'] if i == 0 else '':<18} {mb:>7} {case:<9} {order:<13} | "
                f"{m['fetch_s']:>7.3f} {m['paused_s']:>8.3f} {m['pause_s']:>7.3f} {m['load_s']:>7.3f} "
                f"{m['pause_to_first_token_s']:>13.3f} {m['total_s']:>7.3f} | {ratio}"
            )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 30M model instead of the 113M one, fewer syncs")
    ap.add_argument("--json", action="store_true", help="also print the full results as JSON")
    args = ap.parse_args(argv)
    logs.setup("warning")
    t_start = time.perf_counter()
    with scratch_server(weights_in_shm=True) as (tmp, url, weights_dir):
        client = connect(url)
        big = ("medium random-init", MEDIUM, 2) if args.quick else ("large random-init", LARGE, 3)
        models = [
            (make_tiny_model(tmp / "tiny"), "tiny default", 5 if args.quick else 10),
            (make_tiny_model(tmp / "big", **big[1]), big[0], big[2]),
        ]
        results = [
            bench_model(client, url, d, label, weights_dir, reps, case) for d, label, reps in models for case in CASES
        ]
    print(
        f"both folders in {'/dev/shm' if Path('/dev/shm').is_dir() else 'a temp dir'}; weight server: uvicorn "
        f"thread in the benchmark process, loopback HTTP; rollout worker: a process; syncer: Syncer.sync "
        f"in the benchmark process; CPU, torch {torch.__version__}, {os.cpu_count()} cores"
    )
    return finish(render(results), t_start, results, args.json)


if __name__ == "__main__":
    sys.exit(main())

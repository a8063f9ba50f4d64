"""Weight-sync benchmark: how long rollout pauses per sync, against
the weights' size and the copy bandwidth measured on this machine.

    python bench/weights/sync_pause.py [--quick] [--json]

Starts its own EmbeddedRedis and, per model, one real rollout worker process
(``python -m services.rollout``, torch engine, CPU, flush_tokens 1 so the
first token after a resume is visible at once). The syncer is the real
``Syncer`` class driven in this process (``Syncer.sync``, the call its run
loop makes on a version event). Each repetition writes the model's weights as
the trainer does (``publish.write_weights``: safetensors, atomic rename,
sha256) to the weights directory (/dev/shm when it exists), publishes the
version, and syncs.

Measured per sync:
  pause -> first token: from the pause command's entry in the control stream
      to the first tokens event of the new version in any episode stream
      (both Redis server timestamps, ms): generation really resumed, re-prefill
      included;
  the syncer's phases: pause (abort + flush + ack), load (sha256 + read +
      copy into the model + ack), resume (re-queue the episodes + ack).
Measured once per model, in this process, on the same file: sha256 of the
file, safetensors load_file, and copy_ of every tensor into a model-sized set
of tensors. Their sum is the floor of the load phase; pause / floor says how
much of the pause is the weights' bytes moving.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.harness.runs import finish, keep_only, kill_all, scratch_server  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from services.syncer.syncer import Syncer  # noqa: E402
from services.trainer.publish import publish, sha256, write_weights  # noqa: E402
from shared.protocol.episode import events
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams import control  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime import logs  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

# ~113M parameters
LARGE = dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)


def ms(entry_id) -> int:
    return int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])


def first_token_ms(client, keys: Keys, version: int) -> int | None:
    """Server time of the earliest tokens event of ``version`` in any episode stream."""
    best = None
    for key in client.scan_iter(match=keys.episode("*")):
        for entry_id, fields in client.xrevrange(key, count=50):
            ev = events.decode(entry_id, fields)
            if ev.kind == "tokens" and ev.policy == version:
                t = ms(entry_id)
                best = t if best is None else min(best, t)
    return best


def generating(client, keys: Keys, version: int) -> bool:
    return first_token_ms(client, keys, version) is not None


def measure_copy(path: Path, digest: str, reps: int) -> dict:
    """Medians over reps, in this process, on the published file: sha256 of the file;
    load_file + copy_ into resident model-shaped tensors (what the engine's load does);
    and a plain memcpy of the same bytes between resident tensors."""
    sha_s, load_s, memcpy_s = [], [], []
    # resident, like a model's
    targets = {k: torch.zeros_like(v) for k, v in load_file(str(path)).items()}
    for _ in range(reps):
        t0 = time.perf_counter()
        assert sha256(path) == digest
        t1 = time.perf_counter()
        tensors = load_file(str(path))
        for k, v in tensors.items():
            targets[k].copy_(v)
        t2 = time.perf_counter()
        resident = {k: v.clone() for k, v in tensors.items()}
        t3 = time.perf_counter()
        for k, v in resident.items():
            targets[k].copy_(v)
        t4 = time.perf_counter()
        sha_s.append(t1 - t0)
        load_s.append(t2 - t1)
        memcpy_s.append(t4 - t3)
        del tensors, resident
    size = path.stat().st_size
    out = {
        "sha256_s": statistics.median(sha_s),
        "load_copy_s": statistics.median(load_s),
        "memcpy_s": statistics.median(memcpy_s),
    }
    out["floor_s"] = out["sha256_s"] + out["load_copy_s"]
    out.update({f"{k[:-2]}_gb_s": size / v / 1e9 for k, v in list(out.items())})
    return out


def bench_model(client, redis_url: str, model_dir: str, label: str, weights_dir: Path, reps: int) -> dict:
    keys = Keys(f"sync{uuid.uuid4().hex[:8]}")
    cfg = Config(run=keys.run, model_dir=model_dir, sync_timeout=120.0, max_staleness=10_000, heartbeat_ttl=30.0)
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
        ],
        start_new_session=True,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    syncer = Syncer(cfg, client, logs.get("bench-syncer"))
    rows = []
    try:
        deadline = time.monotonic() + 300
        while not generating(client, keys, 0):
            assert worker.poll() is None, f"the rollout worker exited with {worker.returncode}"
            assert time.monotonic() < deadline, "the rollout worker never generated"
            time.sleep(0.2)
        copy = None
        for version in range(1, reps + 1):
            t0 = time.perf_counter()
            path, digest = write_weights(model, weights_dir, version)
            write_s = time.perf_counter() - t0
            if copy is None:
                copy = measure_copy(path, digest, reps=3)
            publish(client, keys, version, path, digest, step=version)
            record = syncer.sync(version, str(path), digest)
            assert record["workers"] == 1 and not record["missing"] and not record["refused"], record
            pause_ms = max(
                ms(i)
                for i, c in control.read_after(client, keys, "0-0", count=100_000)
                if isinstance(c, control.Command) and c.cmd == "pause" and c.sync == record["sync"]
            )
            deadline = time.monotonic() + 300
            while (first := first_token_ms(client, keys, version)) is None:
                assert worker.poll() is None, f"the rollout worker exited with {worker.returncode}"
                assert time.monotonic() < deadline, "generation did not resume"
                time.sleep(0.01)
            rows.append({**record, "write_s": write_s, "pause_to_first_token_s": (first - pause_ms) / 1000})
            keep_only(weights_dir, path)
        size = path.stat().st_size
    finally:
        kill_all([worker])
    med = {
        k: statistics.median(r[k] for r in rows)
        for k in ("pause_to_first_token_s", "total_s", "pause_s", "load_s", "resume_s", "write_s")
    }
    return {
        "model": label,
        "params": params,
        "bytes": size,
        "reps": reps,
        "copy": copy,
        "median": med,
        "runs": [
            {
                k: r[k]
                for k in ("version", "pause_to_first_token_s", "total_s", "pause_s", "load_s", "resume_s", "write_s")
            }
            for r in rows
        ],
        "pause_over_floor": med["pause_to_first_token_s"] / copy["floor_s"],
    }


def render(results: list[dict]) -> str:
    out = [
        "Per sync, medians. first token: pause sent -> first token of the new version in a stream. "
        "phases: the syncer's pause / load / resume (each until every worker acked).",
        "floor: sha256 of the file + load_file and copy_ into resident tensors, measured on the same file in the "
        "benchmark process (GB/s of each, and of a plain memcpy, in brackets).",
        f"{'model':<18} {'params':>7} {'MB':>7} | {'first token s':>13} {'sync s':>7} {'pause':>6} {'load':>6} "
        f"{'resume':>6} | {'floor s':>7} (sha256, load+copy_, memcpy GB/s) | first token / floor | write s",
    ]
    for r in results:
        m, c = r["median"], r["copy"]
        out.append(
            f"{r['model']:<18} {r['params'] / 1e6:>6.1f}M {r['bytes'] / 1e6:>7.1f} | "
            f"{m['pause_to_first_token_s']:>13.3f} {m['total_s']:>7.3f} {m['pause_s']:>6.3f} "
            f"{m['load_s']:>6.3f} {m['resume_s']:>6.3f} | {c['floor_s']:>7.3f} ({c['sha256_gb_s']:.2f}, "
            f"{c['load_copy_gb_s']:.2f}, {c['memcpy_gb_s']:.2f}) | {r['pause_over_floor']:>19.1f} | "
            f"{m['write_s']:.2f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~1-2 min)")
    ap.add_argument("--json", action="store_true", help="also print the full results as JSON")
    args = ap.parse_args(argv)
    logs.setup("warning")
    t_start = time.perf_counter()
    with scratch_server(weights_in_shm=True) as (tmp, url, weights_dir):
        client = connect(url)
        models = [
            (make_tiny_model(tmp / "tiny"), "tiny default", 3 if args.quick else 8),
            (make_tiny_model(tmp / "large", **LARGE), "large random-init", 1 if args.quick else 3),
        ]
        results = [bench_model(client, url, d, label, weights_dir, reps) for d, label, reps in models]
    print(
        f"weights in {'/dev/shm' if Path('/dev/shm').is_dir() else 'a temp dir'}; rollout worker: a process; "
        f"syncer: Syncer.sync in the benchmark process; CPU, torch {torch.__version__}"
    )
    rc = finish(render(results), t_start, results, args.json)
    from bench.harness.record import record

    record(
        "sync_pause",
        [
            {
                "what": f"weight sync, {r['model']} model ({r['bytes'] / 1e6:,.1f} MB): generation paused "
                f"(pause + load + resume), and pause sent to first new token",
                "value": f"{(r['median']['pause_s'] + r['median']['load_s'] + r['median']['resume_s']) * 1e3:,.0f} "
                f"ms paused, "
                f"{r['median']['pause_to_first_token_s'] * 1e3:,.0f} ms to the first token",
            }
            for r in results
        ],
        ["services/syncer", "services/rollout", "services/trainer/publish.py", "shared", "bench/weights/sync_pause.py"],
        quick=args.quick,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""What a version's commit costs the trainer, before and after snapshot-and-fold, side by side in one invocation.

    python bench/trainer/commit_cost.py [--versions 100] [--before REV] [--quick]

Both variants are the real ``Trainer`` of a git tree, run as their own process on the same synthetic groups in a
scratch embedded Redis: "before" is a worktree at ``--before`` (the per-version checkpoint: fp32 model fsynced and the
bf16 weights file written in the commit, the optimizer in the background), "after" this tree (the ledger line in the
commit; the weights' delta, the version event and the snapshots every ``snapshot_every_versions`` in background
threads). The model is a Llama of about 134M parameters (537 MB of float32 weights; random init, the project's
tokenizer: services/ops/launch/tiny_model.py) published in bfloat16 at lr 1e-6, each step 2 groups of 2 episodes of
32 sampled tokens, 2 minibatches. The groups are written before the trainer starts, so it never waits for samples:
the busy share is what the commit leaves of the trainer's time.

Per variant, over every version: the commit's seconds on the critical path (the trainer's ``commit_s``) against the
training step's (``train_s``), the trainer's busy share (step / (step + commit + wait)), the bytes a version writes on
the critical path (before: checkpoint.pt and the weights file; after: the ledger line) and in the background (before:
optimizer.pt and the delta; after: snapshots, deltas, full files), and the same bytes for a 7B model computed the same
way (fp32 master weights 28 GB, AdamW moments 56 GB, bf16 file 14 GB; the delta at this run's measured share of its
file). Without a GPU the step is real CPU work, far longer than a GPU's: the share column is the ratio this box gives.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.record import record  # noqa: E402

MODEL = dict(hidden_size=1024, num_layers=8, num_heads=16, intermediate_size=4096)
# fp32 bytes of a 7B model's weights (the extrapolation's unit)
SEVEN_B = 7e9 * 4

# runs inside a tree (its own services/, shared/): writes the groups, trains to the last version, prints one line
DRIVER = r"""
import json, random, sys, time
from shared.runtime.config.keys import Config
from shared.runtime import logs
from shared.runtime.connection import connect
from shared.protocol.keys import Keys
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.streams import samples
from services.trainer.trainer import Trainer

args = json.loads(sys.argv[1])
cfg = Config(**args["config"])
client = connect(cfg.redis_url)
keys = Keys(cfg.run)
rng = random.Random(0)
log = EpisodeLog(client, keys, "bench")
for g in range(args["versions"] * cfg.batch_groups):
    gid, eids = f"g{g:05d}", []
    for i in range(2):
        eid = f"g{g:05d}-{i}"
        eids.append(eid)
        log.open(eid)
        log.append(eid, "started", {"episode_id": eid, "group_id": gid, "index": i,
                   "prompt_ids": [rng.randrange(3, 90) for _ in range(4)], "sampling": {"temperature": 1.0},
                   "task": {}}, 0)
        ids = [rng.randrange(3, 90) for _ in range(32)]
        log.append_tokens(eid, ids, [-rng.random() * 4 for _ in ids], 0)
        log.append(eid, "finished", {"reason": "stop", "reward": float(i == 0)}, 0)
    log.flush_or_raise()
    client.xadd(keys.samples, samples.encode(samples.Sample(gid, eids, "bench", 2)))
trainer = Trainer(cfg, client, logs.get("bench"))
t0 = time.monotonic()
trainer.run(should_stop=lambda: trainer.version >= args["versions"])
print("RESULT " + json.dumps({"wall_s": time.monotonic() - t0}))
"""


def tree_at(rev: str, where: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=ROOT, check=True, capture_output=True)
    return where


def variant(label: str, tree: Path, model_dir: Path, redis_url: str, tmp: Path, versions: int, extra: dict) -> dict:
    run_dir, weights_dir = tmp / label / "runs", tmp / label / "weights"
    config = {
        "run": f"commit-{label}",
        "redis_url": redis_url,
        "model_dir": str(model_dir),
        "run_dir": str(run_dir),
        "weights_dir": str(weights_dir),
        "batch_groups": 2,
        "steps_per_version": 1,
        "lr": 1e-6,
        "publish_dtype": "bfloat16",
        "max_staleness": 1,
        "log_level": "warning",
        **extra,
    }
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(os.cpu_count() or 2)}
    env = {k: v for k, v in env.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    print(f"== {label}: {tree} ({versions} versions)", flush=True)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps({"config": config, "versions": versions})],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{label}: the trainer exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    run_path = run_dir / config["run"]
    steps = [json.loads(x) for x in (run_path / "metrics.jsonl").read_text().splitlines()]
    # commit_s is reported with the step after the commit: the first step's is 0, the last commit's is not in a record
    commits = [m["commit_s"] for m in steps[1:]]
    train = [m["train_s"] for m in steps]
    wait = [m["wait_s"] for m in steps]
    ledger = (run_path / "trainer" / "trained.jsonl").read_bytes()
    publish = _publish_records(redis_url, config["run"], tree)
    # the tree before writes no publish record without a weight server: its newest file says the size
    files = sorted(weights_dir.glob("v*.safetensors"))
    full = statistics.median(r["full_bytes"] for r in publish) if publish else files[-1].stat().st_size
    deltas = [r["delta_bytes"] for r in publish if r.get("delta_bytes")]
    out = {
        "label": label,
        "versions": len(steps),
        "wall_s": result["wall_s"],
        "commit_s_median": statistics.median(commits),
        "commit_s_mean": statistics.fmean(commits),
        "train_s_median": statistics.median(train),
        "busy": sum(train) / (sum(train) + sum(commits) + sum(wait)),
        "file_bytes": full,
        "delta_bytes_median": statistics.median(deltas) if deltas else 0,
        "ledger_line_bytes": len(ledger) / max(1, ledger.count(b"\n")),
    }
    fp32 = _fp32_bytes(model_dir)
    out["fp32_bytes"] = fp32
    if label == "before":
        ckpt = (run_path / "trainer" / "checkpoint.pt").stat().st_size
        opt = (run_path / "trainer" / "optimizer.pt").stat().st_size
        out["critical_bytes"] = ckpt + full + out["ledger_line_bytes"]
        out["background_bytes"] = opt + out["delta_bytes_median"]
    else:
        snaps = [r for r in _records(redis_url, config["run"], tree, "snapshot")]
        snap_bytes = sum(r["bytes"] for r in snaps)
        written = sum(r.get("written_bytes", r["full_bytes"]) for r in publish)
        out["critical_bytes"] = out["ledger_line_bytes"]
        out["background_bytes"] = (snap_bytes + written) / len(publish)
        out["snapshots"] = len(snaps)
        out["snapshot_bytes"] = statistics.median(r["bytes"] for r in snaps)
        out["full_files"] = sum(1 for r in publish if r.get("snapshot"))
    out["commit_share"] = out["commit_s_mean"] / out["train_s_median"]
    out["critical_share"] = out["critical_bytes"] / fp32
    return out


def _records(redis_url: str, run: str, tree: Path, kind: str) -> list[dict]:
    code = (
        "import json, sys\nfrom shared.runtime.connection import connect\nfrom shared.protocol.keys import Keys\n"
        "from shared.protocol.streams import metrics\n"
        f"print(json.dumps([r for _, r in metrics.read(connect({redis_url!r}), Keys({run!r}), {kind!r})]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


def _publish_records(redis_url: str, run: str, tree: Path) -> list[dict]:
    return _records(redis_url, run, tree, "publish")


def _fp32_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += 4 * n
    return total


def seven_b(r: dict) -> dict:
    """The same bytes per version for a 7B model, computed the same way: before, the fp32 checkpoint and the bf16 file
    on the critical path; after, a ledger line of this size. The delta at this run's share of its file."""
    file_7b = SEVEN_B / 2
    delta_share = r["delta_bytes_median"] / r["file_bytes"] if r["file_bytes"] else 0
    if r["label"] == "before":
        return {"critical": SEVEN_B + file_7b, "background": 2 * SEVEN_B + delta_share * file_7b}
    every = max(1, r["versions"] // max(1, r["snapshots"]))
    return {"critical": r["ledger_line_bytes"], "background": (3 * SEVEN_B) / every + delta_share * file_7b}


def table(results: list[dict], load) -> str:
    lines = [
        "| variant | versions | commit ms (median / mean) | step s (median) | commit / step | trainer busy | "
        "critical-path bytes per version (% of fp32 weights) | background bytes per version | 7B: critical / "
        "background per version |",
        "|" + "---|" * 9,
    ]
    for r in results:
        s = seven_b(r)
        lines.append(
            f"| {r['label']} | {r['versions']} | {1000 * r['commit_s_median']:.0f} / {1000 * r['commit_s_mean']:.0f} "
            f"| {r['train_s_median']:.2f} | {100 * r['commit_share']:.2f} % | {100 * r['busy']:.1f} % | "
            f"{_mb(r['critical_bytes'])} ({100 * r['critical_share']:.3f} %) | {_mb(r['background_bytes'])} | "
            f"{_mb(s['critical'])} / {_mb(s['background'])} |"
        )
    a = results[-1]
    lines += [
        "",
        f"model: {a['fp32_bytes'] / 1e6:.0f} MB of fp32 weights, its bf16 file {a['file_bytes'] / 1e6:.0f} MB, the "
        f"delta {a['delta_bytes_median'] / 1e6:.2f} MB (median); after: {a['snapshots']} snapshots of "
        f"{a['snapshot_bytes'] / 1e6:.0f} MB in the background, {a['full_files']} full files",
        f"(load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; 2 cores)",
    ]
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=100)
    p.add_argument("--before", default="530f98d", help="the tree with the per-version checkpoint")
    p.add_argument("--snapshot-every", type=int, default=25)
    p.add_argument("--quick", action="store_true", help="10 versions, a snapshot every 5 (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.versions, args.snapshot_every = 10, 5
    from services.ops.launch.redis_server import EmbeddedRedis
    from services.ops.launch.tiny_model import make_tiny_model

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamrl-commit-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = Path(make_tiny_model(tmp / "model", **MODEL))
        server = EmbeddedRedis(tmp / "redis").start()
        before = tree_at(args.before, tmp / "before-tree")
        try:
            results = [
                variant("before", before, model_dir, server.url, tmp, args.versions, {}),
                variant(
                    "after",
                    ROOT,
                    model_dir,
                    server.url,
                    tmp,
                    args.versions,
                    {"snapshot_every_versions": args.snapshot_every, "snapshot_every_s": 0},
                ),
            ]
        finally:
            server.stop()
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT, capture_output=True)
            shutil.rmtree(before, ignore_errors=True)
    load = os.getloadavg()
    print(table(results, load))
    b, a = results
    rows = [
        {
            "what": f"trainer commit on the critical path, {a['fp32_bytes'] / 1e6:.0f} MB fp32 model, mean (share of a "
            f"step): after, before",
            "value": f"{1000 * a['commit_s_mean']:.0f} ms ({100 * a['commit_share']:.2f} %) against "
            f"{1000 * b['commit_s_mean']:.0f} ms ({100 * b['commit_share']:.1f} %)",
        },
        {
            "what": "bytes written on the commit's critical path per version, % of the fp32 weights: after, before",
            "value": f"{100 * a['critical_share']:.4f} % against {100 * b['critical_share']:.1f} %",
        },
        {
            "what": "trainer busy share, never waiting for samples: after, before",
            "value": f"{100 * a['busy']:.1f} % against {100 * b['busy']:.1f} %",
        },
    ]
    record(
        "commit_cost",
        rows,
        ["services/trainer", "shared/protocol/weights"],
        quick=args.quick,
        extra={"variants": results, "load": load, "before": args.before},
    )
    print(f"(total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

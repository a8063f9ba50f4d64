"""Delta weight sync, side by side in one invocation: full files vs deltas.

    python bench/weights/delta_sync.py [--versions 32] [--quick] [--json]

Each variant is one whole ``streamrl run`` (bench/harness/runs.py): a 33.7M-parameter Llama (random init,
services/ops/launch/tiny_model.py, bench/harness/runs.py MEDIUM) trained by the real trainer (AdamW, GRPO on real
rollouts of 2 rollout worker processes, bench/weights/delta_reward.py's reward so the advantages are not all 0), each
version published in bf16 and fetched by the workers over HTTP from the trainer's weight server (weights_fetch always,
sync_mode global: fetched before the pause). The two workers share one host folder (the default), so one transfer per
version serves both. Variants, in this order: lr 1e-6 full files (delta_max_chain 0), lr 1e-6 deltas, lr 1e-5 deltas.

Measured per variant, over the versions after the first 10: the delta's bytes as a share of the bf16 file's, over
the entropy floor (the bits naming the changed elements and their new values: shared/protocol/weights/delta.py), the
syncer's fetch phase (until every worker holds a verified copy: download, apply, sha256), the pause (pause + load +
resume), the trainer's step time (train_s) and commit time; the workers' bytes downloaded, versions made from
deltas, fallbacks. Then, on files of the lr 1e-6 deltas run kept as it ran (v10, v20, v21 and every delta): the
three codecs on v20 -> v21, and a worker 10 versions behind (v10 -> v20) over HTTP: the chain of 10 deltas against
the full file, bytes and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness.record import record  # noqa: E402
from bench.harness.runs import MEDIUM, streamrl_run  # noqa: E402

BEHIND = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_records(run_dir: Path, run: str) -> dict[str, list[dict]]:
    """kind -> the metrics records of an ended run, read from its own Redis data."""
    from services.ops.launch.redis_server import EmbeddedRedis
    from shared.protocol.keys import Keys
    from shared.protocol.streams import metrics
    from shared.runtime.connection import connect

    server = EmbeddedRedis(run_dir / run / "redis").start()
    try:
        # the run folder's head file, then Redis (the driver moves records older than stream_keep_s to the file)
        return metrics.history(connect(server.url), Keys(run), run_dir / run, ("publish", "sync", "rollout"))
    finally:
        server.stop()


class Archive:
    """Copies what the trainer publishes, as it appears (the trainer prunes old versions): every delta, and the full
    files of version 1 and of the ``keep`` versions when there are any; ``make`` then makes the files of ``keep``
    versions published as deltas from the chain (shared/runtime/weights/chain.py)."""

    def __init__(self, src: Path, dst: Path, keep: set[int]):
        self.src, self.dst, self.keep = src, dst, keep
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        dst.mkdir(parents=True, exist_ok=True)

    def loop(self) -> None:
        while not self.stop.wait(0.1):
            self.copy()

    def copy(self) -> None:
        if not self.src.is_dir():
            return
        for p in list(self.src.glob("v*.delta")) + list(self.src.glob("v*.safetensors")):
            # full files: the first version's (the base of every chain here) and the kept ones
            if (self.dst / p.name).exists() or p.suffix == ".safetensors" and int(p.stem[1:]) not in self.keep | {1}:
                continue
            try:
                shutil.copy(p, self.dst / f".{p.name}.tmp")
                os.replace(self.dst / f".{p.name}.tmp", self.dst / p.name)
            # pruned meanwhile
            except FileNotFoundError:
                pass

    def make(self) -> None:
        from shared.runtime.weights import chain

        for v in sorted(self.keep):
            chain.make(self.dst, v)


def variant(args, tmp: Path, model_dir: Path, label: str, lr: float, max_chain: int, keep: set[int]) -> dict:
    run = f"bench-delta-{label}"
    run_dir, weights = tmp / "runs", tmp / f"weights-{label}"
    flags = {
        "run": run,
        "run_dir": run_dir,
        "model_dir": model_dir,
        "dataset": "arithmetic",
        "reward_fn": "bench.weights.delta_reward:distinct_chars",
        "lr": lr,
        "publish_dtype": "bfloat16",
        "delta_max_chain": max_chain,
        "weights_dir": weights,
        "weights_port": free_port(),
        "weights_fetch": "always",
        "rollout_workers": 2,
        "max_versions": args.versions,
        "group_size": 4,
        "batch_groups": 2,
        "max_tokens": 16,
        "max_groups_in_flight": 2,
        "max_batch_size": 8,
        "tools": "",
        "val_every": 0,
        "max_staleness": 1,
        "log_level": "warning",
        "max_minutes": args.max_minutes,
    }
    archive = Archive(weights, tmp / f"archive-{label}", keep)
    archive.thread.start()
    try:
        _, steps = streamrl_run(flags, args.verbose)
    finally:
        archive.stop.set()
        archive.thread.join()
        archive.copy()
        archive.make()
    recs = run_records(run_dir, run)
    after = lambda r: r.get("version", 0) > 10  # noqa: E731
    pub = [r for r in recs["publish"] if after(r) and r["version"] <= args.versions]
    deltas = [r for r in pub if not r["snapshot"]]
    syncs = [r for r in recs["sync"] if after(r) and r["version"] <= args.versions]
    newest = {}
    for r in recs["rollout"]:
        newest[r["worker"]] = r
    workers = {
        k: sum(r.get(k, 0) for r in newest.values())
        for k in (
            "fetched_bytes",
            "delta_bytes",
            "delta_full_bytes",
            "delta_versions",
            "delta_fallbacks",
            "delta_missing",
            "delta_fetch_s",
            "delta_apply_s",
            "fetches",
        )
    }
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {
        "label": label,
        "lr": lr,
        "max_chain": max_chain,
        "versions": len(recs["publish"]),
        "full_mb": med([r["full_bytes"] / 1e6 for r in pub]),
        "delta_pct_median": med([100 * r["delta_bytes"] / r["full_bytes"] for r in deltas]),
        "delta_pct_max": max((100 * r["delta_bytes"] / r["full_bytes"] for r in deltas), default=float("nan")),
        "changed_pct_median": med([100 * r["changed"] / r["elements"] for r in deltas]),
        "over_floor_median": med([r["delta_bytes"] / r["floor_bytes"] for r in deltas]),
        "over_floor_max": max((r["delta_bytes"] / r["floor_bytes"] for r in deltas), default=float("nan")),
        "encode_s_median": med([r["encode_s"] for r in deltas]),
        "fetch_s_median": med([r.get("fetch_s", 0.0) for r in syncs]),
        "paused_s_median": med([r["paused_s"] for r in syncs]),
        "train_s_median": med([s["train_s"] for s in steps if s["version"] > 10]),
        "commit_s_median": med([s["commit_s"] for s in steps if s["version"] > 10 and s["commit_s"]]),
        "syncs": len(syncs),
        "deltas": len(deltas),
        **workers,
        "per_version": [
            {
                k: r.get(k)
                for k in ("version", "full_bytes", "delta_bytes", "floor_bytes", "changed", "elements", "encode_s")
            }
            for r in recs["publish"]
        ],
        "archive": str(archive.dst),
    }


def codecs(archive: Path, v: int) -> dict:
    from shared.protocol.weights import delta as wd
    from shared.runtime.weights.server import file_name

    base, target = (archive / file_name(v - 1)).read_bytes(), (archive / file_name(v)).read_bytes()
    floor = wd.entropy_floor_bits(base, target) / 8
    out = {"version": v, "full_bytes": len(target), "floor_bytes": round(floor)}
    for codec in wd.CODECS:
        t0 = time.perf_counter()
        delta = wd.encode(base, target, v, v - 1, codec=codec)
        t1 = time.perf_counter()
        assert wd.apply(base, delta) == target
        out[codec] = {
            "bytes": len(delta),
            "pct": 100 * len(delta) / len(target),
            "over_floor": len(delta) / floor,
            "encode_s": t1 - t0,
            "apply_s": time.perf_counter() - t1,
        }
    return out


def behind(archive: Path, tmp: Path, start: int, target: int) -> dict:
    """A worker holding ``start`` gets ``target`` over HTTP: the chain of deltas vs the full file."""
    from services.rollout.weights.local import LocalWeights
    from shared.runtime import logs
    from shared.runtime.config.keys import Config
    from shared.runtime.weights.checksum import sha256_file
    from shared.runtime.weights.server import WeightServer, file_name

    server = WeightServer(archive).start()
    digest = sha256_file(archive / file_name(target))
    out = {"from": start, "to": target}
    try:
        for label, chain in (("full", 0), ("deltas", target - start)):
            folder = tmp / f"behind-{label}"
            folder.mkdir(mode=0o700)
            shutil.copy(archive / file_name(start), folder / file_name(start))
            w = LocalWeights(
                Config(run="bench", weights_fetch="always", rollout_weights_dir=str(folder), delta_max_chain=chain),
                logs.get("bench"),
            )
            t0 = time.perf_counter()
            got = w.local(target, str(tmp / "elsewhere" / file_name(target)), digest, server.url_of(target))
            seconds = time.perf_counter() - t0
            assert sha256_file(got) == digest
            out[label] = {
                "seconds": seconds,
                "bytes": w.stats["fetched_bytes"],
                "steps": w.stats["delta_steps"],
                "fetch_s": w.stats["delta_fetch_s"],
                "apply_s": w.stats["delta_apply_s"],
            }
    finally:
        server.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=32)
    p.add_argument("--max-minutes", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="14 versions, lr 1e-6 only (a smoke run)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.versions = 14
    from services.ops.launch.tiny_model import make_tiny_model

    t_start = time.perf_counter()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="streamrl-delta-", dir=shm) as tmp_name:
        tmp = Path(tmp_name)
        model_dir = Path(make_tiny_model(tmp / "model", **MEDIUM))
        plan = [("full-1e-6", 1e-6, 0), ("deltas-1e-6", 1e-6, 10)] + ([] if args.quick else [("deltas-1e-5", 1e-5, 10)])
        keep = {10, 20, 21} if not args.quick else {3, 13, 14}
        results = [variant(args, tmp, model_dir, label, lr, chain, keep) for label, lr, chain in plan]
        archive = Path(results[1]["archive"])
        last = max(keep)
        extra = {"codecs": codecs(archive, last), "behind": behind(archive, tmp, min(keep), last - 1)}
    load = os.getloadavg()
    print(table(results, extra, load))
    rows = headline(results, extra)
    record(
        "delta_sync",
        rows,
        [
            "shared/protocol/weights/delta.py",
            "shared/runtime/weights/delta_fetch.py",
            "services/trainer/publisher.py",
            "services/rollout/weights",
        ],
        quick=args.quick,
        extra={"variants": results, **extra, "load": load},
    )
    print(f"(total {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        print(json.dumps({"variants": results, **extra}, indent=1, default=str))
    return 0


def table(results: list[dict], extra: dict, load) -> str:
    lines = [
        "| variant | versions | file MB | delta % of file (median / max) | changed % | delta / floor (median / "
        "max) | encode s | fetch phase s | pause s | train step s | commit s | worker MB downloaded | from deltas"
        " | fallbacks |",
        "|" + "---|" * 14,
    ]
    for r in results:
        lines.append(
            f"| {r['label']} | {r['versions']} | {r['full_mb']:.1f} | {r['delta_pct_median']:.2f} / "
            f"{r['delta_pct_max']:.2f} | {r['changed_pct_median']:.2f} | {r['over_floor_median']:.3f} / "
            f"{r['over_floor_max']:.3f} | {r['encode_s_median']:.2f} | {r['fetch_s_median']:.3f} | "
            f"{r['paused_s_median']:.3f} | {r['train_s_median']:.3f} | {r['commit_s_median']:.2f} | "
            f"{r['fetched_bytes'] / 1e6:.1f} | {r['delta_versions']} | {r['delta_fallbacks']} |"
        )
    c = extra["codecs"]
    lines += [
        "",
        f"codecs on v{c['version'] - 1} -> v{c['version']} (lr 1e-6), floor {c['floor_bytes'] / 1e3:.0f} kB "
        f"of {c['full_bytes'] / 1e6:.1f} MB:",
    ]
    for name in ("sparse", "values", "xor"):
        x = c[name]
        lines.append(
            f"  {name:7s} {x['bytes'] / 1e3:8.0f} kB  {x['pct']:.2f}% of the file  {x['over_floor']:.3f}x the "
            f"floor  encode {x['encode_s']:.2f} s  apply+sha256 {x['apply_s']:.2f} s"
        )
    b = extra["behind"]
    lines += [
        "",
        f"a worker {b['to'] - b['from']} versions behind (v{b['from']} -> v{b['to']}) over HTTP:",
        f"  full file  {b['full']['bytes'] / 1e6:.1f} MB in {b['full']['seconds']:.2f} s",
        f"  deltas     {b['deltas']['bytes'] / 1e6:.2f} MB in {b['deltas']['seconds']:.2f} s ({b['deltas']['steps']}"
        f" deltas: fetch {b['deltas']['fetch_s']:.2f} s, apply + sha256 {b['deltas']['apply_s']:.2f} s)",
        f"(load average {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f}; 2 cores shared with other work)",
    ]
    return "\n".join(lines)


def headline(results: list[dict], extra: dict) -> list[dict]:
    by = {r["label"]: r for r in results}
    d = by["deltas-1e-6"]
    rows = [
        {
            "what": "delta bytes per version, lr 1e-6, after v10 (median / max % of the bf16 file)",
            "value": f"{d['delta_pct_median']:.2f} % / {d['delta_pct_max']:.2f} %",
        },
        {
            "what": "delta over the entropy floor, lr 1e-6 (median / max)",
            "value": f"{d['over_floor_median']:.3f}x / {d['over_floor_max']:.3f}x",
        },
    ]
    if "deltas-1e-5" in by:
        rows.append(
            {
                "what": "delta bytes per version, lr 1e-5 (median % of the file)",
                "value": f"{by['deltas-1e-5']['delta_pct_median']:.2f} %",
            }
        )
    b = extra["behind"]
    rows.append(
        {
            "what": f"a worker {b['to'] - b['from']} versions behind: chain vs full file (bytes, seconds)",
            "value": f"{b['deltas']['bytes'] / 1e6:.2f} MB in {b['deltas']['seconds']:.2f} s vs "
            f"{b['full']['bytes'] / 1e6:.1f} MB in {b['full']['seconds']:.2f} s",
        }
    )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

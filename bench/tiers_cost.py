"""What moving episodes out of Redis costs the pipeline: the default job run with ``log_retention_versions`` off
and on, side by side in one invocation (same seed, same number of versions, interleaved off/on pairs so that a
change in the box's load moves both alike), each a whole ``streamrl run``.

    python bench/tiers_cost.py [--versions 300] [--pairs 2] [--retention 20] [--py-spy DIR]

Reported per variant: trained samples/s (samples in trained batches / (last step - driver start), startup
excluded, from the trainer's metrics file), and for retention on the segments the archiver wrote (episodes,
bytes per policy token on the real run's episodes), and the CPU seconds of the run's processes (bench/proc_cpu.py,
from /proc: the whole run's, and the archiver's per episode moved and as a share of the run's, with and without
its start: the archiver's CPU seconds when its first segment was listed, which also hold that first move, are
counted apart). ``--py-spy DIR``: each 'on' run's archiver is sampled by py-spy (``pip install py-spy``; its
collapsed stacks in ``DIR/archiver-<run>.txt``). The figures are
the on/off ratio of samples/s (goal: at most 2 % slower) and the archiver's CPU share (CPU seconds move far less
with the box's load than samples/s); the load average is printed, since other work on the box moves both."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.proc_cpu import TreeCPU, _stat  # noqa: E402
from bench.record import record  # noqa: E402
from bench.runs import ROOT, streamrl_run  # noqa: E402
from bench.tiers import folder_columns  # noqa: E402
from shared.protocol.archive import segments  # noqa: E402


def streams_left(run_dir: Path, run: str) -> int:
    """Episode streams still in a finished run's Redis (its append-only file, served for the count)."""
    from services.ops.launch.redis_server import EmbeddedRedis
    from shared.protocol.keys import Keys
    from shared.runtime.connection import connect

    server = EmbeddedRedis(run_dir / run / "redis").start()
    try:
        return sum(1 for _ in connect(server.url).scan_iter(Keys(run).episode("*"), count=1000))
    finally:
        server.stop()


class FirstMove:
    """Watches a run for its archiver: its CPU seconds when the run's first segment is listed (the process's start
    and its first move), and optionally py-spy on it."""

    def __init__(self, tree: TreeCPU, manifest: Path, spy_out: Path | None):
        self.tree, self.manifest, self.spy_out = tree, manifest, spy_out
        self.cpu_s: float | None = None
        self.spy: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pid = None
        while not self._stop.wait(0.02):
            if pid is None:
                pid = next((p for p, c in list(self.tree.commands.items()) if c.startswith("[archiver]")), None)
                if pid is not None and self.spy_out is not None:
                    self.spy = subprocess.Popen(
                        [
                            "py-spy",
                            "record",
                            "--pid",
                            str(pid),
                            "--rate",
                            "250",
                            "--format",
                            "raw",
                            "--nonblocking",
                            "--output",
                            str(self.spy_out),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.STDOUT,
                    )
            elif self.manifest.exists():
                st = _stat(pid)
                self.cpu_s = st[1] if st is not None else None
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.spy is not None:
            self.spy.wait(timeout=60)


def summarize(t_start: float, steps: list[dict]) -> dict:
    samples = sum(s["samples"] for s in steps)
    elapsed = steps[-1]["time"] - t_start
    return {"samples": samples, "seconds": elapsed, "samples_per_s": samples / elapsed, "steps": len(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=2, help="off/on pairs, interleaved")
    ap.add_argument("--retention", type=int, default=20, help="log_retention_versions of the 'on' runs")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--py-spy", type=Path, help="sample each 'on' run's archiver with py-spy into this folder")
    args = ap.parse_args()
    if args.py_spy is not None:
        if shutil.which("py-spy") is None:
            raise SystemExit("--py-spy: no py-spy on PATH (pip install py-spy)")
        args.py_spy.mkdir(parents=True, exist_ok=True)
    work = ROOT / "runs" / f"bench-tiers-cost-{uuid.uuid4().hex[:6]}"
    load_before = os.getloadavg()
    results: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for pair in range(args.pairs):
            for variant, retention in (("off", 0), ("on", args.retention)):
                run = f"tiers-{variant}-{pair}"
                flags = {
                    "run": run,
                    "run_dir": str(work),
                    "max_versions": args.versions,
                    "seed": 0,
                    "log_retention_versions": retention,
                    "log_level": "warning",
                }
                watch: list[TreeCPU] = []
                first: list[FirstMove] = []
                spy_out = args.py_spy / f"archiver-{run}.txt" if args.py_spy and retention else None

                def on_start(p, run=run, spy_out=spy_out):
                    watch.append(TreeCPU(p.pid).__enter__())
                    first.append(FirstMove(watch[0], segments.folder_of(work / run) / segments.MANIFEST, spy_out))

                try:
                    t_start, steps = streamrl_run(flags, args.verbose, on_start=on_start)
                finally:
                    for w in watch:
                        w.__exit__(None, None, None)
                    for f in first:
                        f.close()
                r = summarize(t_start, steps)
                r["cpu_s"] = watch[0].total()
                r["archiver_cpu_s"] = watch[0].total("[archiver]") + watch[0].total(
                    "-m services.archiver", excluding="keep"
                )
                r["segments"] = segments.SegmentStore(segments.folder_of(work / run)).sizes()
                listed = segments.read_manifest(segments.folder_of(work / run))
                # its start and its first move
                r["archiver_first_cpu_s"] = first[0].cpu_s if first else None
                r["first_segment_episodes"] = listed[0]["episodes"] if listed else 0
                r["streams_left"] = streams_left(work, run)
                r["columns"] = folder_columns(segments.folder_of(work / run))
                results[variant].append(r)
                cold = r["segments"]
                moved = (
                    f"; {cold['episodes']} episodes moved, {cold['bytes'] / max(cold['tokens'], 1):.1f} B per "
                    f"policy token in segments"
                    if cold["episodes"]
                    else ""
                )
                per_version = (cold["episodes"] + r["streams_left"]) / args.versions
                share = (
                    f"; {r['streams_left']} streams left in Redis (= {r['streams_left'] / per_version:.0f} "
                    f"versions' episodes); archiver {r['archiver_cpu_s']:.2f} of {r['cpu_s']:.1f} CPU s "
                    f"({100 * r['archiver_cpu_s'] / r['cpu_s']:.1f} %), "
                    f"{1e6 * r['archiver_cpu_s'] / max(cold['episodes'], 1):.0f} us per episode moved; "
                    f"{r['archiver_first_cpu_s'] or 0:.2f} CPU s by its first segment "
                    f"({r['first_segment_episodes']} episodes)"
                    if variant == "on"
                    else f"; {r['cpu_s']:.1f} CPU s"
                )
                print(
                    f"   {variant} #{pair}: {r['samples']} samples in {r['seconds']:.1f}s = "
                    f"{r['samples_per_s']:.1f}/s{moved}{share}",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {v: sum(r["samples"] for r in rs) / sum(r["seconds"] for r in rs) for v, rs in results.items()}
    ratio = rate["on"] / rate["off"]
    cold = [r["segments"] for r in results["on"]]
    per_token = sum(c["bytes"] for c in cold) / max(sum(c["tokens"] for c in cold), 1)
    per_episode = sum(c["bytes"] for c in cold) / max(sum(c["episodes"] for c in cold), 1)
    on = results["on"]
    archiver_cpu = sum(r["archiver_cpu_s"] for r in on)
    share = archiver_cpu / sum(r["cpu_s"] for r in on)
    per_moved = archiver_cpu / max(sum(c["episodes"] for c in cold), 1)
    # each archiver's start and first move
    start_cpu = sum(r["archiver_first_cpu_s"] or 0 for r in on)
    later_share = (archiver_cpu - start_cpu) / sum(r["cpu_s"] for r in on)
    later_per_moved = (archiver_cpu - start_cpu) / max(
        sum(c["episodes"] for c in cold) - sum(r["first_segment_episodes"] for r in on), 1
    )
    cpu_ratio = (sum(r["cpu_s"] / r["samples"] for r in on) / len(on)) / (
        sum(r["cpu_s"] / r["samples"] for r in results["off"]) / len(results["off"])
    )
    load = os.getloadavg()
    print(
        f"archiver CPU: {100 * share:.2f} % of the 'on' runs' CPU seconds, {1e6 * per_moved:.0f} us per episode "
        f"moved; the whole run's CPU per sample on/off {cpu_ratio:.3f}"
    )
    print(
        f"  without its start (the CPU seconds by its first segment, {start_cpu / len(on):.2f} s a run, start and "
        f"first move): {100 * later_share:.2f} %, {1e6 * later_per_moved:.0f} us per episode moved after it"
        + ("" if len(cold) and all(c["segments"] > 1 for c in cold) else " (a run of one segment: not a figure)")
    )
    print(
        f"\nsamples/s, retention off {rate['off']:.1f}, on ({args.retention} versions) {rate['on']:.1f}: "
        f"on/off {ratio:.3f} ({100 * (ratio - 1):+.1f} %)"
    )
    print(f"segments of the real default run: {per_token:.2f} B per policy token, {per_episode:.1f} B per episode")
    tokens = max(sum(c["tokens"] for c in cold), 1)
    by_column = {}
    for r in on:
        for name, size in r["columns"].items():
            by_column[name] = by_column.get(name, 0) + size
    print(
        "  by column (B/token): "
        + ", ".join(f"{k} {v / tokens:.3f}" for k, v in sorted(by_column.items(), key=lambda kv: -kv[1]))
    )
    print(f"load average {load_before[0]:.2f} before, {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    record(
        "tiers_cost",
        [
            {
                "what": f"samples/s with retention on ({args.retention} versions) / off, default job, {args.versions} "
                f"versions x {args.pairs} pairs",
                "value": f"{ratio:.3f} ({rate['on']:.1f} vs {rate['off']:.1f})",
            },
            {
                "what": "archiver CPU, share of the run's CPU seconds (per episode moved)",
                "value": f"{100 * share:.2f} % ({1e6 * per_moved:.0f} us)",
            },
            {
                "what": "archiver CPU after its first segment (its start and first move left out), share (per episode)",
                "value": f"{100 * later_share:.2f} % ({1e6 * later_per_moved:.0f} us)",
            },
            {
                "what": "segment bytes per policy token, the default run's episodes",
                "value": f"{per_token:.1f} ({per_episode:.0f} B per episode)",
            },
        ],
        [
            "services/archiver",
            "shared/protocol/archive/segments.py",
            "shared/protocol/archive/entries.py",
            "shared/protocol/archive/templates.py",
            "shared/protocol/archive/arrays.py",
            "shared/protocol/archive/summary.py",
            "shared/protocol/archive/builder.py",
        ],
        extra={
            "columns_per_token": {k: round(v / tokens, 4) for k, v in by_column.items()},
            "load_average_before": load_before,
            "load_average": load,
            "runs": results,
        },
    )


if __name__ == "__main__":
    main()

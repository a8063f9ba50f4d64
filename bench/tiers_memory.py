"""Redis memory over a long default run with a retention window: does it stay flat once the archiver moves trained
episodes out (issue 33)? One ``streamrl run`` with ``log_retention_versions`` on; a thread beside it reads the
run's Redis every ``--every`` seconds (INFO used_memory, DBSIZE, the newest version) and, a few times, counts its
keys by family (episode streams, markers, the rest) with their memory. Writes docs/tiers_memory.png (used memory
and keys against versions) and prints the ratio: the late level (mean over the last 10 % of versions) over the
first window's level (mean over the versions from the archiver's first move, V1, to V1 + max(R, 5 % of the
versions), R the retention window), goal at most 1.2. Only samples taken while the run trains count (the run's
wind-down after its last version, when the archiver empties Redis, is left out: it would flatter the late level),
and the level of each fifth of the run is printed beside its versions per second: the episode streams are bounded
in versions (the retention window plus the archiver's ``archive_every_versions``), the time-bounded families (markers
with a TTL, streams trimmed by age) scale with the rate and fill over their first minutes.

    python bench/tiers_memory.py [--versions 10000] [--retention 20]"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from bench.runs import ROOT, streamrl_run  # noqa: E402
from shared.protocol.archive import segments  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams import versions
from shared.runtime import secrets  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402


def family(keys: Keys, key: bytes) -> str:
    """A key's family: episode streams, a marker kind (``<head>:*``), or the one key's name (a stream, ...)."""
    text = key.decode(errors="replace")
    if keys.is_episode(text):
        return "episode streams"
    rest = text.removeprefix(keys.base)
    if rest == text:
        return "other (rq, ...)"
    if text in SINGLE:
        return rest
    head = rest.split(":")[0]
    return f"{head}:* markers" if ":" in rest else rest


# the run's one-of-a-kind keys whose names hold a ':' (prompts:val, ...), set in main
SINGLE = set()


def census(client, keys: Keys) -> dict[str, list[int]]:
    """{family: [keys, bytes]} over every key (SCAN; MEMORY USAGE of every one-of-a-kind key, and of one key in 50
    of a family of many, scaled: cheap enough at 10,000 versions)."""
    out: dict[str, list] = {}
    for key in client.scan_iter(count=10_000):
        f = family(keys, key)
        c = out.setdefault(f, [0, 0, 0])
        c[0] += 1
        if c[0] % 50 == 1:
            c[1] += client.memory_usage(key, samples=0) or 0
            c[2] += 1
    return {f: [c[0], int(c[1] * c[0] / max(c[2], 1))] for f, c in out.items()}


class Sampler(threading.Thread):
    def __init__(self, keys: Keys, every: float, census_versions: list[int], run_path: Path):
        super().__init__(daemon=True)
        self.keys, self.every = keys, every
        self.run_path = run_path
        self.store = segments.SegmentStore(segments.folder_of(run_path))
        # (time, version, used_memory, keys)
        self.samples: list[tuple[float, int, int, int]] = []
        # the version at which the first segment was listed
        self.first_move: int | None = None
        self.censuses: dict[int, dict] = {}
        self.todo = list(census_versions)
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        client = None
        while not self.stop.is_set():
            try:
                # the embedded server: where `streamrl run` put it, its password
                run = secrets.read(self.run_path)
                if not run.get("redis_server"):
                    raise RuntimeError("the run's embedded server has not started yet")
                url = secrets.with_password(f"redis://{run['redis_server']}/0", run.get("redis_password", ""))
                # gone at the end: give up soon
                client = client or connect(url, wait=5)
                version = versions.latest_number(client, self.keys)
                self.samples.append((time.time(), version, int(client.info("memory")["used_memory"]), client.dbsize()))
                if self.first_move is None and self.store.sizes()["segments"]:
                    self.first_move = version
                if self.todo and version >= self.todo[0]:
                    self.todo.pop(0)
                    self.censuses[version] = census(client, self.keys)
            except Exception as exc:  # noqa: BLE001 - the run's Redis not up yet, or gone at the end
                self.errors.append(repr(exc))
                client = None
            self.stop.wait(self.every)


def level(samples, lo: int, hi: int) -> float:
    picked = [m for _, v, m, _ in samples if lo <= v <= hi]
    return sum(picked) / max(len(picked), 1)


def fifth(samples, lo: int, hi: int) -> tuple[int, int, float, float]:
    """(lo, hi, mean used_memory in MB, versions per second) of the samples between versions lo and hi."""
    picked = [(t, v) for t, v, _, _ in samples if lo <= v <= hi]
    seconds = picked[-1][0] - picked[0][0] if len(picked) > 1 else 0.0
    return lo, hi, level(samples, lo, hi) / 1e6, (picked[-1][1] - picked[0][1]) / seconds if seconds else 0.0


def plot(samples, retention: int, window: tuple[int, int], path: Path, ratio: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = [s[1] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(v, [s[2] / 1e6 for s in samples], label="Redis used_memory (MB)")
    ax.set_xlabel("policy version")
    ax.set_ylabel("MB")
    ax.axvspan(*window, color="0.9", label="first window (from the first move)")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(v, [s[3] / 1e3 for s in samples], color="tab:orange", label="keys (thousands)")
    ax2.set_ylabel("keys (thousands)")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"default run, log_retention_versions={retention}: late / first window = {ratio:.2f}x")
    lines = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=10_000)
    ap.add_argument("--retention", type=int, default=20)
    ap.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--out", default=str(ROOT / "docs" / "tiers_memory.png"))
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--archiver-nice", type=int, default=None, help="the archiver's priority (default: the config's)")
    args = ap.parse_args()
    run, work = "tiers-memory", ROOT / "runs" / f"bench-tiers-memory-{uuid.uuid4().hex[:6]}"
    censuses = [args.versions // 20] + [args.versions * k // 5 for k in range(1, 5)] + [args.versions * 97 // 100]
    keys = Keys(run)
    SINGLE.update(
        getattr(keys, name)
        for name in (
            "val_prompts",
            "val_samples",
            "agent_groups",
            "gate_started",
            "load_lease",
            "driver_enqueued",
            "val_requested",
            "agents_running",
        )
    )
    sampler = Sampler(keys, args.every, censuses, work / run)
    sampler.start()
    load_before = os.getloadavg()
    try:
        t_start, steps = streamrl_run(
            {
                "run": run,
                "run_dir": str(work),
                "seed": 0,
                "max_versions": args.versions,
                "log_retention_versions": args.retention,
                # to the last version
                "max_minutes": 0,
                "log_level": "warning",
                **({} if args.archiver_nice is None else {"archiver_nice": args.archiver_nice}),
            },
            args.verbose,
        )
        cold = segments.SegmentStore(segments.folder_of(work / run)).sizes()
    finally:
        sampler.stop.set()
        sampler.join()
        shutil.rmtree(work, ignore_errors=True)
    s = sampler.samples
    if not s:
        raise SystemExit(f"no sample of the run's Redis: {sampler.errors[-3:]}")
    top = max(v for _, v, _, _ in s)
    # up to the last version: not the wind-down
    s = s[: next(i for i, x in enumerate(s) if x[1] == top) + 1]
    v1 = sampler.first_move or args.retention
    window = (v1, v1 + max(args.retention, top // 20))
    first, late = level(s, *window), level(s, int(0.9 * top), top)
    ratio = late / first
    plot(s, args.retention, window, Path(args.out), ratio)
    load = os.getloadavg()
    print(
        f"{len(s)} samples to version {top} ({len(steps)} steps, {time.time() - t_start:.0f} s): used_memory "
        f"{first / 1e6:.1f} MB over versions {window[0]}..{window[1]} (the first move at {v1}), "
        f"{late / 1e6:.1f} MB over the "
        f"last 10 %: {ratio:.2f}x (goal <= 1.2); keys {s[0][3]} -> {s[-1][3]}"
    )
    fifths = [fifth(s, top * k // 5, top * (k + 1) // 5) for k in range(5)]
    print(
        "by fifth of the run: "
        + ", ".join(f"v{lo}-{hi} {mb:.1f} MB at {vps:.1f} versions/s" for lo, hi, mb, vps in fifths)
    )
    print(
        f"segments: {cold['segments']} files, {cold['episodes']} episodes, {cold['bytes'] / 1e6:.1f} MB, "
        f"{cold['bytes'] / max(cold['tokens'], 1):.1f} B per policy token"
    )
    for version, families in sorted(sampler.censuses.items()):
        print(
            f"keys at version {version}: "
            + ", ".join(
                f"{f} {n} ({b / 1e6:.1f} MB)" for f, (n, b) in sorted(families.items(), key=lambda kv: -kv[1][1])
            )
        )
    if len(sampler.censuses) >= 2:
        (v0, start), (v9, end) = min(sampler.censuses.items()), max(sampler.censuses.items())
        print(f"per family, version {v0} -> {v9} (keys, kB):")
        for f in sorted(set(start) | set(end), key=lambda f: -end.get(f, [0, 0])[1]):
            (n0, b0), (n9, b9) = start.get(f, [0, 0]), end.get(f, [0, 0])
            print(f"  {f:32s} {n0:>7,} -> {n9:>7,} keys  {b0 / 1e3:>8.1f} -> {b9 / 1e3:>8.1f} kB")
    print(
        f"load average {load_before[0]:.2f} before, {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end; "
        f"plot: {args.out}"
    )
    record(
        "tiers_memory",
        [
            {
                "what": f"Redis used_memory, late / first retention window, default run of {top} versions, retention "
                f"{args.retention}{'' if args.archiver_nice is None else f', archiver_nice {args.archiver_nice}'}",
                "value": f"{ratio:.2f}x ({first / 1e6:.1f} -> {late / 1e6:.1f} MB)",
            },
            {
                "what": "Redis used_memory by fifth of the run (MB, at versions/s)",
                "value": ", ".join(f"{mb:.1f} at {vps:.1f}" for _, _, mb, vps in fifths),
            },
        ],
        [
            "services/archiver",
            "shared/protocol/archive/segments.py",
            "shared/protocol/archive/entries.py",
            "shared/protocol/archive/builder.py",
            "services/driver/heads.py",
            "shared/protocol/streams/stream_head.py",
        ],
        extra={
            "load_average_before": load_before,
            "load_average": load,
            "segments": cold,
            "censuses": sampler.censuses,
            "fifths": fifths,
            "samples": s[:: max(1, len(s) // 400)],
        },
    )


if __name__ == "__main__":
    main()

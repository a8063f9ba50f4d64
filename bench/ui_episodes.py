"""`streamrl ui`'s episodes page on a large run: a filtered query against the kept index vs folding every
episode stream (what a page without an index would do per request).

    python bench/ui_episodes.py [--episodes 68000] [--repeats 5]          synthetic episodes, real event codec
    python bench/ui_episodes.py --run demo --run-dir runs                  an ended run (`./dev run`), its own data

The synthetic run: ``--episodes`` episode streams written through the real codec (shared/protocol/episode/events.py)
into an EmbeddedRedis in a temp folder: 3 token chunks of 16 each, a third aborted and resumed under the next
version, 2 % taken over, 3 % failed, 20 % cut short by max_tokens. An ended run is read from a served copy of its
data (services/ops/inspect/serve_ended.py), as `streamrl ui` reads it.

Measured, in one run, side by side: (A) the first build of the index (``read_summaries``: every stream read and
folded once); (B) loading the kept index from ``<run>/ui/episodes.msgpack``; (C) a refresh that finds nothing
new (a SCAN of the episode keys); (D) filtered and sorted queries through the real HTTP app on uvicorn (an httpx
client, median and worst of ``--repeats``). Prints the load average: the box is shared.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from bench.record import record  # noqa: E402
from services.ops.inspect.run_target import Target  # noqa: E402
from services.ops.inspect.serve_ended import ServedCopy  # noqa: E402
from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from services.ops.ui.app import make_app  # noqa: E402
from services.ops.ui.index import EpisodeIndex  # noqa: E402
from services.ops.ui.sources import RunSource, Sources  # noqa: E402
from shared.protocol.archive import segments  # noqa: E402
from shared.protocol.episode.events import Event, encode  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime import runstate  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

QUERIES = {
    "failed or truncated": "outcome=failed,truncated",
    "aborted, by reward desc": "min_aborts=1&sort=reward&desc=1",
    "taken over": "taken_over=1",
    "reward < 0.5 over 2+ versions, by length": "reward_below=0.5&min_span=2&sort=length&desc=1",
    "all, page 100": "offset=5000&limit=50",
}


def synthetic_events(i: int) -> list[Event]:
    eid, group, v, w = f"q{i // 8:06d}-{i % 8}", f"q{i // 8:06d}", 1 + i // 4000, f"rollout-{i % 3}"
    evs = [
        Event(
            "started",
            v,
            w,
            0,
            {
                "episode_id": eid,
                "group_id": group,
                "index": i % 8,
                "prompt_ids": [5, 6, 7, 8],
                "sampling": {"max_tokens": 48},
                "task": {"answer": "4"},
            },
        )
    ]
    chunk = lambda version, who: Event(
        "tokens",
        version,
        who,
        len(evs),
        {
            "ids": list(range(16)),  # noqa: E731
            "logprobs": [-0.5] * 16,
        },
    )
    evs.append(chunk(v, w))
    # aborted by a sync, resumed under the next version (2 %: by another worker, a takeover)
    if i % 3 == 0:
        evs.append(Event("aborted", v, w, len(evs), {"reason": "pause", "num_tokens": 16}))
        other = f"rollout-{(i + 1) % 3}" if i % 50 == 0 else w
        evs.append(
            Event("resumed", v + 1, other, len(evs), {"num_tokens": 16, **({"takeover_from": w} if other != w else {})})
        )
        v, w = v + 1, other
    evs.append(chunk(v, w))
    if i % 33 == 0:
        evs.append(Event("failed", v, w, len(evs), {"error": "tool calc crashed", "where": "tool"}))
    else:
        evs.append(chunk(v, w))
        reason = "length" if i % 5 == 0 else "stop"
        evs.append(Event("finished", v, w, len(evs), {"reason": reason, "reward": float(i % 7 == 0), "details": {}}))
    return evs


def write_synthetic(client, keys: Keys, n: int) -> None:
    t0 = time.monotonic()
    for start in range(0, n, 1000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(n, start + 1000)):
            evs = synthetic_events(i)
            key = keys.episode(evs[0].data["episode_id"])
            for ev in evs:
                pipe.xadd(key, encode(ev))
        pipe.execute()
        if start % 10000 == 0:
            print(f"  written {start + 1000:,} / {n:,} episodes ({time.monotonic() - t0:.0f} s)", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(client, keys: Keys, run_path: Path, run_id: str, repeats: int, archive=None) -> dict:
    """``archive``: the run's segments (the episodes the archiver moved), which the ui reads with Redis."""
    out: dict = {}
    cache = run_path / "ui" / "episodes.msgpack"
    cache.unlink(missing_ok=True)
    index = EpisodeIndex(client, keys, run_path, run_id, archive=archive)
    t0 = time.perf_counter()
    index.refresh()
    out["build_s"], out["episodes"] = time.perf_counter() - t0, len(index.table)
    print(
        f"(A) first build, every stream read and folded: {out['build_s']:.1f} s for {out['episodes']:,} episodes",
        flush=True,
    )
    again = EpisodeIndex(client, keys, run_path, run_id, archive=archive)
    t0 = time.perf_counter()
    again.load()
    out["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fresh = again.refresh()
    out["refresh_s"] = time.perf_counter() - t0
    print(
        f"(B) kept index loaded: {out['load_s']:.2f} s ({cache.stat().st_size / 1e6:.1f} MB); (C) a refresh with "
        f"nothing new: {out['refresh_s']:.2f} s ({fresh} episodes read)",
        flush=True,
    )

    sources = Sources(Config(run_dir=str(run_path.parent)), {})
    src = RunSource(run_path.name, Target(Config(run=keys.run), keys, run_path, None), client, True, sources.stack)
    # as after the ui's first refresh
    src.index, src.ready = again, True
    sources.runs[run_path.name] = src
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(sources), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    out["queries"] = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        for name, query in QUERIES.items():
            times, total = [], 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = http.get(f"/api/run/{run_path.name}/episodes?{query}")
                times.append(time.perf_counter() - t0)
                r.raise_for_status()
                total = r.json()["total"]
            out["queries"][name] = {"median_s": statistics.median(times), "worst_s": max(times), "matches": total}
            print(
                f"(D) {name:<44} {total:>7,} match  median {statistics.median(times) * 1000:7.1f} ms  worst "
                f"{max(times) * 1000:7.1f} ms",
                flush=True,
            )
    server.should_exit = True
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=68_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--run", help="an ended run's name (its folder under --run-dir) instead of synthetic episodes")
    ap.add_argument("--run-dir", default="runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        if args.run:
            run_path = Path(args.run_dir) / args.run
            marker = runstate.read_marker(run_path) or {}
            with ServedCopy(run_path) as url:
                keys = Keys(marker.get("run", args.run))
                # the kept index goes to a scratch folder: the run's own is left as it was
                scratch = Path(tmp) / args.run
                out = measure(
                    connect(url),
                    keys,
                    scratch,
                    marker.get("id", ""),
                    args.repeats,
                    archive=segments.SegmentStore(segments.folder_of(run_path)),
                )
            what = f"ended `./dev run` {args.run!r}"
        else:
            server = EmbeddedRedis(Path(tmp) / "redis").start()
            try:
                client, keys = connect(server.url), Keys("bench")
                write_synthetic(client, keys, args.episodes)
                out = measure(client, keys, Path(tmp) / "runs" / "bench", "bench", args.repeats)
            finally:
                server.stop()
            what = "synthetic run"
    worst = max(q["worst_s"] for q in out["queries"].values())
    median = statistics.median(q["median_s"] for q in out["queries"].values())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{what}, {out['episodes']:,} episodes: filtered query median {median * 1000:.0f} ms, worst "
        f"{worst * 1000:.0f} ms (< 1 s: {'yes' if worst < 1 else 'NO'}), {out['build_s'] / median:.0f}x faster "
        f"than folding every stream ({out['build_s']:.1f} s); load average {load}"
    )
    rows = [
        {
            "what": f"episodes page: filtered, sorted query over {out['episodes']:,} episodes ({what}), through HTTP",
            "value": f"median {median * 1000:.0f} ms, worst {worst * 1000:.0f} ms of {len(QUERIES)} queries x "
            f"{args.repeats}; folding every stream instead: {out['build_s']:.1f} s "
            f"({out['build_s'] / median:.0f}x)",
        },
        {
            "what": "the kept index: loaded at start / refreshed with nothing new",
            "value": f"{out['load_s']:.2f} s / {out['refresh_s']:.2f} s",
        },
    ]
    record(
        "ui_episodes" + ("_run" if args.run else ""),
        rows,
        ["services/ops/ui", "services/ops/inspect/episodes.py", "bench/ui_episodes.py"],
        extra=out,
    )
    return 0 if worst < 1 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Event-log capacity (issue 15): token events per second one Redis node (or a cluster) absorbs through streamrl's
real append path before append latency rises, as "GPUs of rollout per Redis node".

    PYTHONPATH=. python bench/redis_capacity.py                            # own embedded Redis, ramp 1..96 GPUs
    PYTHONPATH=. python bench/redis_capacity.py --redis-url redis://host:6379/0 --writers 4
    PYTHONPATH=. python bench/redis_capacity.py --quick                    # 3 short steps, a smoke run

The load is SIMULATED GPUs (no model runs): one simulated GPU is one rollout worker's batch of ``--batch`` (64)
episodes decoding ``--gpu-tokens-per-s`` (5,000) tokens per second together, so every episode gets one token per
step of ``batch / gpu_tokens_per_s`` seconds (12.8 ms). Each simulated GPU has its own ``EpisodeLog`` (the class the
worker writes with, fenced EVALSHA appends in one pipeline per flush) at the default flush settings
(``flush_tokens`` 16, ``flush_ms`` 50 from shared/runtime/config/keys.py), driven the way the worker drives it: every
step appends one token to each episode, flushes the episodes that ended in it (their ``finished`` events: the
worker's ``one_flush``), then calls ``maybe_flush`` (all pending episodes, once one is due); an ended episode is
replaced by a new one whose ``started`` event is flushed at once (as the worker's ``open_groups`` does). At 5,000
tokens/s and batch 64 the 50 ms age limit flushes first, so entries hold about 4-5 tokens: the per-GPU rate, not
only the total, sets the entry rate the server sees.

The ramp offers 1, 2, 4, ... simulated GPUs, spread over ``--writers`` processes (started and stopped with
tests/support/procs.py). A writer that falls behind its steps skips them (a real worker would also slow down: the flush
is synchronous in its loop), so "achieved" falls below "offered". Per step, over ``--step-seconds`` after a warm-up:
offered and achieved tokens/s, flushes/s and entries/s, p50/p99 of the flush latency (one ``flush`` call: encode + one
pipeline round trip; the append itself is a buffer write), and CPU: the server's (INFO cpu, summed over the nodes of a
cluster, and the busiest node), the writers', the whole box's.

The knee: the first step whose p99 is at least twice the lightest step's, or whose achieved rate is below 95 % of
the offered. Capacity is the step before it. The writers share the box's cores with the server, so the
server's CPU at that step is printed and the figure is also scaled to one fully used server core
(achieved tokens/s / server cores used): that is the number to compare with a real server's core.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cpu  # noqa: E402
from shared.protocol.episode.log import EpisodeLog  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect, redact  # noqa: E402

DEFAULTS = Config()
RAMP = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
QUICK_RAMP = (1, 4, 16)


# --------------------------------------------------------------------------- one writer process
class SimulatedGPU:
    """One rollout worker's batch of episodes at a fixed token rate, written through its own EpisodeLog."""

    def __init__(self, client, keys: Keys, name: str, a, rng: random.Random, start: float):
        self.keys, self.name, self.a, self.rng = keys, name, a, rng
        self.log = EpisodeLog(client, keys, worker=name, flush_tokens=a.flush_tokens, flush_ms=a.flush_ms)
        self.period = a.batch / a.gpu_tokens_per_s
        # GPUs do not step in lockstep
        self.next = start + rng.random() * self.period
        # episode id -> tokens still to generate
        self.episodes: dict[str, int] = {}
        self.opened = 0
        self.ids = [rng.randrange(150_000) for _ in range(997)]
        self.lps = [-rng.random() * 5 for _ in range(997)]
        # episodes part-way through, so they end (and new ones start) spread out
        for _ in range(a.batch):
            self.open(remaining=rng.randrange(1, a.episode_tokens + 1))

    def open(self, remaining: int) -> str:
        eid = f"{self.name}-{self.opened}"
        self.opened += 1
        self.log.open(eid)
        self.log.append(
            eid,
            "started",
            {
                "episode_id": eid,
                "group_id": eid,
                "index": 0,
                "prompt_ids": self.ids[:64],
                "sampling": {"max_tokens": self.a.episode_tokens},
                "task": {},
            },
            0,
        )
        self.episodes[eid] = remaining
        return eid

    def step(self, latencies: list | None) -> tuple[int, int]:
        """One decode step: a token for every episode, then the flushes the worker would do. (tokens, entries)."""
        entries0, done = self.log.entries_written, []
        for i, eid in enumerate(self.episodes):
            j = (self.opened + i) % len(self.ids)
            self.log.append_tokens(eid, [self.ids[j]], [self.lps[j]], 0)
            self.episodes[eid] -= 1
            if self.episodes[eid] <= 0:
                done.append(eid)
        for eid in done:
            self.log.append(eid, "finished", {"reason": "length", "reward": 1.0, "details": {}}, 0)
        # the worker's one_flush: the episodes that ended in this step, one pipeline
        if done:
            self._timed(self.log.flush, done, latencies)
        # then its maybe_flush: everything pending, once one episode is due
        if self.log.due():
            self._timed(self.log.flush, None, latencies)
        fresh = []
        for eid in done:
            self.log.close(eid)
            del self.episodes[eid]
            fresh.append(self.open(remaining=self.a.episode_tokens))
        if fresh:
            # started events are flushed at once, as open_groups does
            self._timed(self.log.flush, fresh, latencies)
        return len(self.episodes), self.log.entries_written - entries0

    @staticmethod
    def _timed(flush, ids, latencies: list | None) -> None:
        t0 = time.perf_counter()
        errors = flush(ids)
        if latencies is not None:
            latencies.append((time.perf_counter() - t0) * 1e3)
        if errors:
            raise next(iter(errors.values()))


def writer(argv: list[str]) -> None:
    """A writer process: its simulated GPUs from ``start_at`` (wall clock) for warmup + seconds; results to --out."""
    ap = argparse.ArgumentParser(prog="redis_capacity --writer")
    for name in ("redis_url", "run", "name", "out"):
        ap.add_argument(f"--{name}", required=True)
    for name in ("gpus", "batch", "episode_tokens", "flush_tokens", "seed"):
        ap.add_argument(f"--{name}", type=int, required=True)
    for name in ("gpu_tokens_per_s", "flush_ms", "start_at", "warmup", "seconds"):
        ap.add_argument(f"--{name}", type=float, required=True)
    a = ap.parse_args(argv)
    client = connect(a.redis_url, wait=10)
    keys, rng = Keys(a.run), random.Random(a.seed)
    # wall clock (start_at) -> this process's monotonic clock, which EpisodeLog's flush_ms runs on
    start = time.monotonic() + (a.start_at - time.time())
    gpus = [SimulatedGPU(client, keys, f"{a.name}g{i}", a, rng, start) for i in range(a.gpus)]
    # the started events of the first episodes, before the clock starts
    for gpu in gpus:
        gpu.log.flush_or_raise()
    w0, w1 = start + a.warmup, start + a.warmup + a.seconds
    heap = [(g.next, i) for i, g in enumerate(gpus)]
    heapq.heapify(heap)
    tokens = entries = steps = skipped = 0
    latencies: list[float] = []
    while True:
        due, i = heapq.heappop(heap)
        if due >= w1:
            break
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        measuring = due >= w0
        n_tokens, n_entries = gpus[i].step(latencies if measuring else None)
        if measuring:
            tokens, entries, steps = tokens + n_tokens, entries + n_entries, steps + 1
        nxt, now = due + gpus[i].period, time.monotonic()
        # more than a step behind: those steps are lost, not made up in a burst
        if now - nxt > gpus[i].period:
            lost = int((now - nxt) / gpus[i].period)
            skipped += lost if measuring else 0
            nxt += lost * gpus[i].period
        heapq.heappush(heap, (nxt, i))
    Path(a.out).write_text(
        json.dumps(
            {"tokens": tokens, "entries": entries, "steps": steps, "skipped": skipped, "latencies_ms": latencies}
        )
    )


# --------------------------------------------------------------------------- the ramp
def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_step(client, url: str, tmp: Path, gpus: int, a) -> dict:
    from tests.support.procs import spawn, stop, wait_until

    keys = Keys(f"cap-{uuid.uuid4().hex[:6]}-g{gpus}")
    n_writers = min(a.writers, gpus)
    share = [gpus // n_writers + (1 if i < gpus % n_writers else 0) for i in range(n_writers)]
    start_at = time.time() + a.start_delay
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("STREAMRL_")}
    env["PYTHONPATH"] = str(ROOT)
    outs = [tmp / f"{keys.run}-w{i}.json" for i in range(n_writers)]
    procs = []
    try:
        for i, n in enumerate(share):
            procs.append(
                spawn(
                    "bench.redis_capacity",
                    "--writer",
                    "--redis_url",
                    url,
                    "--run",
                    keys.run,
                    "--name",
                    f"w{i}",
                    "--out",
                    outs[i],
                    "--gpus",
                    n,
                    "--batch",
                    a.batch,
                    "--episode_tokens",
                    a.episode_tokens,
                    "--flush_tokens",
                    a.flush_tokens,
                    "--seed",
                    a.seed * 1000 + i,
                    "--gpu_tokens_per_s",
                    a.gpu_tokens_per_s,
                    "--flush_ms",
                    a.flush_ms,
                    "--start_at",
                    start_at,
                    "--warmup",
                    a.warmup,
                    "--seconds",
                    a.step_seconds,
                    env=env,
                    log=tmp / f"{keys.run}-w{i}.log",
                )
            )
        pids = [p.pid for p in procs]
        # a bench driver's pacing: the window opens
        time.sleep(max(0.0, start_at + a.warmup - time.time()))
        snap0 = cpu.snapshot(pids, client)
        time.sleep(max(0.0, start_at + a.warmup + a.step_seconds - time.time()))
        snap1 = cpu.snapshot(pids, client)
        wait_until(
            lambda: all(p.poll() is not None for p in procs),
            "the writers to finish their step",
            timeout=60 + a.step_seconds,
            poll=0.1,
        )
    finally:
        codes = stop(*procs)
    if any(codes) or not all(o.exists() for o in outs):
        logs = "\n".join((tmp / f"{keys.run}-w{i}.log").read_text()[-1500:] for i in range(n_writers))
        raise SystemExit(f"{gpus} GPUs: writer exit codes {codes}\n{logs}")
    results = [json.loads(o.read_text()) for o in outs]
    # (imports torch: the driver only, not the writers)
    from bench.rollout import delete_run

    # keep the server small between steps
    delete_run(client, keys)
    lat = [x for r in results for x in r["latencies_ms"]]
    used = cpu.cores(snap0, snap1)
    offered = gpus * a.gpu_tokens_per_s
    achieved = sum(r["tokens"] for r in results) / a.step_seconds
    return {
        "gpus": gpus,
        "writers": n_writers,
        "offered": offered,
        "achieved": achieved,
        "entries_per_s": sum(r["entries"] for r in results) / a.step_seconds,
        "flushes_per_s": len(lat) / a.step_seconds,
        "skipped_steps": sum(r["skipped"] for r in results),
        "p50_ms": quantile(lat, 0.5),
        "p99_ms": quantile(lat, 0.99),
        "max_ms": max(lat, default=float("nan")),
        "cpu_server": used["server"],
        "cpu_server_max": used["server_max"],
        "cpu_writers": used["procs"],
        "cpu_box": used["box"],
    }


def knee(rows: list[dict], tolerance: float) -> tuple[int | None, str]:
    """Index of the first step past the knee and why (None: not reached)."""
    base = rows[0]["p99_ms"]
    for i, r in enumerate(rows):
        if r["p99_ms"] >= 2 * base and i > 0:
            return i, f"p99 {r['p99_ms']:.2f} ms >= 2 x {base:.2f} ms (lightest step)"
        if r["achieved"] < tolerance * r["offered"]:
            return i, f"achieved {r['achieved']:,.0f} < {tolerance:.0%} of offered {r['offered']:,.0f} tokens/s"
    return None, ""


def header(a, where: str) -> str:
    return (
        f"SIMULATED GPUs (no model runs): one GPU = {a.batch} episodes at {a.gpu_tokens_per_s:,.0f} tokens/s, "
        f"{a.episode_tokens}-token episodes; EpisodeLog flush_tokens {a.flush_tokens}, flush_ms {a.flush_ms:g}; "
        f"server: {where}; {a.writers} writer processes max"
    )


def render(rows: list[dict], a) -> str:
    out = [
        f"{'GPUs':>4} {'offered tok/s':>13} {'achieved':>9} {'%':>4} | {'entries/s':>9} {'tok/entry':>9} "
        f"{'flushes/s':>9} | {'flush p50 ms':>12} {'p99 ms':>7} {'max ms':>7} | {'CPU cores: server':>17} "
        f"{'busiest':>7} {'writers':>7} {'other':>5} {'box':>5} | {'server us/token':>15} | skipped steps"
    ]
    for r in rows:
        out.append(
            f"{r['gpus']:>4} {r['offered']:>13,.0f} {r['achieved']:>9,.0f} "
            f"{r['achieved'] / r['offered']:>4.0%} | "
            f"{r['entries_per_s']:>9,.0f} {r['achieved'] / max(r['entries_per_s'], 1e-9):>9.1f} "
            f"{r['flushes_per_s']:>9,.0f} | {r['p50_ms']:>12.2f} {r['p99_ms']:>7.2f} {r['max_ms']:>7.1f} | "
            f"{r['cpu_server']:>17.2f} {r['cpu_server_max']:>7.2f} {r['cpu_writers']:>7.2f} "
            f"{r['cpu_box'] - r['cpu_server'] - r['cpu_writers']:>5.2f} {r['cpu_box']:>5.2f} | "
            f"{r['cpu_server'] * 1e6 / max(r['achieved'], 1e-9):>15.1f} | {r['skipped_steps']}"
        )
    return "\n".join(out)


def conclude(rows: list[dict], a) -> str:
    i, why = knee(rows, a.tolerance)
    if i == 0:
        return f"the lightest step is already past the knee ({why}): lower the load"
    last = rows[-1] if i is None else rows[i - 1]
    gpus = last["achieved"] / a.gpu_tokens_per_s
    per_core = last["achieved"] / last["cpu_server_max"] if last["cpu_server_max"] > 0 else float("nan")
    lines = [
        (
            "knee not reached within the ramp (capacity is at least the last step)"
            if i is None
            else f"knee at {rows[i]['gpus']} GPUs: {why}"
        ),
        f"capacity: {last['achieved']:,.0f} tokens/s achieved at {last['gpus']} simulated GPUs = {gpus:.0f} GPUs "
        f"of rollout at {a.gpu_tokens_per_s:,.0f} tokens/s per GPU; the server used {last['cpu_server']:.2f} "
        f"cores there (busiest node {last['cpu_server_max']:.2f}), the writers {last['cpu_writers']:.2f}, the "
        f"box {last['cpu_box']:.2f} of {os.cpu_count()}",
        f"scaled to one fully used server core (busiest node): {per_core:,.0f} tokens/s = "
        f"{per_core / a.gpu_tokens_per_s:.0f} GPUs per node (Redis runs commands on one thread)",
    ]
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", default="", help="the Redis to measure (default: an embedded one in a temp dir)")
    p.add_argument("--gpus", default="", help=f"the ramp: simulated GPUs per step (default {','.join(map(str, RAMP))})")
    p.add_argument("--writers", type=int, default=4, help="writer processes the GPUs are spread over")
    p.add_argument("--batch", type=int, default=64, help="episodes one simulated GPU decodes together")
    p.add_argument("--gpu-tokens-per-s", type=float, default=5000.0, help="tokens/s of one simulated GPU")
    p.add_argument("--episode-tokens", type=int, default=1024, help="tokens of one episode")
    p.add_argument("--flush-tokens", type=int, default=DEFAULTS.flush_tokens, help="EpisodeLog flush_tokens")
    p.add_argument("--flush-ms", type=float, default=DEFAULTS.flush_ms, help="EpisodeLog flush_ms")
    p.add_argument("--step-seconds", type=float, default=8.0, help="measured window per step")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds each step runs before its window")
    p.add_argument("--start-delay", type=float, default=2.5, help="seconds the writers get to start and connect")
    p.add_argument("--tolerance", type=float, default=0.95, help="achieved below this share of offered is the knee")
    p.add_argument("--past-knee", type=int, default=1, help="steps still run after the knee (0: stop there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"ramp {QUICK_RAMP} unless --gpus, 4 s windows (a smoke run)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        a.ramp = [int(x) for x in (a.gpus or ",".join(map(str, QUICK_RAMP if a.quick else RAMP))).split(",")]
    except ValueError:
        p.error(f"--gpus: expected comma-separated positive integers, got {a.gpus!r}")
    if not a.ramp or any(g < 1 for g in a.ramp) or a.ramp != sorted(set(a.ramp)):
        p.error(f"--gpus: expected increasing positive integers, got {a.gpus!r}")
    for name in ("writers", "batch", "episode_tokens", "flush_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(a, name)}")
    for name in ("gpu_tokens_per_s", "step_seconds", "flush_ms", "start_delay"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: expected > 0, got {getattr(a, name)}")
    if a.warmup < 0 or a.past_knee < 0:
        p.error(f"--warmup and --past-knee: expected >= 0, got {a.warmup}, {a.past_knee}")
    if not 0 < a.tolerance <= 1:
        p.error(f"--tolerance: expected a share in (0, 1], got {a.tolerance}")
    if a.redis_url and "://" not in a.redis_url:
        p.error(f"--redis-url: expected a URL such as redis://[:password@]host:port/0, got {a.redis_url!r}")
    if a.quick:
        a.step_seconds, a.warmup = 4.0, 1.0
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--writer"]:
        writer(argv[1:])
        return 0
    a = parse_args(argv)
    from services.ops.launch.redis_server import EmbeddedRedis

    t_start = time.monotonic()
    print(f"load average at start: {cpu.load_average()}", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="streamrl-capacity-") as tmp_name:
        tmp = Path(tmp_name)
        server = None if a.redis_url else EmbeddedRedis(tmp / "redis").start()
        url = a.redis_url or server.url
        try:
            client = connect(url, wait=10)
            # a cluster client asks one node
            info = client.info("server")
            version = f"{info.get('server_name', 'redis')} {info.get('valkey_version') or info.get('redis_version')}"
            where = (
                f"a cluster of {len(client.get_primaries())} primaries ({version}) at {redact(url)}"
                if hasattr(client, "get_primaries")
                else f"{'embedded ' if server else ''}{version} at {redact(url)}"
            )
            print(header(a, where), flush=True)
            print(render([], a), flush=True)
            for gpus in a.ramp:
                r = run_step(client, url, tmp, gpus, a)
                rows.append(r)
                print(render([r], a).splitlines()[1], flush=True)
                i, _ = knee(rows, a.tolerance)
                if i is not None and len(rows) - 1 - i >= a.past_knee:
                    break
            client.close()
        finally:
            if server:
                server.stop()
    print()
    print(header(a, where))
    print(render(rows, a))
    print(conclude(rows, a))
    print(f"load average at end: {cpu.load_average()}; total {time.monotonic() - t_start:.0f} s")
    if a.json:
        print(json.dumps(rows, indent=1))
    i, _ = knee(rows, a.tolerance)
    if i != 0 and not a.redis_url:
        from bench.record import record

        last = rows[-1] if i is None else rows[i - 1]
        per_core = last["achieved"] / last["cpu_server_max"] if last["cpu_server_max"] > 0 else float("nan")
        record(
            "redis_capacity",
            [
                {
                    "what": "event-log token writes one Redis node absorbs, as GPUs of rollout at "
                    f"{a.gpu_tokens_per_s:,.0f} tokens/s, batch {a.batch}",
                    "value": f"{per_core / a.gpu_tokens_per_s:.0f} GPUs per fully used server core "
                    f"({last['cpu_server_max'] * 1e6 / last['achieved']:.1f} us of server CPU per token; "
                    f"this box held {last['gpus']} at {last['achieved']:,.0f} tokens/s)",
                }
            ],
            ["shared/protocol", "bench/redis_capacity.py"],
            quick=a.quick,
            simulated=f"no model runs: one GPU = {a.batch} episodes at {a.gpu_tokens_per_s:,.0f} tokens/s",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

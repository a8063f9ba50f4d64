"""Rollout scaling: 1, 2, 4 and 8 rollout worker processes against one embedded Redis, each engine a
SIMULATED memory-bound GPU.

    # 1,2,4,8 workers x 2 interleaved repeats (~8 min)
    PYTHONPATH=. python bench/rollout/rollout_scaling.py
    PYTHONPATH=. python bench/rollout/rollout_scaling.py --quick          # 1,2 workers, short windows (~1.5 min)
    PYTHONPATH=. python bench/rollout/rollout_scaling.py --workers 1,4 --repeats 3 --seconds 30 --step-delay-ms 50

SIMULATED GPU: every worker is a real ``python -m services.rollout`` process (the Procfile's), with the config key
``step_delay_ms`` set, so its engine sleeps that long after every step (services/rollout/engine/slow.py). A
memory-bound GPU decode step costs about the same whatever the batch; the sleep stands in for it. The engine still
runs the tiny random-init model's forward and sampling on the CPU (about 8 ms of CPU per step of ~48 sequences:
bench/rollout/worker_step.py breaks a step down), and everything else is the real worker: claiming, the fenced event log
at the default flush settings, rewards, publishing, heartbeats.

Rollout only, no trainer and no syncer: the question is how rollout throughput scales with workers, and on a 2-core
box a trainer would take CPU from the workers and, through the staleness gate, tie their throughput to its own speed.
With no syncer the gate is never opened, which in async mode lets every worker claim as many groups as it has room
for (shared/protocol/gate.py). The bench keeps the prompts queue topped up (a consumer-group lag of at least
``4 x max_groups_in_flight x workers`` groups) so no worker starves; the smallest lag seen is printed.

Each variant: spawn the workers (tests/support/procs.py), wait for every heartbeat, enqueue, let them run
``--warmup`` s, then measure ``--seconds``: samples (finished episodes, in published groups) whose group was
published in the window, by the samples stream's own entry ids, and the generated tokens of those episodes (their
streams, folded). CPU over the window: the workers' (from /proc), the Redis server's (INFO cpu), and the whole box's,
so a reader sees when the box, not the design, limits scaling ("other" is the box minus workers and server: this
bench's own driver and anything else running). Variants are interleaved (1 2 4 8, then 8 4 2 1, ...); figures are
medians."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.harness import cpu  # noqa: E402
from bench.rollout.rollout import delete_run  # noqa: E402
from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from shared.protocol.episode import events  # noqa: E402
from shared.protocol.episode.fold import fold  # noqa: E402
from shared.protocol.keys import ROLLOUT_GROUP, Keys  # noqa: E402
from shared.protocol.streams import samples  # noqa: E402
from shared.protocol.streams.prompts import PromptGroup, enqueue  # noqa: E402
from shared.runtime.config.keys import Config  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402
from tests.support.procs import spawn, stop, wait_until  # noqa: E402

DEFAULTS = Config()


def header(args) -> str:
    return (
        f"SIMULATED GPU (not measured hardware): every engine step sleeps {args.step_delay_ms:g} ms "
        f"(step_delay_ms, engine/slow.py) on top of the tiny model's CPU forward; rollout only (no trainer)"
    )


def groups(tag: str, start: int, n: int, size: int) -> list[PromptGroup]:
    out = []
    for i in range(start, start + n):
        a, b = i % 50, (7 * i) % 50
        out.append(PromptGroup(f"{tag}-{i:06d}", size, prompt=f"{a}+{b}=", task={"answer": str(a + b)}))
    return out


def lag(client, keys: Keys) -> int:
    """Prompt groups enqueued and not yet delivered to any worker."""
    for g in client.xinfo_groups(keys.prompts):
        if g["name"] in (ROLLOUT_GROUP, ROLLOUT_GROUP.encode()):
            return int(g.get("lag") or 0)
    return client.xlen(keys.prompts)


def window_counts(client, keys: Keys, t0_ms: int, t1_ms: int) -> dict:
    """Groups published in [t0_ms, t1_ms] (the samples stream's entry ids are the server's clock), their
    episodes and the tokens those episodes generated."""
    entries, _ = samples.decode_all(client.xrange(keys.samples, str(t0_ms), str(t1_ms)))
    episodes, per_worker = [], {}
    for sample in entries:
        episodes += sample.episodes
        per_worker[sample.worker] = per_worker.get(sample.worker, 0) + len(sample.episodes)
    tokens = token_entries = 0
    for i in range(0, len(episodes), 500):
        pipe = client.pipeline(transaction=False)
        for e in episodes[i : i + 500]:
            pipe.xrange(keys.episode(e))
        for stream in pipe.execute():
            tokens += len(fold(stream).tokens)
            token_entries += sum(1 for entry_id, f in stream if events.decode(entry_id, f).kind == "tokens")
    return {
        "groups": len(entries),
        "samples": len(episodes),
        "tokens": tokens,
        "token_entries": token_entries,
        "per_worker": per_worker,
    }


def measure(client, url: str, tmp: Path, model_dir: str, k: int, rep: int, args) -> dict:
    keys = Keys(f"scale-{uuid.uuid4().hex[:6]}-k{k}-r{rep}")
    env = {key: v for key, v in os.environ.items() if key != "REDIS_URL" and not key.startswith("STREAMRL_")}
    # one torch thread per worker, as `streamrl run` sets
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    ids = [f"w{i}" for i in range(k)]
    workers = []
    try:
        for wid in ids:
            workers.append(
                spawn(
                    "services.rollout",
                    "--run",
                    keys.run,
                    "--redis-url",
                    url,
                    "--run-dir",
                    tmp / "runs",
                    "--model-dir",
                    model_dir,
                    "--tools",
                    "",
                    "--step-delay-ms",
                    args.step_delay_ms,
                    "--max-tokens",
                    args.max_tokens,
                    "--log-level",
                    "warning",
                    "--worker-id",
                    wid,
                    env=env,
                    log=tmp / f"{keys.run}-{wid}.log",
                )
            )
        t_spawn = time.monotonic()
        wait_until(
            lambda: all(client.exists(keys.alive("rollout", w)) for w in ids),
            f"{k} workers' heartbeats",
            timeout=300,
            procs=workers,
            poll=0.2,
        )
        startup = time.monotonic() - t_spawn
        target = 4 * DEFAULTS.max_groups_in_flight * k
        queued = 2 * target
        enqueue(client, keys, groups(keys.run, 0, queued, DEFAULTS.group_size))
        t_enq, min_lag = time.monotonic(), None

        def top_up(until: float, track: bool) -> None:
            nonlocal queued, min_lag
            while time.monotonic() < until:
                left = lag(client, keys)
                if track:
                    min_lag = left if min_lag is None else min(min_lag, left)
                if left < target:
                    enqueue(client, keys, groups(keys.run, queued, 2 * target - left, DEFAULTS.group_size))
                    queued += 2 * target - left
                for w in workers:
                    if w.poll() is not None:
                        raise SystemExit(
                            f"{k} workers, repeat {rep}: worker exited {w.returncode} mid-window; "
                            f"see {tmp / keys.run}-*.log"
                        )
                # a bench driver's pacing, not synchronisation
                time.sleep(0.25)

        top_up(t_enq + args.warmup, track=False)
        a, t0_ms = cpu.snapshot([w.pid for w in workers], client), int(time.time() * 1000)
        top_up(time.monotonic() + args.seconds, track=True)
        b, t1_ms = cpu.snapshot([w.pid for w in workers], client), int(time.time() * 1000)
    finally:
        codes = stop(*workers)
    if any(codes):
        raise SystemExit(f"{k} workers, repeat {rep}: worker exit codes {codes}; see {tmp / keys.run}-*.log")
    counts = window_counts(client, keys, t0_ms, t1_ms)
    seconds = (t1_ms - t0_ms) / 1000
    used = cpu.cores(a, b)
    per_worker = [counts["per_worker"].get(w, 0) / seconds for w in ids]
    # keep the server small between variants
    delete_run(client, keys)
    return {
        "workers": k,
        "rep": rep,
        "seconds": seconds,
        "startup_s": startup,
        "groups": counts["groups"],
        "samples": counts["samples"],
        "tokens": counts["tokens"],
        "samples_per_s": counts["samples"] / seconds,
        "tokens_per_s": counts["tokens"] / seconds,
        "tokens_per_entry": counts["tokens"] / max(1, counts["token_entries"]),
        "per_worker_samples_per_s": per_worker,
        "min_lag": min_lag,
        "cpu_workers": used["procs"],
        "cpu_server": used["server"],
        "cpu_box": used["box"],
        "cpu_other": used["box"] - used["procs"] - used["server"],
    }


def summarize(runs: list[dict], ks: list[int]) -> list[dict]:
    rows = []
    for k in ks:
        rs = [r for r in runs if r["workers"] == k]
        row = {"workers": k, "reps": len(rs)}
        for key in (
            "samples_per_s",
            "tokens_per_s",
            "tokens_per_entry",
            "cpu_workers",
            "cpu_server",
            "cpu_box",
            "cpu_other",
            "startup_s",
        ):
            row[key] = statistics.median(r[key] for r in rs)
        row["all_samples_per_s"] = [round(r["samples_per_s"], 1) for r in rs]
        row["per_worker_min"] = min(min(r["per_worker_samples_per_s"]) for r in rs)
        row["per_worker_max"] = max(max(r["per_worker_samples_per_s"]) for r in rs)
        row["min_lag"] = min(r["min_lag"] for r in rs)
        rows.append(row)
    # per-worker rate of the smallest variant
    base = rows[0]["samples_per_s"] / rows[0]["workers"]
    for row in rows:
        row["speedup"] = row["samples_per_s"] / rows[0]["samples_per_s"] * rows[0]["workers"]
        row["efficiency"] = row["samples_per_s"] / (base * row["workers"])
    return rows


def render(rows: list[dict], args, ncpu: int) -> str:
    out = [
        header(args),
        f"max_tokens {args.max_tokens}, group_size {DEFAULTS.group_size}, max_groups_in_flight "
        f"{DEFAULTS.max_groups_in_flight}, max_batch_size {DEFAULTS.max_batch_size}, flush_tokens "
        f"{DEFAULTS.flush_tokens}, flush_ms {DEFAULTS.flush_ms:g} (defaults); {args.seconds:g} s windows after "
        f"{args.warmup:g} s warm-up; median of {rows[0]['reps']} interleaved repeats; box: {ncpu} CPUs",
        f"{'workers':>7} {'samples/s':>9} {'tokens/s':>9} {'speedup':>7} {'effic.':>6} | "
        f"{'per worker min-max':>18} | {'CPU cores: workers':>18} {'redis':>5} {'other':>5} {'box':>5} | "
        f"{'CPU us/token: workers':>21} {'redis':>5} | {'tok/entry':>9} | "
        f"{'min lag':>7} | samples/s per repeat",
    ]
    for r in rows:
        out.append(
            f"{r['workers']:>7} {r['samples_per_s']:>9.1f} {r['tokens_per_s']:>9,.0f} {r['speedup']:>6.2f}x "
            f"{r['efficiency']:>5.0%} | {r['per_worker_min']:>8.1f}-{r['per_worker_max']:<9.1f} | "
            f"{r['cpu_workers']:>18.2f} {r['cpu_server']:>5.2f} {r['cpu_other']:>5.2f} {r['cpu_box']:>5.2f} | "
            f"{r['cpu_workers'] * 1e6 / r['tokens_per_s']:>21.0f} "
            f"{r['cpu_server'] * 1e6 / r['tokens_per_s']:>5.0f} | {r['tokens_per_entry']:>9.1f} | "
            f"{r['min_lag']:>7} | {', '.join(str(x) for x in r['all_samples_per_s'])}"
        )
    return "\n".join(out)


def plot(rows: list[dict], args, path: Path, ncpu: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["workers"] for r in rows]
    base = rows[0]["samples_per_s"] / rows[0]["workers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.2))
    ax1.plot(ks, [r["samples_per_s"] for r in rows], "o-", label="measured")
    ax1.plot(ks, [base * k for k in ks], "--", color="grey", label="linear (from the smallest variant)")
    ax1.set(xlabel="rollout workers", ylabel="samples/s", xticks=ks, title="Throughput")
    ax1.legend()
    ax2.plot(ks, [r["cpu_workers"] for r in rows], "o-", label="workers")
    ax2.plot(ks, [r["cpu_server"] for r in rows], "s-", label="Redis server")
    ax2.plot(ks, [r["cpu_other"] for r in rows], "x-", label="everything else on the box")
    ax2.plot(ks, [r["cpu_box"] for r in rows], "^-", label="whole box")
    ax2.axhline(ncpu, color="red", ls=":", label=f"{ncpu} cores")
    ax2.set(xlabel="rollout workers", ylabel="CPU cores used", xticks=ks, title="CPU over the window")
    ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(header(args), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="", help="worker counts to compare, comma-separated (default 1,2,4,8)")
    p.add_argument("--repeats", type=int, default=2, help="windows per worker count, interleaved")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per variant")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds the workers run before the window")
    p.add_argument("--step-delay-ms", type=float, default=20.0, help="SIMULATED GPU cost of one engine step (sleep)")
    p.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens, help="generated tokens per episode")
    p.add_argument("--plot", default=str(ROOT / "bench" / "rollout_scaling.png"), help="PNG to write ('' for none)")
    p.add_argument(
        "--quick", action="store_true", help="workers 1,2 unless --workers, one repeat, 8 s windows (a smoke run)"
    )
    p.add_argument("--json", action="store_true", help="also print every window as JSON")
    args = p.parse_args(argv)
    try:
        args.ks = [int(x) for x in (args.workers or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    except ValueError:
        p.error(f"--workers: expected comma-separated positive integers, got {args.workers!r}")
    if not args.ks or any(k < 1 for k in args.ks) or len(set(args.ks)) != len(args.ks):
        p.error(f"--workers: expected distinct positive integers, got {args.workers!r}")
    for name in ("repeats", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    for name in ("seconds", "step_delay_ms"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: expected > 0, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup: expected >= 0, got {args.warmup}")
    if args.plot and not Path(args.plot).parent.is_dir():
        p.error(f"--plot: folder {Path(args.plot).parent} does not exist")
    if args.quick:
        args.repeats, args.seconds, args.warmup = 1, 8.0, 3.0
    args.ks.sort()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ncpu = os.cpu_count() or 1
    print(header(args), flush=True)
    print(f"load average at start: {cpu.load_average()}", flush=True)
    t_start, runs = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="streamrl-scale-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_tiny_model(tmp / "tiny")
        server = EmbeddedRedis(tmp / "redis").start()
        try:
            client = connect(server.url)
            for rep in range(args.repeats):
                for k in args.ks if rep % 2 == 0 else list(reversed(args.ks)):
                    r = measure(client, server.url, tmp, model_dir, k, rep, args)
                    runs.append(r)
                    print(
                        f"  {k} workers, repeat {rep + 1}: {r['samples_per_s']:.1f} samples/s, "
                        f"{r['tokens_per_s']:,.0f} tokens/s, CPU cores workers {r['cpu_workers']:.2f} redis "
                        f"{r['cpu_server']:.2f} box {r['cpu_box']:.2f} (startup {r['startup_s']:.0f} s, "
                        f"min lag {r['min_lag']})",
                        flush=True,
                    )
            client.close()
        finally:
            server.stop()
    rows = summarize(runs, args.ks)
    print()
    print(render(rows, args, ncpu))
    print(f"load average at end: {cpu.load_average()}; total {time.monotonic() - t_start:.0f} s")
    if args.plot:
        plot(rows, args, Path(args.plot), ncpu)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"rows": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

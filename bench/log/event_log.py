"""Event-log benchmark: the fenced EpisodeLog writer and replay vs raw Redis stream ops.

    python bench/log/event_log.py [--quick] [--json]

Starts its own EmbeddedRedis (valkey-server, AOF everysec) in a temp dir and stops it.
Every figure is a ratio of two variants measured in the same run, interleaved
(A B, then B A, ...), and reported as the median over repetitions.

1. Write throughput, 1/16/64-token chunks: E episodes written concurrently in rounds;
   each round appends one chunk per episode and flushes once (one pipeline).
     A = EpisodeLog.append_tokens + EpisodeLog.flush (Lua fence script per episode)
     B = raw pipelined XADD of the same encode()d fields (no Lua), encode() timed too
   Also reported: server-side usec per entry from INFO commandstats
   (EVALSHA for A, which includes its fence check, an XLEN per episode, and the XADDs; XADD for B).

2. Replay of one 4,096-token episode stored as 1/16/64-token entries:
     A = EpisodeLog.replay (XRANGE + fold: decode every entry, rebuild the Episode)
     B = raw XRANGE of the same stream alone
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.ops.launch.redis_server import EmbeddedRedis  # noqa: E402
from shared.protocol.episode.events import Event, encode  # noqa: E402
from shared.protocol.episode.log import EpisodeLog  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

CHUNKS = (1, 16, 64)
REPLAY_TOKENS = 4096
WORKER = "bench-worker"


def chunk_data(rng: random.Random, n: int) -> tuple[list[int], list[float]]:
    return [rng.randrange(150_000) for _ in range(n)], [-rng.random() * 5 for _ in range(n)]


def reset_stats(client) -> None:
    client.config_resetstat()


def server_usec(client, command: str) -> tuple[int, int]:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


# --------------------------------------------------------------------------- write
def write_episodelog(client, keys: Keys, tag: str, n_eps: int, rounds: int, ids, lps) -> dict:
    # as the rollout worker writes its plain episodes (no end guard: shared/protocol/episode/log.py)
    log = EpisodeLog(client, keys, worker=WORKER, flush_tokens=10**9, flush_ms=1e12, guard_end=False)
    eps = [f"{tag}-{i}" for i in range(n_eps)]
    for e in eps:
        log.open(e)
    reset_stats(client)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for e in eps:
            log.append_tokens(e, ids, lps, 0)
        errors = log.flush()
        if errors:
            raise next(iter(errors.values()))
    dt = time.perf_counter() - t0
    calls, usec = server_usec(client, "evalsha")
    extra_calls, extra_usec = server_usec(client, "script|exists")
    # the fence check inside the script, included in EVALSHA's usec
    _, fence_usec = server_usec(client, "xlen")
    _, xadd_usec = server_usec(client, "xadd")
    entries = n_eps * rounds
    assert log.entries_written == entries, (log.entries_written, entries)
    client.delete(*[keys.episode(e) for e in eps])
    return {
        "s": dt,
        "entries": entries,
        "srv_usec": usec,
        "srv_calls": calls,
        "srv_fence_usec": fence_usec,
        "srv_xadd_usec": xadd_usec,
        "script_exists_calls": extra_calls,
        "script_exists_usec": extra_usec,
    }


def write_raw(client, keys: Keys, tag: str, n_eps: int, rounds: int, ids, lps) -> dict:
    stream_keys = [keys.episode(f"{tag}-{i}") for i in range(n_eps)]
    reset_stats(client)
    t0 = time.perf_counter()
    for seq in range(rounds):
        pipe = client.pipeline(transaction=False)
        for key in stream_keys:
            # same work the writer does per event: build the Event, copy the chunk, encode()
            ev = Event(kind="tokens", policy=0, worker=WORKER, seq=seq, data={"ids": list(ids), "logprobs": list(lps)})
            pipe.xadd(key, encode(ev))
        pipe.execute()
    dt = time.perf_counter() - t0
    calls, usec = server_usec(client, "xadd")
    entries = n_eps * rounds
    assert calls == entries, (calls, entries)
    assert sum(client.xlen(k) for k in stream_keys) == entries
    client.delete(*stream_keys)
    return {"s": dt, "entries": entries, "srv_usec": usec, "srv_calls": calls}


def bench_write(client, keys: Keys, chunk: int, n_eps: int, rounds: int, reps: int, rng) -> dict:
    ids, lps = chunk_data(rng, chunk)
    variants = {"episodelog": write_episodelog, "raw": write_raw}
    # warm-up (loads the script, allocates), not timed
    for name, fn in variants.items():
        fn(client, keys, f"warm-{name}-{chunk}", n_eps, max(2, rounds // 10), ids, lps)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            runs[name].append(variants[name](client, keys, f"w{chunk}-{name}-{rep}", n_eps, rounds, ids, lps))

    def summary(rs: list[dict]) -> dict:
        eps_rate = statistics.median(r["entries"] / r["s"] for r in rs)
        return {
            "entries_per_s": eps_rate,
            "tokens_per_s": eps_rate * chunk,
            "ms_per_flush": statistics.median(r["s"] / rounds for r in rs) * 1e3,
            "srv_usec_per_entry": statistics.median(r["srv_usec"] / r["entries"] for r in rs),
            "all_entries_per_s": [round(r["entries"] / r["s"]) for r in rs],
        }

    el, raw = summary(runs["episodelog"]), summary(runs["raw"])
    for part in ("fence", "xadd"):
        el[f"srv_{part}_usec_per_entry"] = statistics.median(
            r[f"srv_{part}_usec"] / r["entries"] for r in runs["episodelog"]
        )
    ratios = [b["s"] / a["s"] for a, b in zip(runs["episodelog"], runs["raw"])]
    return {
        "chunk": chunk,
        "episodes": n_eps,
        "rounds": rounds,
        "reps": reps,
        "episodelog": el,
        "raw": raw,
        "ratio": el["entries_per_s"] / raw["entries_per_s"],
        "ratio_median_of_pairs": statistics.median(ratios),
        "script_exists_per_flush": runs["episodelog"][0]["script_exists_calls"] / rounds,
    }


# --------------------------------------------------------------------------- replay
def store_episode(client, keys: Keys, episode_id: str, chunk: int, rng) -> int:
    """One finished 4,096-token episode as `started`, 4096/chunk `tokens` events, `finished`."""
    key = keys.episode(episode_id)
    prompt, _ = chunk_data(rng, 64)
    events = [
        Event(
            "started",
            0,
            WORKER,
            0,
            {
                "episode_id": episode_id,
                "group_id": "g0",
                "index": 0,
                "prompt_ids": prompt,
                "sampling": {"max_tokens": REPLAY_TOKENS},
                "task": {},
            },
        )
    ]
    for i in range(REPLAY_TOKENS // chunk):
        ids, lps = chunk_data(rng, chunk)
        events.append(Event("tokens", 0, WORKER, len(events), {"ids": ids, "logprobs": lps}))
    events.append(Event("finished", 0, WORKER, len(events), {"reason": "length", "reward": 1.0, "details": {}}))
    pipe = client.pipeline(transaction=False)
    for ev in events:
        pipe.xadd(key, encode(ev))
    pipe.execute()
    return len(events)


def bench_replay(client, keys: Keys, chunk: int, reps: int, rng) -> dict:
    episode_id = f"replay-{chunk}"
    n_entries = store_episode(client, keys, episode_id, chunk, rng)
    log = EpisodeLog(client, keys, worker="reader")
    key = keys.episode(episode_id)
    # warm-up + correctness
    ep = log.replay(episode_id)
    assert len(ep.tokens) == REPLAY_TOKENS and ep.status == "finished", (len(ep.tokens), ep.status)
    assert len(client.xrange(key)) == n_entries

    def replay() -> None:
        log.replay(episode_id)

    def xrange() -> None:
        client.xrange(key)

    variants = {"replay": replay, "xrange": xrange}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    client.delete(key)
    rp, xr = statistics.median(times["replay"]), statistics.median(times["xrange"])
    return {
        "chunk": chunk,
        "entries": n_entries,
        "reps": reps,
        "replay_ms": rp * 1e3,
        "xrange_ms": xr * 1e3,
        "ratio": rp / xr,
        "fold_us_per_entry": (rp - xr) * 1e6 / n_entries,
        "replay_ms_p10_p90": [q * 1e3 for q in _p10_p90(times["replay"])],
        "xrange_ms_p10_p90": [q * 1e3 for q in _p10_p90(times["xrange"])],
    }


def _p10_p90(xs: list[float]) -> tuple[float, float]:
    qs = statistics.quantiles(xs, n=10)
    return qs[0], qs[-1]


# --------------------------------------------------------------------------- report
def render(result: dict) -> str:
    w = result["write"]
    out = [
        f"Write: {w[0]['episodes']} episodes x {w[0]['rounds']} rounds, one flush (pipeline) per round; "
        f"median of {w[0]['reps']} interleaved reps",
        f"{'chunk':>5} | {'EpisodeLog ent/s':>16} {'raw ent/s':>10} | {'EpisodeLog tok/s':>16} {'raw tok/s':>10} | "
        f"{'EL/raw':>6} | {'ms/flush EL':>11} {'raw':>5} | {'server us/entry EL (XLEN+XADD)     ':>35} {'raw':>5}",
    ]
    for r in w:
        el, raw = r["episodelog"], r["raw"]
        out.append(
            f"{r['chunk']:>5} | {el['entries_per_s']:>16,.0f} {raw['entries_per_s']:>10,.0f} | "
            f"{el['tokens_per_s']:>16,.0f} {raw['tokens_per_s']:>10,.0f} | {r['ratio']:>6.2f} | "
            f"{el['ms_per_flush']:>11.2f} {raw['ms_per_flush']:>5.2f} | "
            f"{el['srv_usec_per_entry']:>14.1f} ({el['srv_fence_usec_per_entry']:.1f} + "
            f"{el['srv_xadd_usec_per_entry']:.1f}){'':>11} {raw['srv_usec_per_entry']:>5.1f}"
        )
    out.append(
        f"(EpisodeLog flush = {w[0]['script_exists_per_flush']:.0f} SCRIPT EXISTS round trip "
        "(redis-py pipeline) + 1 pipeline holding one EVALSHA for all its episodes; raw = 1 pipeline of XADD)"
    )
    rp = result["replay"]
    out += [
        "",
        f"Replay: one {REPLAY_TOKENS}-token episode (+ started, finished); median of {rp[0]['reps']} interleaved reps",
        f"{'chunk':>5} | {'entries':>7} | {'replay ms':>9} {'XRANGE ms':>9} | {'ratio':>5} | {'fold us/entry':>13}",
    ]
    for r in rp:
        out.append(
            f"{r['chunk']:>5} | {r['entries']:>7} | {r['replay_ms']:>9.2f} {r['xrange_ms']:>9.2f} | "
            f"{r['ratio']:>5.1f} | {r['fold_us_per_entry']:>13.1f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and repetitions (~15 s)")
    ap.add_argument("--json", action="store_true", help="also print the full results as JSON")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rounds, write_reps, replay_reps = (40, 4, 15) if args.quick else (150, 10, 50)

    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-") as tmp:
        server = EmbeddedRedis(tmp).start()
        try:
            client = connect(server.url, wait=10)
            info = client.info("server")
            keys = Keys("bench")
            write = [bench_write(client, keys, c, args.episodes, rounds, write_reps, rng) for c in CHUNKS]
            replay = [bench_replay(client, keys, c, replay_reps, rng) for c in CHUNKS]
            client.close()
        finally:
            server.stop()
    import redis

    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python parser"
    result = {
        "server": f"{info.get('server_name', 'redis')} {info.get('valkey_version', info.get('redis_version'))}",
        "client": f"redis-py {redis.__version__} ({parser})",
        "python": sys.version.split()[0],
        "quick": args.quick,
        "write": write,
        "replay": replay,
        "elapsed_s": time.perf_counter() - t_start,
    }
    print(f"{result['server']}, {result['client']}, Python {result['python']}{' (--quick)' if args.quick else ''}")
    print(render(result))
    print(f"\n(total {result['elapsed_s']:.1f} s)")
    if args.json:
        print(json.dumps(result, indent=1))
    from bench.harness.record import record

    w16 = next(w for w in write if w["chunk"] == 16)
    r16 = next(r for r in replay if r["chunk"] == 16)
    record(
        "event_log",
        [
            {
                "what": "fenced EpisodeLog appends vs raw pipelined XADD (16-token entries, 64 episodes)",
                "value": f"{w16['ratio']:.2f}x the entries/s ({w16['episodelog']['entries_per_s']:,.0f} vs "
                f"{w16['raw']['entries_per_s']:,.0f})",
            },
            {
                "what": "replay (XRANGE + fold) of a 4,096-token episode in 16-token entries",
                "value": f"{r16['replay_ms']:.1f} ms (XRANGE alone {r16['xrange_ms']:.1f} ms)",
            },
        ],
        ["shared/protocol", "bench/log/event_log.py"],
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

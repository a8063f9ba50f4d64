"""Routing replay (R3) on the tiny Qwen3-MoE default model (``streamrl make-model --moe qwen3``): how often a stale
sample's logged route differs from the trainer's own, what replay does to the importance ratio and the mismatch KL,
whether it changes learning, and what the routes cost in the episode log. In one process, no pipeline
(bench/moe/replay_cell.py), plus the bytes (bench/moe/route_bytes.py) and optionally a real end-to-end pair
(bench/moe/e2e.py).

Per seed and mode (routing replay on / off; rollout engine fp32 / bf16, the trainer always fp32) one offline run of
``--steps`` versions at staleness exactly ``--eta``: batches sampled by the torch engine at version v − η with
routes logged, trained with the trainer's own build_batch + train_on_batch. Every ``--probe-every`` versions a probe
of each η in {0, 1, 2, 4, 8}: a batch sampled at v − η, measured by a step of learning rate 0 with replay on (the
step's ``route_mismatch``: the share of sampled tokens whose router, left to itself, would choose other experts in
at least one layer; mismatch KL and IS weights) and with replay off (mismatch KL and IS weights). With replay and an
fp32 engine, fresh tokens' (η = 0) IS weight must be 1 within 1e-5: asserted.

    python bench/moe/routing.py                                  # everything but the end-to-end pair (~10 min)
    python bench/moe/routing.py --e2e                            # and the pair (2 x 2 min runs, one after the other)
    python bench/moe/routing.py --e2e --e2e-versions 1000        # the pair to equal versions (~7 min more)
    python bench/moe/routing.py --seeds 1 --steps 20 --no-bf16 --no-record   # a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.learning.staleness import mean_se  # noqa: E402
from bench.learning.staleness_cell import Setup  # noqa: E402
from bench.moe.replay_cell import PROBE_ETAS, Replay, make_moe_model, run_cell, task_pool  # noqa: E402
from shared.runtime.moe.shape import route_shape_of  # noqa: E402

# fresh tokens' |log IS ratio| with replay and an fp32 engine: 1 within this
FRESH_TOLERANCE = 1e-5


def all_problems() -> list[dict]:
    """The 100 distinct problems of the built-in arithmetic task (all of them trained on: it has no held-out part)."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def fmt(m_se: tuple[float, float], digits: int = 3) -> str:
    return f"{m_se[0]:.{digits}f} ± {m_se[1]:.{digits}f}"


def probe_stat(cells: list[dict], mode: str, eta: int, side: str, key: str) -> tuple[float, float]:
    """Mean ± s.e. over seeds of ``key`` at η in the probes of ``mode``'s runs, measured with replay ``side``
    ("replay" / "no-replay"); each seed's value is the mean over its probes."""
    per_seed = []
    for c in cells:
        if c["mode"] == mode:
            xs = [p[str(eta)][side][key] for p in c["probes"]]
            per_seed.append(sum(xs) / len(xs))
    return mean_se(per_seed)


def fresh_max(cells: list[dict], mode: str, side: str) -> float:
    """The largest |log IS ratio| over every fresh (η = 0) probe token of ``mode``'s runs, replay ``side``."""
    return max(p["0"][side]["max_abs_log_ratio"] for c in cells if c["mode"] == mode for p in c["probes"])


def mismatch_table(cells: list[dict], modes: list[str]) -> str:
    head = "| η | " + " | ".join(f"route mismatch, {'bf16' if m else 'fp32'} rollout" for m in modes) + " |"
    lines = [head, "|---" * (len(modes) + 1) + "|"]
    for e in PROBE_ETAS:
        cols = [fmt(probe_stat(cells, f"replay{m}", e, "replay", "route_mismatch")) for m in modes]
        lines.append(f"| {e} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def ratio_table(cells: list[dict], mode: str) -> str:
    lines = [
        "| η | mismatch KL, replay | mismatch KL, no replay | IS weight mean, replay | IS weight mean, no replay |",
        "|---|---|---|---|---|",
    ]
    for e in PROBE_ETAS:
        kl = [probe_stat(cells, mode, e, s, "mismatch_kl") for s in ("replay", "no-replay")]
        w = [probe_stat(cells, mode, e, s, "is_weight_mean") for s in ("replay", "no-replay")]
        lines.append(
            f"| {e} | {kl[0][0]:.2e} ± {kl[0][1]:.1e} | {kl[1][0]:.2e} ± {kl[1][1]:.1e} | "
            f"{fmt(w[0], 4)} | {fmt(w[1], 4)} |"
        )
    return "\n".join(lines)


def learning_table(cells: list[dict], modes: list[str], last: int = 20) -> tuple[str, dict]:
    lines = [
        f"| mode | seeds | reward, last {last} versions | greedy accuracy at the end (100 problems) | "
        "route mismatch of trained tokens | mismatch KL of trained tokens |",
        "|---|---|---|---|---|---|",
    ]
    out = {}
    for m in modes:
        runs = [c for c in cells if c["mode"] == m]
        if not runs:
            continue
        reward = mean_se([sum(c["curve"][-last:]) / len(c["curve"][-last:]) for c in runs])
        acc = mean_se([c["eval"] for c in runs])
        moved = [x for c in runs for x in c["route_mismatch"] if x is not None]
        kl = mean_se([sum(c["mismatch_kl"]) / len(c["mismatch_kl"]) for c in runs])
        out[m] = {
            "reward_last": reward,
            "eval": acc,
            "route_mismatch": sum(moved) / len(moved) if moved else None,
            "mismatch_kl": kl,
        }
        lines.append(
            f"| {m} | {len(runs)} | {fmt(reward)} | {fmt(acc)} | "
            f"{out[m]['route_mismatch']:.3f} | {kl[0]:.2e} ± {kl[1]:.1e} |"
            if moved
            else f"| {m} | {len(runs)} | {fmt(reward)} | {fmt(acc)} | (not measured: no replay) | "
            f"{kl[0]:.2e} ± {kl[1]:.1e} |"
        )
    return "\n".join(lines), out


def bytes_table(b: dict) -> str:
    shape = b["shape"]
    w, r = b["without_routes"], b["with_routes"]
    return "\n".join(
        [
            f"{b['episodes']} episodes, {b['policy_tokens']} policy tokens; {shape['layers']} MoE layers, "
            f"top-{shape['top_k']} of {shape['experts']} experts",
            "",
            "| B per policy token | without routes | with routes | routes |",
            "|---|---|---|---|",
            f"| wire form (routes.pack) | | | {b['wire_per_token']:.2f} ({b['wire_per_token_per_layer']:.2f} per MoE "
            "layer) |",
            f"| the wire planes by zstd {b['zstd_level']} alone | | | {b['planes_zstd_per_token']:.2f} |",
            f"| Redis stream entries (field and value bytes) | {w['entry_per_token']:.1f} | "
            f"{r['entry_per_token']:.1f} | "
            f"{b['entry_routes_per_token']:+.2f} |",
            f"| Redis (MEMORY USAGE: allocation-granular) | {w['redis_per_token']:.1f} | "
            f"{r['redis_per_token']:.1f} | "
            f"{b['redis_routes_per_token']:+.1f} |",
            f"| Parquet segment | {w['segment_per_token']:.2f} | {r['segment_per_token']:.2f} | "
            f"{b['segment_routes_per_token']:+.2f} |",
        ]
    )


def e2e_table(pair: dict) -> str:
    targets = list(pair["runs"][0]["reach"])
    lines = [
        "| model | versions in the run | "
        + " | ".join(f"20-step mean reward {t} at version (s)" for t in targets)
        + " | last-20 reward | route mismatch (trainer) | check |",
        "|---" * (len(targets) + 5) + "|",
    ]
    for r in pair["runs"]:
        rm = "" if r["route_mismatch_mean"] is None else f"{r['route_mismatch_mean']:.3f}"
        reach = [
            f"{x['version']} ({x['seconds']})" if x["version"] is not None else "not reached"
            for x in r["reach"].values()
        ]
        lines.append(
            f"| {r['model']} | {r['versions']} | " + " | ".join(reach) + f" | {r['last20_reward']:.3f} | "
            f"{rm} | {'ok' if r['check_ok'] else 'FAILED ' + '; '.join(r['check_failed_rows'])} |"
        )
    return "\n".join(lines)


def plot(cells: list[dict], modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(17, 5))
    for m in [x for x in ("", "-bf16") if f"replay{x}" in modes]:
        ys = [probe_stat(cells, f"replay{m}", e, "replay", "route_mismatch") for e in PROBE_ETAS]
        ax.errorbar(
            PROBE_ETAS,
            [y for y, _ in ys],
            yerr=[s for _, s in ys],
            marker="o",
            capsize=3,
            label=f"{'bf16' if m else 'fp32'} rollout",
        )
    ax.set_xlabel("staleness η (versions behind, exact)")
    ax.set_ylabel("share of sampled tokens routed otherwise by the trainer")
    ax.set_title("route mismatch without replay (mean ± s.e. over seeds)")
    ax.legend()
    for m in [x for x in ("", "-bf16") if f"replay{x}" in modes]:
        for side, ls in (("replay", "-"), ("no-replay", "--")):
            ys = [probe_stat(cells, f"replay{m}", e, side, "mismatch_kl") for e in PROBE_ETAS]
            bx.errorbar(
                PROBE_ETAS,
                [max(y, 1e-16) for y, _ in ys],
                yerr=[s for _, s in ys],
                marker="o",
                ls=ls,
                capsize=3,
                label=f"{side}, {'bf16' if m else 'fp32'} rollout",
            )
    bx.set_yscale("log")
    bx.set_xlabel("staleness η")
    bx.set_ylabel("mismatch KL (k3), sampler vs trainer")
    bx.set_title("mismatch KL by η, replay on vs off")
    bx.legend(fontsize=8)
    for m in modes:
        runs = [c["curve"] for c in cells if c["mode"] == m]
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(len(runs[0]))]
        smooth = [sum(mean[max(0, i - 9) : i + 1]) / len(mean[max(0, i - 9) : i + 1]) for i in range(len(mean))]
        cx.plot(range(1, len(mean) + 1), smooth, label=m, ls="-" if m.startswith("replay") else "--")
    cx.set_xlabel("version")
    cx.set_ylabel("mean sampled reward (10-version moving mean, mean over seeds)")
    cx.set_title(f"learning at η = {cells[0]['eta']}")
    cx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eta", type=int, default=4, help="the staleness the learning comparison trains at")
    p.add_argument("--probe-every", type=int, default=15, help="probe every η this many versions")
    p.add_argument("--probe-groups", type=int, default=4, help="groups of a probe batch")
    p.add_argument("--no-bf16", action="store_true", help="leave out the bf16 rollout engine")
    p.add_argument("--e2e", action="store_true", help="also the end-to-end pair: streamrl run, MoE vs dense")
    p.add_argument("--e2e-minutes", type=float, default=2.0)
    p.add_argument("--e2e-versions", type=int, default=0, help="run each of the pair to this many versions instead")
    p.add_argument("--png", default=str(ROOT / "bench" / "results" / "moe_routing.png"))
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0, load0 = time.monotonic(), os.getloadavg()
    modes = [Replay(True), Replay(False)] + (
        [] if args.no_bf16 else [Replay(True, "bfloat16"), Replay(False, "bfloat16")]
    )
    setup = Setup.from_defaults(steps=args.steps)
    pool, problems = task_pool(), all_problems()
    print(f"setup {setup}; modes {', '.join(m.name for m in modes)}; seeds {args.seeds}", flush=True)
    pair = None
    if args.e2e:
        from bench.moe.e2e import run_pair

        pair = run_pair(args.e2e_minutes, max_versions=args.e2e_versions)
    cells, episodes = [], []

    def keep_episodes(v, groups, stats):
        # the last runs' trained episodes, for the bytes: real tokens and routes (group ids made unique)
        if v >= args.steps - 10:
            episodes.extend(dataclasses.replace(ep, group_id=f"{v:04d}{ep.group_id}") for g in groups for ep in g)

    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            model_dir = make_moe_model(Path(tmp, f"s{seed}"), seed)
            for mode in modes:
                last = seed == args.seeds - 1 and mode == modes[0]
                cell = run_cell(
                    model_dir,
                    args.eta,
                    mode,
                    seed,
                    setup,
                    pool,
                    args.probe_every,
                    args.probe_groups,
                    problems,
                    on_step=keep_episodes if last else None,
                )
                cells.append(cell)
                tail = cell["curve"][-20:]
                print(
                    f"seed {seed} {mode.name:>16}: last-20 reward {sum(tail) / len(tail):.3f}, greedy "
                    f"{cell['eval']:.3f}, {len(cell['probes'])} probes ({time.monotonic() - t0:.0f}s)",
                    flush=True,
                )
        shape = route_shape_of(json.loads(Path(model_dir, "config.json").read_text()))
    # the rollout engines measured: "" fp32, "-bf16"
    engines = [m for m in ("", "-bf16") if any(c["mode"] == f"replay{m}" for c in cells)]
    fresh = {m: {s: fresh_max(cells, f"replay{m}", s) for s in ("replay", "no-replay")} for m in engines}
    print(
        "\nfresh tokens (η = 0), max |log IS ratio|: "
        + "; ".join(
            f"{'bf16' if m else 'fp32'} rollout: replay {v['replay']:.2e}, no replay {v['no-replay']:.2e}"
            for m, v in fresh.items()
        ),
        flush=True,
    )
    assert fresh[""]["replay"] < FRESH_TOLERANCE, f"fresh tokens' IS ratio with replay is not 1: {fresh['']}"
    md = ["## Route mismatch without replay, by η", mismatch_table(cells, engines)]
    for m in engines:
        md += [
            f"## IS weight and mismatch KL by η, {'bf16' if m else 'fp32'} rollout",
            ratio_table(cells, f"replay{m}"),
        ]
    learn_md, learn = learning_table(cells, [m.name for m in modes])
    md += [f"## Learning at η = {args.eta}", learn_md]

    from bench.moe.route_bytes import measure as route_bytes
    from shared.protocol.archive.segments import LEVEL

    b = route_bytes(episodes, shape) | {"zstd_level": LEVEL}
    md += ["## Bytes of routes", bytes_table(b)]
    if pair:
        md += ["## End to end: streamrl run, MoE vs dense", e2e_table(pair)]
    wall = time.monotonic() - t0
    print("\n\n".join(md), flush=True)
    print(f"\nwall {wall:.0f} s; load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    plot(cells, [m.name for m in modes], Path(args.png))
    if args.no_record:
        return 0
    from bench.harness.record import loaded, record

    at = lambda e, side, key: probe_stat(cells, "replay", e, side, key)  # noqa: E731
    rows = [
        {
            "what": f"route mismatch without replay at η = 1 / 4 / 8 (tiny Qwen3-MoE, fp32 rollout, "
            f"{args.seeds} seeds)",
            "value": " / ".join(f"{at(e, 'replay', 'route_mismatch')[0]:.1%}" for e in (1, 4, 8))
            + f" of sampled tokens (± {at(8, 'replay', 'route_mismatch')[1]:.1%} at η = 8)",
        },
        {
            "what": "fresh tokens' max |log IS ratio|, replay on / off (fp32 rollout)",
            "value": f"{fresh['']['replay']:.1e} / {fresh['']['no-replay']:.1e}",
        },
        {
            "what": "mismatch KL at η = 4, replay on / off (fp32 rollout)",
            "value": f"{at(4, 'replay', 'mismatch_kl')[0]:.2e} / {at(4, 'no-replay', 'mismatch_kl')[0]:.2e}",
        },
        {
            "what": f"reward over the last 20 of {args.steps} versions at η = {args.eta}, replay on / off "
            "(fp32 rollout)",
            "value": f"{fmt(learn['replay']['reward_last'])} / {fmt(learn['no-replay']['reward_last'])}",
        },
        {
            "what": "routes' bytes per policy token: wire / zstd planes / in the segment",
            "value": f"{b['wire_per_token']:.2f} / {b['planes_zstd_per_token']:.2f} / "
            f"{b['segment_routes_per_token']:+.2f}",
        },
    ]
    if pair:
        moe, dense = pair["runs"]
        rows.append(
            {
                "what": (
                    f"streamrl run to {args.e2e_versions} versions"
                    if args.e2e_versions
                    else f"streamrl run {args.e2e_minutes:g} min"
                )
                + ", version at a 20-step mean reward of 0.9, MoE / dense",
                "value": f"{moe['reach']['0.9']['version'] or 'not reached'} / "
                f"{dense['reach']['0.9']['version'] or 'not reached'} (0.8: {moe['reach']['0.8']['version']} / "
                f"{dense['reach']['0.8']['version']}; check "
                f"{'ok' if moe['check_ok'] and dense['check_ok'] else 'FAILED'})",
            }
        )
    given = sys.argv[1:] if argv is None else argv
    record(
        "moe_routing",
        rows,
        sorted(set(loaded()) | {"bench/moe", "bench/learning/staleness_cell.py"}),
        argv=given,
        extra={
            "setup": setup.__dict__,
            "seeds": list(range(args.seeds)),
            "modes": [m.name for m in modes],
            "eta": args.eta,
            "probe_etas": list(PROBE_ETAS),
            "wall_s": round(wall),
            "load": f"2-core box shared with other work: load average {load0[0]:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end",
            "fresh_max_abs_log_ratio": fresh,
            "learning": learn,
            "bytes": b,
            "e2e": pair,
            "tables": "\n\n".join(md),
            "cells": cells,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Staleness tolerance, with staleness fixed exactly: in one process, no Redis, no pipeline.

Every step v the batch is sampled by policy version v − η (the harness keeps the last η + 1 snapshots; for
v < η, before any older version exists, by version 0, so staleness is min(v, η)), its behaviour log-probs
recorded under that version's weights (``token_logprobs``, the rollout engines' definition), and the trainer at
version v trains on it with the chosen correction (the trainer's own ``build_batch`` + ``train_on_batch``),
then publishes v + 1.

The task: chain sums of 4 one-digit numbers (``3+4+5+6=``, the reference writes the running sums ``7,12,18``;
services/driver/tasks.py's chain_sum at a fixed length), 10,000 distinct problems of which 1,000 are held out:
the warm start and training never see them. (The default run's arithmetic task has only 100 distinct problems:
a held-out set would repeat training problems.) The model is the default tiny Llama's shape, warm-started on the
training pool (600 steps, per seed); the step's hyper-parameters are the config's defaults (lr, group size,
groups per batch, temperature, max tokens) unless given. The evaluation: greedy accuracy on the held-out
problems, the mean over the last 5 versions evaluated (every 5th: less noise than the last version alone); per
correction and η the mean ± standard error over seeds, and the difference to η = 0 paired by seed.

    python bench/learning/staleness.py                       # the grid (long: see bench/RESULTS.md)
    python bench/learning/staleness.py --etas 0,8 --corrections default,none --seeds 1 --steps 20   # a smoke run
    python bench/learning/staleness.py --part 0/2 --cells-out a.json &
      python bench/learning/staleness.py --part 1/2 --cells-out b.json
    python bench/learning/staleness.py --merge a.json,b.json   # two processes, then the table, figure and record
    python bench/learning/staleness.py --merge bench/results/staleness.json,c.json --etas ... --corrections ...
                                                      # a recorded grid's cells and new ones, in one table
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.learning.staleness_cell import (  # noqa: E402
    CORRECTIONS,
    ETAS,
    GRID,
    Setup,
    # re-exported: tests import it from here
    behaviour_version,  # noqa: F401
    make_model,
    run_cell,
    split_task,
    step_config,
)


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def evals(cells: list[dict], correction: str, eta: int) -> dict[int, float]:
    """seed -> eval of (correction, η); η = 0 is one run per seed shared by every correction (with no staleness
    the behaviour and trainer log-probs are equal: every weight is 1, no correction changes anything)."""
    return {x["seed"]: x["eval"] for x in cells if x["eta"] == eta and (eta == 0 or x["correction"] == correction)}


def table(cells: list[dict], etas: list[int], corrections: list[str], margin: float = 0.02) -> tuple[str, dict]:
    """A markdown table per correction and η: eval mean ± se over seeds, and below it the paired difference to
    η = 0 (same seed: same model and prompts) mean ± se. Parity: that difference ≥ −``margin``; the largest η at
    parity counts only an unbroken run from η = 0 (a noisy parity past a failure is not tolerance); an η not
    trained for a correction (a merged grid measures some corrections at fewer η) is left out of its run and
    shown as –. Clearly worse: the difference + 2 se < −``margin`` (the first such η; None: none is). ``seeds``:
    how many seeds the correction's paired differences have (the most over its η > 0); its η = 0 column is the mean
    over the seeds it was trained with."""
    head = [
        "| correction | seeds | "
        + " | ".join(f"η={e}" for e in etas)
        + " | largest η at parity | first η clearly worse |",
        "|---" * (len(etas) + 4) + "|",
    ]
    summary, lines = {}, head
    for c in corrections:
        base = evals(cells, c, 0)
        stale = {x["seed"] for x in cells if x["eta"] and x["correction"] == c}
        # η = 0 of the same seeds
        base = {s: v for s, v in base.items() if s in stale} if stale else base
        row, diff, seeds = {}, {}, 0
        for e in etas:
            got = evals(cells, c, e) if e else base
            paired = [got[s] - base[s] for s in got if s in base]
            if got and paired:
                row[e], diff[e] = mean_se(list(got.values())), mean_se(paired)
                seeds = max(seeds, len(paired)) if e else seeds
        seeds = seeds or len(base)
        parity = 0
        for e in diff:
            if diff[e][0] < -margin:
                break
            parity = e
        worse = next((e for e in diff if diff[e][0] + 2 * diff[e][1] < -margin), None)
        summary[c] = {
            "eval": {str(e): row[e] for e in diff},
            "diff": {str(e): diff[e] for e in diff},
            "parity_eta": parity,
            "clearly_worse_eta": worse,
            "seeds": seeds,
        }
        lines.append(
            f"| {c} | {seeds} | "
            + " | ".join(
                f"{row[e][0]:.3f} ± {row[e][1]:.3f}<br>{diff[e][0]:+.3f} ± {diff[e][1]:.3f}" if e in diff else "–"
                for e in etas
            )
            + f" | **{parity}** | {worse} |"
        )
    return "\n".join(lines), summary


def plot(summary: dict, etas: list[int], path: Path, cells: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for c, s in summary.items():
        measured = [e for e in etas if str(e) in s["diff"]]
        ds = [s["diff"][str(e)] for e in measured]
        ax.errorbar(measured, [m for m, _ in ds], yerr=[se for _, se in ds], label=c, capsize=3, marker="o")
    ax.axhline(-0.02, color="grey", ls="--", lw=1, label="parity margin (-0.02)")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(etas, [str(e) for e in etas])
    ax.set_xlim(-0.2, max(etas) * 1.2)
    ax.set_xlabel("staleness η (versions behind, exact)")
    ax.set_ylabel("greedy accuracy on held-out problems, minus η=0's (same seed)")
    ax.set_title("staleness tolerance by correction (mean ± s.e. over seeds)")
    ax.legend(fontsize=7)
    for c in list(summary)[:1]:
        for e in etas:
            runs = [x["curve"] for x in cells if x["eta"] == e and (e == 0 or x["correction"] == c)]
            if runs:
                mean = [sum(r[i] for r in runs) / len(runs) for i in range(len(runs[0]))]
                smooth = [sum(mean[max(0, i - 9) : i + 1]) / len(mean[max(0, i - 9) : i + 1]) for i in range(len(mean))]
                bx.plot(range(1, len(mean) + 1), smooth, label=f"η={e}")
        bx.set_title(f"training reward, {c} (mean over seeds, 10-version moving mean)")
    bx.set_xlabel("version")
    bx.set_ylabel("mean sampled reward of the trained batch")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cached_model(folder: str, pool: list[dict], warm_steps: int, seed: int) -> str:
    """``folder``/w<warm_steps>-s<seed>, made unless there (made aside, then renamed: two processes may race)."""
    final = Path(folder, f"w{warm_steps}-s{seed}")
    final.parent.mkdir(parents=True, exist_ok=True)
    if not (final / "config.json").exists():
        aside = Path(tempfile.mkdtemp(dir=folder))
        make_model(aside, pool, warm_steps, seed)
        try:
            aside.rename(final)
        # the other process made it first
        except OSError:
            pass
    return str(final)


def slim(cell: dict) -> dict:
    """A cell as the record keeps it: the per-step lists that only the run's own checks need become means (a cell
    read back from a record is kept as it is)."""
    if "masked_fraction" not in cell:
        return cell
    out = {k: v for k, v in cell.items() if k not in ("mismatch_kl_current", "masked_fraction", "behaviour_versions")}
    out["masked_fraction_mean"] = sum(cell["masked_fraction"]) / max(len(cell["masked_fraction"]), 1)
    out["curve"] = [round(r, 4) for r in cell["curve"]]
    return out


def read_cells(path: str) -> list[dict]:
    """The cells of a ``--cells-out`` file, or of a record (bench/results/staleness.json: its ``extra.cells``, kept
    slim); a cell trained twice (same seed, correction and η) is an error: the merge would count it twice."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        if "cells" not in data.get("extra", {}):
            raise ValueError(f"--merge {path}: expected a list of cells or a record with extra.cells")
        data = data["extra"]["cells"]
    return data


def merge_cells(files: list[str]) -> list[dict]:
    """Every file's cells, each (seed, correction, η) once (η = 0 once per seed, whatever its correction)."""
    cells, seen = [], {}
    for f in files:
        for c in read_cells(f):
            key = (c["seed"], c["correction"] if c["eta"] else "", c["eta"])
            if key in seen:
                raise ValueError(f"--merge: seed {key[0]} {key[1] or 'η=0'} η={key[2]} is in both {seen[key]} and {f}")
            seen[key] = f
            cells.append(c)
    return cells


def grid(etas: list[int], corrections: list[str], seeds: int, first_seed: int = 0) -> list[tuple[int, str, int]]:
    """(seed, correction, η) of every cell to train, seeds ``first_seed`` .. + ``seeds`` − 1: η = 0 once per seed
    (see :func:`evals`)."""
    out = []
    for seed in range(first_seed, first_seed + seeds):
        out += [(seed, corrections[0], 0)] if 0 in etas else []
        out += [(seed, c, e) for c in corrections for e in etas if e != 0]
    return out


def run_grid(args, etas: list[int], corrections: list[str], setup: Setup) -> list[dict]:
    """Train this process's share of the grid (``--part k/n``: every n-th cell from the k-th)."""
    k, n = map(int, args.part.split("/"))
    todo = grid(etas, corrections, args.seeds, args.first_seed)[k::n]
    pool, eval_rows = split_task(args.terms, args.eval_size)
    print(
        f"setup {setup}; {len(todo)} cells (part {args.part}); {len(eval_rows)} held-out problems of "
        f"{len(pool) + len(eval_rows)}",
        flush=True,
    )
    cells, models, t0 = [], {}, time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed, c, e in todo:
            if seed not in models:
                models[seed] = cached_model(args.models_dir or tmp, pool, args.warm_steps, seed)
            cell = run_cell(models[seed], e, c, seed, setup, eval_rows, pool)
            cells.append(cell)
            tail = cell["curve"][-10:]
            print(
                f"seed {seed} {c:>18} η={e:<3} eval {cell['eval']:.3f} (last version {cell['eval_final']:.3f})  "
                f"last-10 reward {sum(tail) / len(tail):.3f}  ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
            print("  greedy eval by version: " + " ".join(f"{v}:{a:.3f}" for v, a in cell["eval_curve"]), flush=True)
    return cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etas", default=",".join(map(str, ETAS)))
    p.add_argument(
        "--corrections",
        default=",".join(GRID),
        help=f"names ({', '.join(CORRECTIONS)}), or name:field=value:... (see step_config)",
    )
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds --first-seed .. + --seeds − 1 (one process per "
        "seed with --cells-out, then --merge: a cut-off grid keeps its finished seeds)",
    )
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--lr", type=float, default=None, help="default: the config's lr")
    p.add_argument("--eval-every", type=int, default=Setup.eval_every, help="greedy-evaluate every this many versions")
    p.add_argument(
        "--eval-last",
        type=int,
        default=Setup.eval_last,
        help="... the eval is the mean over the last "
        "this many evaluated versions (a large value with --etas 0 --seeds 1: η = 0's whole curve)",
    )
    p.add_argument("--terms", type=int, default=4, help="the task: chain sums of this many one-digit numbers")
    p.add_argument("--warm-steps", type=int, default=600)
    p.add_argument("--eval-size", type=int, default=1000)
    p.add_argument("--part", default="0/1", help="k/n: train every n-th cell from the k-th (two processes: 0/2, 1/2)")
    p.add_argument("--cells-out", default="", help="write the trained cells here (JSON) and stop")
    p.add_argument(
        "--merge",
        default="",
        help="comma-separated --cells-out files: the table, figure and record from them (no training)",
    )
    p.add_argument("--models-dir", default="", help="keep the warm-started models here (shared by --part runs)")
    p.add_argument("--png", default=str(ROOT / "docs" / "staleness.png"))
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--record-name", default="staleness", help="bench/results/<this>.json (another setup: another name)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    etas = [int(e) for e in args.etas.split(",")]
    corrections = args.corrections.split(",")
    for c in corrections:
        step_config(c)
    setup = Setup.from_defaults(
        steps=args.steps, eval_every=args.eval_every, eval_last=args.eval_last, **({"lr": args.lr} if args.lr else {})
    )
    if setup.steps < setup.eval_every:
        p.error(
            f"--steps {setup.steps}: expected at least {setup.eval_every} (the greedy eval runs every "
            f"{setup.eval_every}th version)"
        )
    if args.merge:
        cells = merge_cells(args.merge.split(","))
    else:
        cells = run_grid(args, etas, corrections, setup)
    if args.cells_out:
        Path(args.cells_out).write_text(json.dumps(cells))
        return 0
    md, summary = table(cells, etas, corrections)
    print(md)
    kl0 = [k for cell in cells for k in cell.get("mismatch_kl_current", []) if k is not None]
    print(f"mismatch KL of current-version tokens (η=0 batches, torch): max {max(kl0):.2e}" if kl0 else "")
    plot(summary, etas, Path(args.png), cells)
    if not args.no_record:
        from bench.harness.record import record

        at8 = lambda c: summary[c]["diff"].get("8", (0.0, 0.0))  # noqa: E731
        best = max(summary, key=lambda c: (summary[c]["parity_eta"], at8(c)[0]))
        counts = sorted({s["seeds"] for s in summary.values()})
        seeds = "-".join(map(str, counts[:: max(len(counts) - 1, 1)]))
        rows = [
            {
                "what": f"largest exact staleness η within 0.02 of η=0 (paired by seed), greedy eval on "
                f"{args.eval_size} held-out {args.terms}-term chain sums ({seeds} seeds, {setup.steps} versions "
                f"at lr {setup.lr:g})",
                "value": ", ".join(f"{c} {s['parity_eta']}" for c, s in summary.items()) + f"; best: {best}",
            }
        ]
        if "8" in summary[best]["diff"]:
            rows.append(
                {
                    "what": "greedy eval at η=8 minus η=0's, the best correction (mean ± s.e., paired by seed)",
                    "value": f"{best} {at8(best)[0]:+.3f} ± {at8(best)[1]:.3f}",
                }
            )
        given = sys.argv[1:] if argv is None else argv
        # the command that trained the cells: less --merge and its files
        argv_run = [
            a for i, a in enumerate(given) if not a.startswith("--merge") and not (i and given[i - 1] == "--merge")
        ]
        record(
            args.record_name,
            rows,
            ["bench/learning/staleness.py", "bench/learning/staleness_cell.py", "services/trainer"],
            argv=argv_run,
            extra={
                "summary": summary,
                "setup": setup.__dict__,
                "kl_current_max": max(kl0) if kl0 else None,
                "cells": [slim(c) for c in cells],
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""PNG plots of a run, from the trainer's metrics file, the metrics stream's head file and the stream."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import redis

from shared.protocol.keys import Keys
from shared.protocol.streams import metrics
from shared.runtime.config.keys import Config
from shared.runtime.connection import connect


def read_metrics(cfg: Config) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(train steps, rollout reports, validation rounds, published versions): the run's files, then Redis's recent
    records (shared/protocol/streams/metrics.py ``history``)."""
    kinds = ("train", "rollout", "validation", "publish")
    try:
        found = metrics.history(connect(cfg.redis_url, wait=2), Keys(cfg.run), cfg.run_path, kinds)
    # plots from the files alone when the server is gone
    except redis.exceptions.RedisError:
        found = metrics.history(None, Keys(cfg.run), cfg.run_path, kinds)
    return found["train"], found["rollout"], found["validation"], found["publish"]


def plot_weights_wire(published: list[dict], path: Path) -> Path | None:
    """Bytes per version: the full file, its delta (snapshots have none) and the entropy floor."""
    import matplotlib.pyplot as plt

    rows = [r for r in published if not r.get("snapshot", True)]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    vs = [r["version"] for r in published]
    ax.plot(vs, [r["full_bytes"] / 1e6 for r in published], label="full file")
    ax.plot([r["version"] for r in rows], [r["delta_bytes"] / 1e6 for r in rows], "o-", ms=3, label="delta")
    floor = [r for r in rows if r.get("floor_bytes")]
    if floor:
        ax.plot(
            [r["version"] for r in floor],
            [r["floor_bytes"] / 1e6 for r in floor],
            "--",
            label="entropy floor (changed elements + new bits)",
        )
    ax.set(yscale="log", xlabel="version", ylabel="MB", title="Weights on the wire per version")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(cfg: Config, out_dir: Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, rollout, validation, published = read_metrics(cfg)
    if not train:
        return []
    out_dir = out_dir or cfg.run_path / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = train[0]["time"] - train[0].get("train_s", 0) - train[0].get("wait_s", 0)
    minutes = [(m["time"] - t0) / 60 for m in train]
    samples, total = [], 0
    for m in train:
        total += m["samples"]
        samples.append(total)
    reward = [m["reward_mean"] for m in train]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    ax.plot(minutes, reward, label="train reward (batch mean)")
    if validation:
        ax.plot(
            [(v["time"] - t0) / 60 for v in validation],
            [v["reward_mean"] for v in validation],
            "o-",
            label="validation reward (sampled)",
        )
        ax.plot(
            [(v["time"] - t0) / 60 for v in validation],
            [v["reward_greedy"] for v in validation],
            "s--",
            label="validation reward (greedy)",
        )
    ax.set(xlabel="minutes", ylabel="reward", title="Reward over time", ylim=(-0.05, 1.05))
    ax.legend()
    ax = axes[0][1]
    ax.plot(samples, reward)
    ax.set(xlabel="samples trained", ylabel="reward", title="Reward over samples", ylim=(-0.05, 1.05))
    ax = axes[1][0]
    hist: Counter = Counter()
    for m in train:
        for k, v in m.get("staleness", {}).items():
            hist[int(k)] += v
    keys = sorted(hist)
    ax.bar([str(k) for k in keys], [hist[k] for k in keys])
    ax.set(xlabel="versions behind the trainer", ylabel="trained tokens", title="Staleness of trained tokens")
    ax = axes[1][1]
    per_version: Counter = Counter()
    for m in train:
        per_version[m["version"]] += m["tokens"]
    vs = sorted(per_version)
    ax.bar(vs, [per_version[v] for v in vs])
    ax.set(xlabel="policy version (trainer)", ylabel="trained tokens", title="Tokens per version")
    fig.tight_layout()
    main = out_dir / "training.png"
    fig.savefig(main, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    # training steps and commits
    busy = sum(m.get("train_s", 0) + m.get("commit_s", 0) for m in train)
    # waiting for samples
    idle = sum(m.get("wait_s", 0) for m in train)
    bars = [("trainer", busy, idle)]
    last_by_worker: dict[str, dict] = {}
    for r in rollout:
        last_by_worker[r["worker"]] = r
    bars += [(w[:18], r["busy_s"], r["idle_s"]) for w, r in sorted(last_by_worker.items())]
    names = [b[0] for b in bars]
    ax.barh(names, [b[1] for b in bars], label="busy")
    ax.barh(names, [b[2] for b in bars], left=[b[1] for b in bars], label="idle / waiting")
    ax.set(xlabel="seconds", title="Busy and idle time per process")
    ax.legend()
    fig.tight_layout()
    util = out_dir / "utilization.png"
    fig.savefig(util, dpi=100)
    plt.close(fig)

    # the trust region at work: how often the clip and the IS cap bind
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [m["step"] for m in train]
    for key, label in (
        ("clip_fraction", "clip fraction (PPO clip or dual clip won)"),
        ("is_masked_fraction", "IS weight over is_cap: masked"),
        ("is_truncated_fraction", "IS weight over is_cap: truncated"),
    ):
        if any(m.get(key) for m in train):
            ax.plot(steps, [m.get(key, 0.0) for m in train], label=label, linewidth=0.8)
    ax.set(xlabel="optimizer step", ylabel="fraction of trained tokens", title="Trust region and importance weights")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    # neither the clip nor the IS cap ever bound: say so (a legend of nothing is a matplotlib warning)
    else:
        ax.text(0.5, 0.5, "the PPO clip and the IS cap never bound", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    trust = out_dir / "trust_region.png"
    fig.savefig(trust, dpi=100)
    plt.close(fig)
    # with deltas only
    wire = plot_weights_wire(published, out_dir / "weights_wire.png")
    return [main, util, trust] + ([wire] if wire else [])

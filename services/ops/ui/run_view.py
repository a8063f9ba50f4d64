"""The run page's data: the series its charts draw and the tables under them, from the run's streams and folder.

``series`` is pure (records in, chart series out); ``read_run_view`` is the I/O: the trainer's metrics.jsonl,
the metrics stream and its head file (rollout, validation records), heartbeats, dead letters and `streamrl keep`'s
restart counts. ``since`` (a train step) lets a page that already drew the first steps fetch only the new ones.
"""

from __future__ import annotations

import time
from pathlib import Path

from services.ops.launch.keep import processes
from shared.protocol.streams import dead_letters, metrics, versions
from shared.runtime.heartbeat import alive

STAT_KEYS = (
    "clip_fraction",
    "is_masked_fraction",
    "is_truncated_fraction",
    "approx_kl",
    "tokens_per_s",
    "response_len",
    "staleness_max",
)


def train_series(train: list[dict], since: int = -1) -> dict:
    """Per train step after ``since``: time, version, reward, samples, clip and IS-mask fractions, ..."""
    rows = [m for m in train if m.get("step", -1) > since]
    out = {
        "step": [m.get("step") for m in rows],
        "time": [m.get("time") for m in rows],
        "version": [m.get("version") for m in rows],
        "reward": [m.get("reward_mean") for m in rows],
        "samples": [m.get("samples", 0) for m in rows],
    }
    for key in STAT_KEYS:
        out[key] = [m.get(key) for m in rows]
    return out


def staleness(train: list[dict]) -> dict[str, int]:
    """Trained samples by how many versions behind they were, over the whole run (the trainer's per-step
    histograms added up)."""
    total: dict[str, int] = {}
    for m in train:
        for k, n in (m.get("staleness") or {}).items():
            total[str(k)] = total.get(str(k), 0) + int(n)
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))


def busy(rollout: list[dict], train: list[dict]) -> dict:
    """Seconds busy and waiting per process: each rollout worker's newest report; the trainer's steps summed."""
    newest: dict[str, dict] = {}
    for r in rollout:
        newest[str(r.get("worker", "?"))] = r
    names = sorted(newest)
    out = {
        "process": names,
        "busy_s": [float(newest[n].get("busy_s", 0)) for n in names],
        "waiting_s": [float(newest[n].get("idle_s", 0)) for n in names],
    }
    if train:
        out["process"].append("trainer")
        out["busy_s"].append(sum(float(m.get("train_s", 0)) + float(m.get("commit_s", 0)) for m in train))
        out["waiting_s"].append(sum(float(m.get("wait_s", 0)) for m in train))
    return out


def generated(rollout: list[dict]) -> dict:
    """Tokens the rollout workers say they generated (each worker's newest report), and whether every report is
    final (then this minus the policy tokens in the streams is `streamrl check`'s tokens generated again)."""
    newest: dict[str, dict] = {}
    for r in rollout:
        newest[str(r.get("worker", "?"))] = r
    return {
        "tokens": sum(int(r.get("tokens", 0)) + int(r.get("call_tokens", 0)) for r in newest.values()),
        "final": bool(newest) and all(r.get("final") for r in newest.values()),
    }


def samples_per_s(train: list[dict]) -> list[float]:
    """Samples trained per second between consecutive steps (the first step: over its own wait and train)."""
    out, last = [], None
    for m in train:
        t = m.get("time", 0.0)
        span = (t - last) if last is not None else float(m.get("wait_s", 0)) + float(m.get("train_s", 0))
        out.append(round(m.get("samples", 0) / span, 3) if span > 0 else None)
        last = t
    return out


def read_run_view(client, keys, run_path: Path, since: int = -1) -> dict:
    # the trainer's metrics.jsonl, the stream's head file, then Redis (no trainer file here: the trainer on another
    # host, its records from the stream)
    found = metrics.history(client, keys, run_path, ("train", "rollout", "validation"))
    train, rollout, validation = found["train"], found["rollout"], found["validation"]
    workers, dead, version = {}, [], None
    if client is not None:
        workers = alive(client, keys)
        dead = [
            {"stream": d.stream, "entry": d.entry, "reason": d.reason, "by": d.by}
            for d in dead_letters.read_all(client, keys)
        ]
        version = versions.latest_number(client, keys)
    series = train_series(train, since)
    series["samples_per_s"] = samples_per_s(train)[len(train) - len(series["step"]) :]
    return {
        "now": time.time(),
        "version": version,
        "train": series,
        "staleness": staleness(train),
        "validation": {
            "version": [v.get("version") for v in validation],
            "time": [v.get("time") for v in validation],
            "reward": [v.get("reward_mean") for v in validation],
            "greedy": [v.get("reward_greedy") for v in validation],
        },
        "busy": busy(rollout, train),
        "generated": generated(rollout),
        "restarts": {name: n for name, (_, n) in processes(Path(run_path) / "procs").items()},
        "workers": [{"name": name, **fields} for name, fields in sorted(workers.items())],
        "dead_letters": dead,
    }

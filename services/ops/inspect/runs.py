"""`streamrl runs`: every run under ``run_dir`` from its folder alone (run.json, ENDED, metrics.jsonl): live,
interrupted, ended or archived, with its model, versions, recent reward and times."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.driver.driver import ENDED
from shared.runtime import runstate


@dataclass
class RunRow:
    # what --run names: runs/<folder>
    folder: str
    # its Redis name (an archived folder keeps its run's)
    run: str
    # live | interrupted | ended | archived
    state: str
    model: str
    # the last trained version (metrics.jsonl)
    version: int | None
    # the mean training reward of its last RECENT_STEPS steps (one step's batch is a few prompts: noisy alone)
    reward: float | None
    created: str
    # when it ended, else when it last trained
    last: str


# steps the listed reward is the mean of
RECENT_STEPS = 20


def recent_metrics(run_path: Path, n: int = RECENT_STEPS) -> list[dict]:
    """The last ``n`` lines of metrics.jsonl (the trainer's newest steps, oldest first), read from the file's end."""
    path = run_path / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 2048 * n))
            lines = fh.read().splitlines()
    except OSError:
        return []
    out = []
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            # the first line read may be cut, the last one half written
            continue
        if isinstance(record, dict):
            out.append(record)
        if len(out) == n:
            break
    return out[::-1]


def state_of(folder: Path, marker: dict, live) -> str:
    if marker.get("run") and marker["run"] != folder.name:
        return "archived"
    if (folder / ENDED).exists():
        return "ended"
    return "live" if live(folder, marker) else "interrupted"


def _stamp(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds)) if seconds else ""


def row(folder: Path, marker: dict, live) -> RunRow:
    recent = recent_metrics(folder)
    metrics = recent[-1] if recent else {}
    ended = folder / ENDED
    when = (
        ended.stat().st_mtime
        if ended.exists()
        else (folder / "metrics.jsonl").stat().st_mtime
        if (folder / "metrics.jsonl").exists()
        else None
    )
    rewards = [float(m["reward_mean"]) for m in recent if isinstance(m.get("reward_mean"), (int, float))]
    reward = sum(rewards) / len(rewards) if rewards else None
    return RunRow(
        folder.name,
        marker.get("run", folder.name),
        state_of(folder, marker, live),
        str(runstate.recorded_config(marker).get("model_dir", "?")),
        metrics.get("version"),
        reward,
        str(marker.get("created", "")),
        _stamp(when),
    )


def list_runs(run_dir: Path, live) -> list[RunRow]:
    """Every folder of ``run_dir`` with a run.json, oldest first; ``live(folder, marker)`` says whether a server
    serves it now."""
    out = []
    for folder in sorted(Path(run_dir).glob("*")) if Path(run_dir).is_dir() else []:
        try:
            marker = runstate.read_marker(folder) if folder.is_dir() else None
        except runstate.RunStateError:
            marker = {"run": folder.name, "created": "?"}
        if marker is not None:
            out.append(row(folder, marker, live))
    return sorted(out, key=lambda r: (r.created, r.folder))


def format_runs(rows: list[RunRow], run_dir: str) -> str:
    if not rows:
        return f"no runs under {run_dir}"
    head = f"{'run (--run)':<28} {'state':<11} {'version':>7} {'reward':>6}  {'created':<20} {'last':<20} model"
    lines = [head]
    for r in rows:
        version = "-" if r.version is None else str(r.version)
        reward = "-" if r.reward is None else f"{r.reward:.3f}"
        lines.append(f"{r.folder:<28} {r.state:<11} {version:>7} {reward:>6}  {r.created:<20} {r.last:<20} {r.model}")
    lines.append(f"reward: the mean of each run's last {RECENT_STEPS} trainer steps")
    return "\n".join(lines)


def as_json(rows: list[RunRow]) -> list[dict]:
    return [asdict(r) for r in rows]

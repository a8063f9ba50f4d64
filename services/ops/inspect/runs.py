"""`streamrl runs`: every run under ``run_dir`` from its folder alone (run.json, ENDED, metrics.jsonl): live,
interrupted, ended or archived, with its model, versions, recent reward and times."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from services.driver.driver import ENDED
from shared.protocol.archive import jsonl
from shared.protocol.streams import metrics
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
    """The last ``n`` records of the trainer's metrics file (its newest steps, oldest first), read from its end;
    [] when it is missing or unreadable (a listing shows the run without a reward rather than failing)."""
    try:
        records = jsonl.tail(metrics.trainer_path(run_path), 2048 * n, "metrics file")
    except (OSError, ValueError):
        return []
    return [record for record in records if isinstance(record, dict)][-n:]


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
    newest = recent[-1] if recent else {}
    ended = folder / ENDED
    trained = metrics.trainer_path(folder)
    when = ended.stat().st_mtime if ended.exists() else trained.stat().st_mtime if trained.exists() else None
    rewards = [float(m["reward_mean"]) for m in recent if isinstance(m.get("reward_mean"), (int, float))]
    reward = sum(rewards) / len(rewards) if rewards else None
    return RunRow(
        folder.name,
        marker.get("run", folder.name),
        state_of(folder, marker, live),
        str(runstate.recorded_config(marker).get("model_dir", "?")),
        newest.get("version"),
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

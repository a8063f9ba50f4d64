"""`streamrl runs`: every run under ``run_dir`` from its folder alone (run.json, ENDED, metrics.jsonl): live,
interrupted, ended or archived, with its model, versions, last reward and times."""

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
    # ... its training reward
    reward: float | None
    created: str
    # when it ended, else when it last trained
    last: str


def last_metrics(run_path: Path) -> dict:
    """The last line of metrics.jsonl (the trainer's newest step), read from the file's end."""
    path = run_path / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 8192))
            lines = fh.read().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def state_of(folder: Path, marker: dict, live) -> str:
    if marker.get("run") and marker["run"] != folder.name:
        return "archived"
    if (folder / ENDED).exists():
        return "ended"
    return "live" if live(folder, marker) else "interrupted"


def _stamp(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds)) if seconds else ""


def row(folder: Path, marker: dict, live) -> RunRow:
    metrics = last_metrics(folder)
    ended = folder / ENDED
    when = (
        ended.stat().st_mtime
        if ended.exists()
        else (folder / "metrics.jsonl").stat().st_mtime
        if (folder / "metrics.jsonl").exists()
        else None
    )
    reward = metrics.get("reward_mean")
    return RunRow(
        folder.name,
        marker.get("run", folder.name),
        state_of(folder, marker, live),
        str(runstate.recorded_config(marker).get("model_dir", "?")),
        metrics.get("version"),
        None if reward is None else float(reward),
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
    return "\n".join(lines)


def as_json(rows: list[RunRow]) -> list[dict]:
    return [asdict(r) for r in rows]

"""The end-to-end pair of the routing-replay benchmark: ``streamrl run`` on the default MoE model (``--model-moe
qwen3``, routing replay on) and on the dense default, the same minutes each, one after the other; for each the
version and seconds at which the 20-step mean reward first reaches 0.9 (bench/learning/defaults_reach.py's rule),
and the end-of-run check."""

from __future__ import annotations

import statistics
import tempfile
import uuid
from pathlib import Path

from bench.harness.runs import streamrl_run
from bench.learning.defaults_reach import reached

# the end-of-run check's heading in streamrl run's output (services/ops/launch/runner.py)
CHECK = "streamrl check at the end of the run"
# 20-step mean rewards whose first version is reported (0.9: the goal; the lower ones when a short run stops short)
TARGETS = (0.7, 0.8, 0.9)


def one_run(moe: str, minutes: float, seed: int, folder: Path) -> dict:
    """One ``streamrl run`` of ``minutes`` on the default model (``moe``: its MoE family, "" the dense one)."""
    name = f"bench-moe-{uuid.uuid4().hex[:6]}-{moe or 'dense'}"
    flags = {
        "run": name,
        "seed": seed,
        "max_minutes": minutes,
        "run_dir": folder / "runs",
        "log_level": "warning",
        **({"model_moe": moe} if moe else {}),
    }
    check: list[str] = []

    def on_line(line: str) -> None:
        if CHECK in line or check:
            check.append(line)

    # the default model (models/tiny, made for the run's recipe) only where model_dir is left as it is
    t_start, records = streamrl_run(flags, on_line=on_line, cwd=folder)
    steps = [r for r in records if "reward_mean" in r and "version" in r]
    reach = {}
    for target in TARGETS:
        v = reached(records, target)
        at = next((r["time"] - t_start for r in steps if r["version"] == v), None) if v is not None else None
        reach[str(target)] = {"version": v, "seconds": None if at is None else round(at, 1)}
    mismatch = [r["route_mismatch"] for r in steps if r.get("route_mismatch") is not None]
    failed = [ln.strip() for ln in check if ln.rstrip().endswith("FAIL")]
    return {
        "model": moe or "dense",
        "versions": steps[-1]["version"] if steps else 0,
        "seconds": round(steps[-1]["time"] - t_start, 1) if steps else None,
        "reach": reach,
        # the 20-step mean reward every 20 versions, to compare the two at equal versions
        "mean20": [
            (steps[i]["version"], round(statistics.fmean(r["reward_mean"] for r in steps[i - 19 : i + 1]), 4))
            for i in range(19, len(steps), 20)
        ],
        "last20_reward": statistics.fmean(r["reward_mean"] for r in steps[-20:]) if steps else None,
        "route_mismatch_mean": statistics.fmean(mismatch) if mismatch else None,
        "check_ok": bool(check) and check[-1].strip() == "ok",
        "check_failed_rows": failed,
        "check": check,
    }


def run_pair(minutes: float = 2.0, seed: int = 0) -> dict:
    """The MoE run, then the dense one, each in a scratch folder of its own."""
    out = {"minutes": minutes, "seed": seed, "runs": []}
    for moe in ("qwen3", ""):
        with tempfile.TemporaryDirectory() as tmp:
            r = one_run(moe, minutes, seed, Path(tmp))
        reach = ", ".join(f"{t} at version {x['version']} ({x['seconds']} s)" for t, x in r["reach"].items())
        print(
            f"   {r['model']}: 20-step mean reward {reach}; {r['versions']} versions in {minutes} min, "
            f"check {'ok' if r['check_ok'] else 'FAILED'}",
            flush=True,
        )
        out["runs"].append(r)
    return out

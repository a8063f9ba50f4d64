"""The end-to-end pair of the routing-replay benchmark: ``streamrl run`` on the default MoE model (``--model-moe
qwen3``, routing replay on) and on the dense default, the same minutes (or versions) each, one after the other; for
each the version and seconds at which the 20-step mean reward first reaches 0.7, 0.8 and 0.9
(bench/learning/defaults_reach.py's rule), and the end-of-run check. bench/moe/routing.py --e2e runs the pair for
its record; run alone, this prints the same for longer runs:

    python bench/moe/e2e.py --max-versions 1300                 # both to 1,300 versions
    python bench/moe/e2e.py --models qwen3 --max-versions 1300  # the MoE alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness.runs import streamrl_run  # noqa: E402
from bench.learning.defaults_reach import reached  # noqa: E402

# the end-of-run check's heading in streamrl run's output (services/ops/launch/runner.py)
CHECK = "streamrl check at the end of the run"
# 20-step mean rewards whose first version is reported (0.9: the goal; the lower ones when a short run stops short)
TARGETS = (0.7, 0.8, 0.9)


def one_run(moe: str, minutes: float, seed: int, folder: Path, max_versions: int = 0) -> dict:
    """One ``streamrl run`` of ``minutes`` (or ``max_versions``, when given) on the default model (``moe``: its MoE
    family, "" the dense one)."""
    name = f"bench-moe-{uuid.uuid4().hex[:6]}-{moe or 'dense'}"
    flags = {
        "run": name,
        "seed": seed,
        **({"max_versions": max_versions} if max_versions else {"max_minutes": minutes}),
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


def run_pair(
    minutes: float = 2.0, seed: int = 0, max_versions: int = 0, models: tuple[str, ...] = ("qwen3", "")
) -> dict:
    """The MoE run, then the dense one, each in a scratch folder of its own."""
    out = {"minutes": minutes, "max_versions": max_versions, "seed": seed, "runs": []}
    for moe in models:
        with tempfile.TemporaryDirectory() as tmp:
            r = one_run(moe, minutes, seed, Path(tmp), max_versions)
        reach = ", ".join(f"{t} at version {x['version']} ({x['seconds']} s)" for t, x in r["reach"].items())
        print(
            f"   {r['model']}: 20-step mean reward {reach}; {r['versions']} versions in {r['seconds']} s, "
            f"check {'ok' if r['check_ok'] else 'FAILED'}",
            flush=True,
        )
        out["runs"].append(r)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3,dense", help="comma-separated: qwen3 | mixtral | olmoe | dense")
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--max-versions", type=int, default=0, help="run each to this many versions instead of minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the runs' figures here (JSON)")
    args = p.parse_args(argv)
    models = tuple("" if m == "dense" else m for m in args.models.split(","))
    out = run_pair(args.minutes, args.seed, args.max_versions, models)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

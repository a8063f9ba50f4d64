"""A headline benchmark's result as a file: `bench/results/<name>.json`, read by `bench/headline.py` to rewrite the
table at the top of bench/RESULTS.md.

Each file holds the command that produced it, when, the git commit it ran at (and whether the measured paths had
uncommitted changes then), the machine, the paths of the code it measures, and its headline rows
(`{"what": ..., "value": ...}`). The headline script marks a row stale once the measured code changed after that
commit, so nothing in the table is older than the code it describes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine() -> str:
    """The box in words: CPU model and cores, GPU if torch sees one, load average now."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = "no GPU"
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({cpu}), {gpu}; load average {load} at the end"


def loaded(*packages: str) -> list[str]:
    """The project's source files this process imported, under ``packages`` (default ``services`` and ``shared``),
    as ``measures`` for a benchmark that runs the code in-process: a change elsewhere (a service loop it never
    runs) does not make its figures stale."""
    roots = packages or ("services", "shared")
    files = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if name.split(".")[0] in roots and path:
            try:
                files.add(Path(path).resolve().relative_to(ROOT).as_posix())
            # the same package installed elsewhere: not this checkout's code
            except ValueError:
                continue
    return sorted(files)


def record(
    name: str,
    rows: list[dict],
    measures: list[str],
    *,
    quick: bool = False,
    simulated: str = "",
    argv: list[str] | None = None,
    extra: dict | None = None,
) -> Path:
    """Write bench/results/<name>.json. ``rows``: [{"what": str, "value": str}], the headline figures;
    ``measures``: the paths (folders preferred: robust to files moving inside them) of the code the figures
    describe; ``simulated``: the simulated costs the figures rest on, in words ("" when none)."""
    argv = sys.argv[1:] if argv is None else argv
    script = Path(sys.argv[0]).resolve()
    try:
        script_rel = script.relative_to(ROOT).as_posix()
    except ValueError:
        script_rel = f"bench/{script.name}"
    out = {
        "name": name,
        "command": " ".join(["python", script_rel, *map(shlex.quote, argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--", *measures)),
        "machine": machine(),
        "quick": quick,
        "simulated": simulated,
        "measures": measures,
        "rows": rows,
    }
    if extra:
        out["extra"] = extra
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"(headline result written to {path.relative_to(ROOT)})", flush=True)
    return path

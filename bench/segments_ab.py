"""The move and its segments, an older revision against this tree, side by side in one invocation (issue 33): each
round runs the same measurements in the base revision's tree (``git archive`` into a scratch folder, this tree's
Python environment) and in this one, alternately, so that the box's load moves both alike.

    python bench/segments_ab.py [--base main] [--rounds 3] [--real RUN_DIR/RUN/episodes]

Measured per tree and round: ``bench/archiver_cpu.py`` (CPU us per episode moved by one ``Mover.step``, Redis and
Parquet included, after a warm-up step; bytes per policy token of default-shape synthetic episodes), the archiver's
start (in a process that has imported what the run's starter imports before it forks one: CPU ms to import the
archiver's modules, then of its first move, 64 episodes, one-time costs such as pyarrow's first use included),
``bench/tiers.py`` (bytes per policy token of synthetic 8-token and 256-token episodes) and, with ``--real``, a
finished run's episodes (read once from its segments by this tree, any format) packed and written again by each
tree's writer, one segment per segment of the run: bytes per policy token of the real default run's episodes and
the CPU us per episode to pack and write.
Prints medians per tree and the ratios; records ``bench/results/segments_ab.json``."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import msgpack
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import ROOT, record  # noqa: E402
from shared.protocol.archive import segments  # noqa: E402

REPACK = """
import sys, time, tempfile, msgpack
from pathlib import Path
from shared.protocol.archive import segments
dump, out = msgpack.unpackb(Path(sys.argv[1]).read_bytes(), raw=False), Path(tempfile.mkdtemp())
size = tokens = episodes = 0
cpu = time.process_time()
for k, (episodes_of, n_tokens) in enumerate(dump):
    episodes_of = [(eid, [tuple(e) for e in entries]) for eid, entries in episodes_of]
    if hasattr(segments, "to_row"):  # a tree before shared/protocol/archive/builder.py: rows, then the table
        table = [segments.to_row(eid, entries, 0) for eid, entries in episodes_of]
    else:
        from shared.protocol.archive import builder as segment_builder
        table = segment_builder.table_of(episodes_of, 0)
    size += segments.write_file(out, f"seg-{k + 1:08d}.parquet", table)
    tokens, episodes = tokens + n_tokens, episodes + len(episodes_of)
cpu = time.process_time() - cpu
print(f"real: {size / tokens:.4f} B/token {1e6 * cpu / episodes:.1f} us/episode")
"""

START = """
import sys, time, tempfile
from pathlib import Path
from services.ops.launch.starter import preload
preload()  # what the run's starter has imported before it forks the archiver
cpu = time.process_time()
import numpy as np
from bench.archiver_cpu import write_run
from bench.runs import scratch_server
from services.archiver.mover import Mover
from shared.protocol.keys import Keys
from shared.runtime.connection import connect
imports = time.process_time() - cpu
with scratch_server() as (tmp, url, _):
    client, keys, run_path = connect(url), Keys("bench"), Path(tmp) / "run"
    write_run(client, keys, run_path, 64, np.random.default_rng(0))
    cpu = time.process_time()
    mover = Mover(client, keys, run_path, retention=1, seed_base=0)
    mover.recover()
    moved = mover.step()
    first = time.process_time() - cpu
print(f"start: {1e3 * imports:.1f} ms imports, {1e3 * first:.1f} ms first move ({moved} episodes)")
"""


def dump_real(folder: Path, path: Path) -> tuple[int, int]:
    """Every listed segment's episodes as flat entries (msgpack: [[(id, entries), ...], tokens] per segment)."""
    out, episodes, tokens = [], 0, 0
    for record_ in segments.read_manifest(folder):
        name = record_["segment"]
        rows = segments.entries_of(pq.read_table(folder / name, columns=segments.raw_columns(folder / name)))
        out.append([[(eid, segments.flat(entries)) for eid, entries in rows], record_["tokens"]])
        episodes, tokens = episodes + len(rows), tokens + record_["tokens"]
    path.write_bytes(msgpack.packb(out, use_bin_type=True))
    return episodes, tokens


def run(tree: Path, args: list[str]) -> str:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def measure(tree: Path, real: Path | None) -> dict[str, float]:
    out = run(tree, ["bench/archiver_cpu.py"])
    m = {
        "archiver_us": float(re.search(r"([\d.]+) us CPU per episode", out)[1]),
        "default_shape_bpt": float(re.search(r"segments ([\d.]+) B per policy token", out)[1]),
    }
    hit = re.search(r"start: ([\d.]+) ms imports, ([\d.]+) ms first move", run(tree, ["-c", START]))
    m["start_imports_ms"], m["start_first_move_ms"] = float(hit[1]), float(hit[2])
    out = run(tree, ["bench/tiers.py", "--episodes", "2000"])
    m["synthetic_8_bpt"], m["synthetic_256_bpt"] = (float(x) for x in re.findall(r"segment ([\d.]+) B/token", out))
    if real is not None:
        hit = re.search(r"real: ([\d.]+) B/token ([\d.]+) us/episode", run(tree, ["-c", REPACK, str(real)]))
        m["real_bpt"], m["real_pack_us"] = float(hit[1]), float(hit[2])
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the revision to compare this tree with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--real", type=Path, help="a finished run's episodes folder (its segments, any format)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.base], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        real = None
        if args.real is not None:
            real = Path(tmp) / "real.msgpack"
            episodes, tokens = dump_real(args.real, real)
            print(f"real episodes: {episodes} ({tokens} policy tokens) from {args.real}")
        results: dict[str, list[dict]] = {"base": [], "head": []}
        for k in range(args.rounds):
            for label, tree in (("base", base), ("head", ROOT)):
                results[label].append(measure(tree, real))
                print(f"round {k + 1} {label}: {results[label][-1]}", flush=True)
    load = os.getloadavg()
    med = {label: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for label, rs in results.items()}
    print(f"\nmedians over {args.rounds} rounds, {args.base} -> this tree (head/base):")
    for key in med["head"]:
        print(f"  {key}: {med['base'][key]:.2f} -> {med['head'][key]:.2f} ({med['head'][key] / med['base'][key]:.3f})")
    print(f"load average {load_before[0]:.2f} before, {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    rows = [
        {
            "what": f"archiver CPU per episode moved, {args.base} -> this tree (bench/archiver_cpu.py)",
            "value": f"{med['base']['archiver_us']:.0f} -> {med['head']['archiver_us']:.0f} us",
        },
        {
            "what": "archiver start: its first move (64 episodes, one-time costs), CPU",
            "value": f"{med['base']['start_first_move_ms']:.0f} -> {med['head']['start_first_move_ms']:.0f} ms",
        },
        {
            "what": "segment B per policy token, synthetic 256-token episodes",
            "value": f"{med['base']['synthetic_256_bpt']:.2f} -> {med['head']['synthetic_256_bpt']:.2f}",
        },
    ]
    if "real_bpt" in med["head"]:
        rows.append(
            {
                "what": "segment B per policy token, the real default run's episodes (re-written)",
                "value": f"{med['base']['real_bpt']:.2f} -> {med['head']['real_bpt']:.2f}",
            }
        )
    record(
        "segments_ab",
        rows,
        [
            "services/archiver",
            "shared/protocol/archive/segments.py",
            "shared/protocol/archive/entries.py",
            "shared/protocol/archive/columns.py",
            "shared/protocol/archive/templates.py",
            "shared/protocol/archive/arrays.py",
            "shared/protocol/archive/summary.py",
            "shared/protocol/archive/builder.py",
        ],
        extra={
            "base": args.base,
            "rounds": results,
            "medians": med,
            "load_average_before": load_before,
            "load_average": load,
        },
    )


if __name__ == "__main__":
    main()

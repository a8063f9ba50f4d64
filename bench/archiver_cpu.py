"""The archiver's CPU per episode moved, alone: default-shape episodes (a 4-token prompt shared by a group of 8, one
``tokens`` entry of 1-4 tokens, ``finished``) written by the real EpisodeLog to a scratch Redis, their groups
published and committed, then one ``Mover.step`` moves them all into segments; the process CPU seconds of that step
per episode (``time.process_time``, far less load-sensitive than wall time), optionally under cProfile.

    python bench/archiver_cpu.py [--episodes 4000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from bench.runs import scratch_server  # noqa: E402
from services.archiver.mover import Mover  # noqa: E402
from shared.protocol.archive import segments
from shared.protocol.archive.ledger import append_ledger  # noqa: E402
from shared.protocol.episode.log import EpisodeLog  # noqa: E402
from shared.protocol.episode.sampling import episode_seed  # noqa: E402
from shared.protocol.keys import Keys  # noqa: E402
from shared.protocol.streams import samples  # noqa: E402
from shared.runtime.connection import connect  # noqa: E402

GROUP = 8
SEED = 0


def write_run(client, keys: Keys, run_path: Path, n_episodes: int, rng, first: int = 0) -> int:
    """Default-shape episodes, one group per version from group ``first`` on, every group published and
    committed; returns tokens."""
    log = EpisodeLog(client, keys, "w0")
    tokens = 0
    for g in range(first, first + -(-n_episodes // GROUP)):
        group_id, version = f"q{g:06d}", g + 1
        prompt = rng.integers(3, 500, 4).tolist()
        eids = [f"{group_id}-{i}" for i in range(GROUP)]
        for i, eid in enumerate(eids):
            log.open(eid)
            sampling = {
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "max_tokens": 8,
                "stop_token_ids": [2],
                "seed": episode_seed(SEED, group_id, i),
            }
            log.append(
                eid,
                "started",
                {
                    "episode_id": eid,
                    "group_id": group_id,
                    "index": i,
                    "prompt_ids": prompt,
                    "sampling": sampling,
                    "task": {"answer": "7"},
                },
                version,
            )
            n = int(rng.integers(1, 5))
            tokens += n
            log.append_tokens(eid, rng.integers(3, 500, n).tolist(), (-rng.exponential(0.5, n)).tolist(), version)
            log.append(eid, "finished", {"reason": "stop", "reward": float(rng.integers(0, 2)), "details": {}}, version)
            log.flush_or_raise([eid])
            log.close(eid)
        client.xadd(keys.samples, samples.encode(samples.Sample(group_id, eids, "w0")))
        append_ledger(
            run_path / "trainer",
            {"commit": version, "version": version, "step": version, "groups": [group_id], "skipped": []},
        )
    # one commit more, so that with retention 1 every group above is due
    append_ledger(run_path / "trainer", {"commit": g + 2, "version": g + 2, "step": g + 2, "groups": [], "skipped": []})
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=4000)
    ap.add_argument("--profile", action="store_true", help="print the step's cProfile, top 25 by own time")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with scratch_server() as (tmp, url, _):
        client = connect(url)
        keys, run_path = Keys("bench"), Path(tmp) / "run"
        mover = Mover(client, keys, run_path, retention=1, seed_base=SEED)
        write_run(client, keys, run_path, 8 * GROUP, rng)
        # warm up: the first segment pays one-time imports (pyarrow's pandas glue)
        mover.step()
        tokens = write_run(client, keys, run_path, args.episodes, rng, first=8)
        prof = cProfile.Profile() if args.profile else None
        cpu, wall = time.process_time(), time.perf_counter()
        if prof:
            prof.enable()
        moved = mover.step()
        if prof:
            prof.disable()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        left = sum(1 for _ in client.scan_iter(keys.episode("*"), count=1000))
        sizes = mover.store.sizes()
        first = segments.read_manifest(mover.folder)[0]
        sizes = {k: sizes[k] - first[k] for k in ("bytes", "tokens", "episodes")}
    load = os.getloadavg()
    print(
        f"moved {moved} episodes ({left} streams left): {1e6 * cpu / moved:.0f} us CPU per episode "
        f"({1e6 * wall / moved:.0f} us wall); segments {sizes['bytes'] / sizes['tokens']:.2f} B per policy token, "
        f"{sizes['bytes'] / sizes['episodes']:.1f} B per episode; load average {load[0]:.2f}"
    )
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    record(
        "archiver_cpu",
        [
            {
                "what": "archiver CPU per episode moved (default-shape episodes, one step)",
                "value": f"{1e6 * cpu / moved:.0f} us",
            },
        ],
        [
            "services/archiver",
            "shared/protocol/archive/segments.py",
            "shared/protocol/archive/entries.py",
            "shared/protocol/archive/templates.py",
            "shared/protocol/archive/arrays.py",
            "shared/protocol/archive/summary.py",
            "shared/protocol/archive/builder.py",
        ],
        simulated="default-shape episodes written by the real EpisodeLog (random ids and log-probs)",
        extra={
            "load_average": load,
            "episodes": moved,
            "tokens": tokens,
            "cpu_s": cpu,
            "wall_s": wall,
            "segment_bytes": sizes["bytes"],
        },
    )


if __name__ == "__main__":
    main()

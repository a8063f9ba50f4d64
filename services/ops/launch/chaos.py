"""`streamrl run --chaos SECONDS`: while the run goes, kill -9 one randomly chosen process every SECONDS, to show
that a run survives crashes by itself (each Procfile line runs under `streamrl keep`; the embedded Redis is
watched by the runner).

Victims: every process of the run (the ``keep`` pid files: rollout workers, tools, trainer, syncer, driver, and
in agent runs the gateway and the agents workers) and the embedded Redis, unless ``--chaos-only`` names the kinds
(``rollout,trainer,redis``). A process is killed with its whole process group (its own children too); the kill
lands wherever the process is (mid-step, mid-commit, mid-call). The choice is seeded (``--chaos-seed``). Chaos
stops once the driver has ended the run, so the warm shutdown and the end-of-run check see every final record.

A process killed again within 10 s of each restart, six times in a row, counts as a crash loop and stops the run
(services/ops/launch/keep.py): with ``--chaos-only`` one slow-starting kind, keep SECONDS above its start-up time.

At the end, beside the check: kills per process, restarts, and the time from each kill to the next version
published (``summary``, pure).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.protocol.archive import jsonl


@dataclass
class Kill:
    # unix seconds
    at: float
    target: str


@dataclass
class Chaos:
    every_s: float
    seed: int = 0
    # process kinds (the name before '.'); empty: every process
    only: frozenset[str] = frozenset()
    kills: list[Kill] = field(default_factory=list)

    def choose(self, rng: random.Random, candidates: list[str]) -> str | None:
        """One victim among ``candidates`` (names), those ``only`` allows; None when there is none."""
        allowed = sorted(c for c in candidates if not self.only or c.split(".")[0] in self.only)
        return rng.choice(allowed) if allowed else None

    def start(
        self, stop: threading.Event, processes, server=None, ended=lambda: False, out=None, mark=lambda pid: None
    ) -> threading.Thread:
        """The killing thread: every ``every_s`` until ``stop`` is set or ``ended()``. ``processes()`` gives
        {name: (pid, restarts)} (``keep.processes``); ``server``: the run's EmbeddedRedis, a victim named redis;
        ``mark(pid)`` is called before a process is killed (``keep.mark_injected``: its keeper does not take a
        kill every few seconds for a crash loop)."""
        rng = random.Random(self.seed)

        def loop() -> None:
            while not stop.wait(self.every_s) and not ended():
                procs = {name: pid for name, (pid, _) in processes().items()}
                names = list(procs) + (["redis"] if server is not None and server.proc.poll() is None else [])
                victim = self.choose(rng, names)
                if victim is None:
                    continue
                try:
                    if victim == "redis":
                        os.kill(server.proc.pid, signal.SIGKILL)
                    else:
                        mark(procs[victim])
                        os.killpg(procs[victim], signal.SIGKILL)
                except ProcessLookupError:
                    # it was between restarts: pick again next time
                    continue
                self.kills.append(Kill(time.time(), victim))
                if out is not None:
                    print(f"chaos: kill -9 {victim}", file=out, flush=True)

        thread = threading.Thread(target=loop, daemon=True, name="chaos")
        thread.start()
        return thread


def version_times(run_path: Path, steps_per_version: int) -> list[float]:
    """Unix seconds of each version the trainer made, in order, from the run's metrics file: every training step's
    record is there (the ``versions`` stream keeps only its last entries), and a version is published right after
    the record of the step that makes it."""
    steps = [r for r in jsonl.read(run_path / "metrics.jsonl", "the trainer's metrics file") if "train_s" in r]
    return sorted(float(r["time"]) for r in steps if int(r["step"]) % steps_per_version == 0)


def summary(chaos: Chaos, version_times: list[float], restarts: dict[str, int], seconds: float) -> list[str]:
    """Lines for the end of the run. ``version_times``: unix seconds of each published version, in order."""
    per: dict[str, int] = {}
    for k in chaos.kills:
        per[k.target] = per.get(k.target, 0) + 1
    lines = [
        f"chaos: {len(chaos.kills)} kills in {seconds:.0f} s (one every {chaos.every_s:g} s, seed {chaos.seed})"
        + (": " + ", ".join(f"{n} {c}" for n, c in sorted(per.items())) if per else "")
    ]
    restarted = {n: r for n, r in sorted(restarts.items()) if r}
    lines.append("  restarts: " + (", ".join(f"{n} {r}" for n, r in restarted.items()) or "none"))
    # process kind -> seconds from each of its kills to the next version
    waits: dict[str, list[float]] = {}
    for k in chaos.kills:
        after = next((t for t in version_times if t > k.at), None)
        if after is not None:
            waits.setdefault(k.target.split(".")[0], []).append(after - k.at)
    every = [w for ws in waits.values() for w in ws]
    if every:
        lines.append(
            f"  kill to the next version: median {statistics.median(every):.1f} s, max {max(every):.1f} s "
            f"({len(every)} of {len(chaos.kills)} kills were followed by a version)"
        )
        lines.append(
            "  by process: "
            + ", ".join(
                f"{kind} median {statistics.median(ws):.1f} s, max {max(ws):.1f} s"
                for kind, ws in sorted(waits.items())
            )
        )
    return lines


KINDS = ("rollout", "tools", "trainer", "syncer", "driver", "redis", "gateway", "agents")


def add_arguments(p) -> None:
    p.add_argument(
        "--chaos",
        type=float,
        nargs="?",
        const=5.0,
        default=None,
        metavar="SECONDS",
        help="kill -9 a random process of the run (Redis included) every SECONDS (default 5) while it "
        "goes; a chaos summary follows the end-of-run check (services/ops/launch/chaos.py)",
    )
    p.add_argument("--chaos-seed", type=int, default=0, metavar="N", help="seed of --chaos's choices (default 0)")
    p.add_argument(
        "--chaos-only",
        default="",
        metavar="KINDS",
        help=f"--chaos kills only these, comma-separated: {','.join(KINDS)} (default: all)",
    )


def from_args(args) -> Chaos | None:
    """The ``Chaos`` that ``--chaos`` asks for, or None; ValueError naming the flag for a bad value."""
    if args.chaos is None:
        return None
    if not args.chaos > 0:
        raise ValueError(f"--chaos: expected seconds > 0 between kills, got {args.chaos:g}")
    only = frozenset(k for k in args.chaos_only.split(",") if k)
    if only - set(KINDS):
        raise ValueError(
            f"--chaos-only: unknown kinds {', '.join(sorted(only - set(KINDS)))}; expected some of {', '.join(KINDS)}"
        )
    return Chaos(args.chaos, args.chaos_seed, only)

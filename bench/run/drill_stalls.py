"""The stall drills, repeated on one live run (real processes, the embedded Redis, sync_mode rolling).

1. Rolling stall: each try waits for a wave's ``pause`` naming one worker, stops that worker (SIGSTOP) at once,
   waits until the gate is complete past the wave's version (the syncer went on without it), and wakes it
   (SIGCONT). The worker then
   meets the queued pause / load / resume of the older wave after catching up on the newer version: it must ack
   and ignore them, never loading the older version.
2. Redis restart after a stall: a worker is stopped for 1.3 heartbeat_ttl (long enough for the others to note
   its heartbeat missing, not long enough to take its groups), woken, and then the Redis server is killed
   (kill -9) and started again on the same data. Every heartbeat lapses at once; the worker is alive and must
   keep its groups: no ``resumed`` with ``takeover_from`` naming it after the restart.

At the end `streamrl check`'s counts on the whole run (``loads_backwards`` among them) and, independently of
the acks, each worker's token versions read from the episode streams in write order (they never go down).

    python bench/run/drill_stalls.py [--tries 20] [--redis-tries 3]

Wall time on the 2-core box: about 20 s a try. Prints one line per try and a summary; exit 1 when a count that
must be zero is not.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.ops.check.checker import check, format_report, read_run  # noqa: E402
from services.ops.launch.tiny_model import make_tiny_model  # noqa: E402
from shared.protocol import gate  # noqa: E402
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import decode  # noqa: E402
from shared.protocol.streams import control
from tests.support.fault_run import LiveRun  # noqa: E402

TTL = 2.0


def _signal(run: LiveRun, name: str, sig) -> None:
    os.killpg(run.procs[name].pid, sig)


def _entries_after(run: LiveRun, cursor: str):
    return control.read_after(run.client, run.keys, cursor, count=1000)


def _token_events(run: LiveRun):
    """(entry id, worker, policy version, resumed takeover_from) of every tokens / resumed event, all streams."""
    out = []
    for key in run.client.scan_iter(match=run.keys.episode("*"), count=1000, _type="stream"):
        for entry_id, fields in run.client.xrange(key):
            try:
                ev = decode(entry_id.decode(), {k.decode(): v for k, v in fields.items()})
            except EventError:
                continue
            if ev.kind in ("tokens", "resumed"):
                ms, _, seq = entry_id.decode().partition("-")
                out.append(((int(ms), int(seq)), ev.kind, ev.worker, ev.policy, ev.data.get("takeover_from")))
    return sorted(out)


def rolling_stall(run: LiveRun, cursor: str, newer_than: int) -> tuple[str, str, int]:
    """One try, on the first wave for a version after ``newer_than``; returns (what happened, the control cursor
    after it, the version the worker was woken at)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for entry_id, entry in _entries_after(run, cursor):
            cursor = entry_id
            if (
                isinstance(entry, control.Command)
                and entry.cmd == "pause"
                and len(entry.targets) == 1
                and entry.version > newer_than
                and entry.targets[0] in run.procs
            ):
                victim, v = entry.targets[0], entry.version
                _signal(run, victim, signal.SIGSTOP)
                # the wave goes on without it (sync_timeout), and the next one too: the gate a version ahead
                try:
                    run.wait(
                        lambda: (gate.complete_version(run.client, run.keys) or 0) > v,
                        f"the gate complete past v{v}",
                        timeout=120,
                    )
                finally:
                    _signal(run, victim, signal.SIGCONT)
                now = gate.complete_version(run.client, run.keys)
                return f"{victim} stopped on the pause of v{v}, woken with the gate complete at v{now}", cursor, now
        time.sleep(0.05)
        run.check_alive()
    raise AssertionError("no wave pause naming one worker within 120 s")


def redis_after_stall(run: LiveRun, victim: str) -> int:
    """One try; the takeovers of ``victim``'s episodes after the Redis restart."""
    _signal(run, victim, signal.SIGSTOP)
    time.sleep(1.3 * TTL)
    _signal(run, victim, signal.SIGCONT)
    time.sleep(0.5)
    before = sum(1 for _, kind, _, _, frm in _token_events(run) if kind == "resumed" and frm == victim)
    run.redis_kill()
    time.sleep(0.5)
    run.redis_start()
    run.wait_version(run.version() + 2, timeout=120)
    time.sleep(2 * TTL)
    return sum(1 for _, kind, _, _, frm in _token_events(run) if kind == "resumed" and frm == victim) - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--redis-tries", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="drill-stalls-"))
    model = make_tiny_model(str(root / "model"))
    run = LiveRun(
        root,
        run="stalls",
        model_dir=model,
        tools="",
        max_tokens=48,
        group_size=2,
        batch_groups=2,
        max_staleness=1,
        sync_mode="rolling",
        max_loading=1,
        sync_timeout=3.0,
        fetch_timeout=10.0,
        flush_tokens=8,
        flush_ms=100.0,
        step_delay_ms=20.0,
        heartbeat_ttl=TTL,
        max_groups_in_flight=4,
        max_minutes=30.0,
        max_versions=100_000,
        val_every=0,
        log_level="info",
    )
    failures = 0
    try:
        run.start(rollout_workers=3)
        run.wait_version(1)
        cursor, woken = "0-0", 0
        for i in range(args.tries):
            what, cursor, woken = rolling_stall(run, cursor, woken)
            print(f"rolling stall {i + 1}/{args.tries}: {what}", flush=True)
        for i in range(args.redis_tries):
            victim = run.names("rollout")[i % 3]
            taken = redis_after_stall(run, victim)
            failures += taken > 0
            print(
                f"redis restart {i + 1}/{args.redis_tries}: {victim} stalled 1.3 ttl before it; "
                f"its episodes taken over after the restart: {taken}",
                flush=True,
            )
        run.stop()
        events = _token_events(run)
        newest: dict[str, int] = {}
        down = 0
        for _, kind, worker, policy, _ in events:
            if kind == "tokens":
                down += policy < newest.get(worker, -1)
                newest[worker] = max(newest.get(worker, -1), policy)
        report = check(read_run(run.client, run.keys, run.cfg.run_path, cfg=run.cfg))
        print(format_report(report, run.cfg.run))
        print(f"token batches written at an older version than the same worker wrote before: {down}")
        failures += (not report.ok) + (down > 0)
    finally:
        run.close()
    print("drill: ok" if not failures else f"drill: FAILED ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

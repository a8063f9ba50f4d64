"""Fault drills on live runs: real processes (embedded Redis with append-only
persistence, two rollout workers, an rq tools worker, trainer, syncer,
driver), each process kind killed with kill -9 mid-work and restarted as a
supervisor would, garbage written into every stream a person can reach, and
the Redis server stopped and restarted. After each run, `streamrl check`'s
counts (services/ops/check/checker.py) must be 0, and the tokens generated again after a
rollout worker kill must be exactly the tokens it had not flushed, at most
one flush interval per episode in flight.

docs/faults.md describes the drills and the checker's definitions.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import msgpack
import pytest

from services.ops.check.checker import check, format_report, read_run
from services.ops.check.report import MUST_BE_ZERO
from services.ops.launch.redis_server import find_binary
from services.ops.launch.tiny_model import make_tiny_model
from shared.protocol.episode import events
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold
from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP
from shared.protocol.streams import control, dead_letters, prompts
from tests.support.fault_run import LiveRun
from tests.support.models import overfit

# a few live runs on a shared 2-core box
pytestmark = [pytest.mark.slow(seconds=35), pytest.mark.timeout(900)]

FLUSH_TOKENS = 8
MAX_VERSIONS = 10
TOOL_SECONDS = 0.4
# the fault itself: how long the Redis server is away before it starts again
REDIS_DOWN_S = 1.0


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    """A tiny model overfit to call the (slow) sleep tool before answering, so tool jobs are in flight."""
    import torch

    texts = [
        (f"{a}+{b}=", f"<call>sleep: {TOOL_SECONDS}</call><result>{TOOL_SECONDS}</result>answer: 7")
        for a, b in [(1, 2), (3, 4), (5, 5), (9, 0), (2, 8), (6, 1)]
    ]
    out = tmp_path_factory.mktemp("tool-model")
    make_tiny_model(str(out), seed=1)
    threads = torch.get_num_threads()
    # a busy 2-core box: more threads only fight each other
    torch.set_num_threads(1)
    try:
        return overfit(out, texts, steps=80, lr=1e-2)
    finally:
        torch.set_num_threads(threads)


def _dataset(root: Path) -> str:
    rng = random.Random(1)
    path = root / "sums.jsonl"
    with open(path, "w") as fh:
        for _ in range(400):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            fh.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return str(path)


def _config(root: Path, model_dir: str, run: str, **kw) -> dict:
    return {
        "run": run,
        "model_dir": model_dir,
        "dataset": _dataset(root),
        "tools": "tests.support.debug_tools:sleep,calc",
        "tool_timeout": 1.0,
        "max_tokens": 48,
        "group_size": 2,
        "batch_groups": 2,
        "max_staleness": 1,
        "flush_tokens": FLUSH_TOKENS,
        "flush_ms": 250.0,
        "step_delay_ms": 25.0,
        "heartbeat_ttl": 2.0,
        "max_groups_in_flight": 4,
        "sync_timeout": 10.0,
        "max_minutes": 4.0,
        "log_level": "info",
        "val_every": 0,
        **kw,
    }


def _redis_cli(run: LiveRun, *args: str, stdin: bytes | None = None) -> str:
    """What a person types: redis-cli (valkey-cli) against the run's server."""
    server = Path(find_binary())
    cli = next(p for p in (server.with_name("valkey-cli"), server.with_name("redis-cli")) if p.exists())
    out = subprocess.run(
        [str(cli), "-p", str(run.server.port), *args], input=stdin, capture_output=True, timeout=30, check=True
    )
    return out.stdout.decode().strip()


def _heartbeat(run: LiveRun, name: str) -> dict:
    return {k.decode(): v.decode() for k, v in run.client.hgetall(run.keys.alive("rollout", name)).items()}


def _stall(run: LiveRun, name: str) -> None:
    """SIGSTOP: the process stalls (a long GC pause, a swapped-out VM) without dying."""
    os.killpg(run.procs[name].pid, signal.SIGSTOP)


def _wake(run: LiveRun, name: str) -> None:
    os.killpg(run.procs[name].pid, signal.SIGCONT)


def _pending_of(run: LiveRun, consumer: str) -> int:
    consumers = run.client.xinfo_consumers(run.keys.prompts, ROLLOUT_GROUP)
    return sum(c["pending"] for c in consumers if c["name"].decode() == consumer)


def _tool_jobs_started(run: LiveRun) -> int:
    from rq import Queue
    from rq.serializers import JSONSerializer

    queue = Queue(f"tools-{run.cfg.run}", connection=run.client, serializer=JSONSerializer)
    return queue.started_job_registry.count


def _inject_garbage(run: LiveRun) -> dict[str, list[tuple[str, str]]]:
    """Garbage in prompts, samples, a future episode stream and control; returns {stream: [(entry, why)]}."""
    k = run.keys
    got: dict[str, list[tuple[str, str]]] = {k.prompts: [], k.samples: [], k.control: []}
    got[k.prompts].append((_redis_cli(run, "XADD", k.prompts, "*", "hello", "world"), "group_id"))
    got[k.prompts].append(
        (
            _redis_cli(run, "XADD", k.prompts, "*", "group_id", "junk1", "n", "2", "v", "7", "data", "x"),
            "schema version",
        )
    )
    got[k.prompts].append(
        (
            _redis_cli(
                run, "-x", "XADD", k.prompts, "*", "group_id", "junk2", "n", "2", "data", stdin=b"\xc1\xff not msgpack"
            ),
            "msgpack",
        )
    )
    got[k.prompts].append(
        (
            run.client.xadd(k.prompts, {"group_id": "junk3", "n": "2", "data": msgpack.packb({"prompt": 42})}).decode(),
            "data.prompt",
        )
    )
    # well-formed entries with poison inside: a worker that met them crashed, and again on every restart
    got[k.prompts].append(
        (
            run.client.xadd(
                k.prompts,
                {
                    "group_id": "junk4",
                    "n": "2",
                    "v": "1",
                    "data": msgpack.packb({"prompt": "1+1=", "sampling": {"temperature": "hot"}}),
                },
            ).decode(),
            "data.sampling.temperature",
        )
    )
    got[k.calls] = [
        (
            run.client.xadd(
                k.calls,
                {
                    "episode_id": "nobody-0",
                    "call": "0",
                    "v": "1",
                    "data": msgpack.packb(
                        {
                            "digest": "d",
                            "extends": -1,
                            "prompt_ids": [1, 2],
                            "messages": "",
                            "sampling": {"max_tokens": 4, "temperature": float("nan")},
                        }
                    ),
                },
            ).decode(),
            "data.sampling.temperature",
        )
    ]
    got[k.samples].append((_redis_cli(run, "XADD", k.samples, "*", "garbage", "1"), "group_id"))
    got[k.samples].append((_redis_cli(run, "XADD", k.samples, "*", "group_id", "nope"), "episodes"))
    got[k.control].append(
        (_redis_cli(run, "XADD", k.control, "*", "type", "cmd", "cmd", "explode", "sync", "x"), "cmd")
    )
    got[k.control].append((_redis_cli(run, "XADD", k.control, "*", "type", "bogus"), "type"))
    got[k.control].append(
        (
            _redis_cli(run, "XADD", k.control, "*", "type", "cmd", "cmd", "load", "sync", "y", "version", "two"),
            "version",
        )
    )
    # an episode stream a worker will open later (the driver names groups by epoch and dataset position)
    opened = [k.episode_id(key) for key in run.client.scan_iter(match=k.episode("q*"), count=1000)]
    future = max(int(e.split("-")[1]) for e in opened) + 3
    episode = f"{prompts.group_id(0, future)}-1"
    got[k.episode(episode)] = [
        (
            _redis_cli(
                run,
                "XADD",
                k.episode(episode),
                "*",
                "type",
                "tokens",
                "v",
                "9",
                "policy",
                "0",
                "worker",
                "someone",
                "seq",
                "0",
                "data",
                "zz",
            ),
            "schema version",
        )
    ]
    return got


@pytest.fixture(scope="module")
def process_drill(tmp_path_factory, tool_model):
    """One live run; kill -9 a rollout worker, the tools worker, the trainer and the syncer, one after the
    other, restarting each; garbage injected early. Returns what happened and the checker's report."""
    root = tmp_path_factory.mktemp("drill")
    run = LiveRun(root, **_config(root, tool_model, "drill", max_versions=MAX_VERSIONS)).start()
    seen: dict = {"times": {}}
    t0 = time.monotonic()

    def mark(what: str) -> None:
        seen["times"][what] = round(time.monotonic() - t0, 1)

    try:
        run.wait_version(1)
        mark("version 1")
        seen["garbage"] = _inject_garbage(run)

        # 1. a rollout worker, mid-episode: its unflushed tokens die with it; another worker takes over
        victim = run.wait(
            lambda: next((w for w in run.names("rollout") if int(_heartbeat(run, w).get("episodes", 0)) >= 2), None),
            "a rollout worker with episodes in flight",
            poll=0.01,
        )
        seen["probe"] = run.probe_and_kill(victim)
        run.spawn("rollout")
        run.wait(lambda: _pending_of(run, victim) == 0, f"takeover of {victim}'s groups")
        mark("rollout worker killed and taken over")

        # 2. the tools worker, with a tool job running
        # the count the wait saw (a second read could find the 0.4 s job already done on a busy box)
        seen["tool_jobs_at_kill"] = run.wait(lambda: _tool_jobs_started(run), "a tool job running", poll=0.01)
        run.kill("tools-1")
        run.spawn("tools")
        mark("tools worker killed")

        # 3. the trainer, holding groups delivered to it and not yet committed (mid-batch or mid-step)
        v = run.wait_version(run.version() + 1)
        run.wait(
            lambda: run.client.xpending(run.keys.samples, TRAINER_GROUP)["pending"] > 0,
            "the trainer holding uncommitted groups",
            poll=0.01,
        )
        run.kill("trainer-1")
        seen["trainer_killed_at"] = v
        run.spawn("trainer")
        mark("trainer killed")

        # 4. the syncer, dead between its pause and its resume: workers are left paused
        run.wait_version(run.version() + 1)
        run.kill("syncer-1")
        run.client.xadd(run.keys.control, control.encode_command(control.Command("pause", "dead-syncer")))
        workers = run.names("rollout")
        run.wait(lambda: all(_heartbeat(run, w).get("paused") == "1" for w in workers), "workers paused")
        seen["paused_at"] = run.version()
        run.spawn("syncer")
        run.wait_version(seen["paused_at"] + 1, timeout=90)
        mark("syncer killed, paused workers resumed")

        # 5. the Redis server: stopped (SIGTERM: it fsyncs the append-only file) and started again on the
        # same port and data; every process waits for it and goes on
        v = run.version()
        run.redis_stop()
        # not a wait for anything: the length of the outage under test
        time.sleep(REDIS_DOWN_S)
        run.redis_start()
        run.wait_version(v + 1, timeout=90)
        mark("redis restarted")

        run.wait(lambda: run.procs["driver-1"].poll() is not None, "the driver ending the run", timeout=180)
        seen["driver_rc"] = run.procs["driver-1"].returncode
        seen["final_version"] = run.version()
        mark("run ended")
        seen["exit_codes"] = run.stop()
        seen["report"] = check(read_run(run.client, run.keys, run.cfg.run_path))
        seen["dead"] = [asdict(d) for d in dead_letters.read_all(run.client, run.keys)]
        seen["run"] = run
        print(format_report(seen["report"], run.cfg.run), seen["times"], seen["probe"])
        yield seen
    finally:
        run.close()


def _warm_stops_exit_0(seen) -> None:
    """Every process still running at the end stopped warm (SIGTERM) with exit code 0."""
    killed = seen["run"].expected_dead if "run" in seen else set()
    bad = {name: code for name, code in seen["exit_codes"].items() if name not in killed and code != 0}
    assert not bad, bad


def test_kill_9_each_process_kind_loses_nothing(process_drill):
    seen = process_drill
    report, probe = seen["report"], seen["probe"]
    assert seen["driver_rc"] == 0 and seen["final_version"] >= MAX_VERSIONS
    _warm_stops_exit_0(seen)
    # every count that must be 0 is, but one: the episode stream poisoned from outside cannot be replayed (its bad
    # entry is dead-lettered), and the check names it and no other
    assert all(getattr(report, k) in (0, None) for k in MUST_BE_ZERO if k != "episodes_unreadable"), format_report(
        report, "drill"
    )
    poisoned = [seen["run"].keys.episode_id(key) for key in seen["garbage"] if ":ep:" in key]
    assert [line.split(" ")[0] for line in report.details["episodes_unreadable"]] == poisoned
    assert report.groups_lost == report.episodes_finished_twice == report.samples_trained_twice == 0
    # no Redis crash here: every trained episode is finished in its stream
    assert report.trained_unfinished == 0
    # the rollout kill: the only tokens generated twice are the ones it had not flushed, <= one flush per episode
    assert probe["in_flight"] >= 1
    assert report.tokens_generated_again == probe["unflushed_tokens"], report.details["tokens_generated"]
    assert probe["unflushed_tokens"] <= FLUSH_TOKENS * probe["in_flight"]
    # its episodes continued from their streams on another worker
    assert report.takeovers >= 1
    assert seen["tool_jobs_at_kill"] >= 1
    assert report.groups_trained >= 2 * MAX_VERSIONS


def test_garbage_in_every_stream_is_dead_lettered_and_the_run_goes_on(process_drill):
    seen = process_drill
    # the run went on to the end
    assert seen["driver_rc"] == 0 and seen["final_version"] >= MAX_VERSIONS
    assert seen["report"].bad_input_not_dead_lettered == 0
    for stream, entries in seen["garbage"].items():
        for entry_id, why in entries:
            letters = [
                d
                for d in seen["dead"]
                if d["stream"] == stream and (d["entry"] == entry_id or stream.rsplit(":", 2)[-2] == "ep")
            ]
            assert letters, f"no dead letter for {stream} {entry_id}"
            assert any(why in d["reason"] for d in letters), (why, letters)


def _episode_entries(run: LiveRun) -> dict[str, list[tuple[str, int]]]:
    """Episode id -> [(entry id, policy tokens in it)] for every episode stream of the run."""
    out = {}
    for key in run.client.scan_iter(match=run.keys.episode("*"), count=1000):
        entries = []
        for entry_id, f in run.client.xrange(key):
            try:
                ev = events.decode(entry_id, f)
            except EventError:
                # a garbage entry this drill wrote: no policy tokens
                ev = None
            entries.append((entry_id.decode(), len(ev.data["ids"]) if ev is not None and ev.kind == "tokens" else 0))
        out[run.keys.episode_id(key)] = entries
    return out


@pytest.fixture(scope="module")
def redis_crash_drill(tmp_path_factory, tool_model):
    """A live run whose Redis server crashes twice mid-generation, losing its last second of writes (the
    append-only file is cut back one second: appendfsync everysec on a machine crash), and starts again."""
    root = tmp_path_factory.mktemp("redis-drill")
    run = LiveRun(root, **_config(root, tool_model, "crash", max_versions=8, flush_ms=100.0)).start()
    seen: dict = {"lost": []}
    try:
        run.wait_version(1)
        for round_ in range(2):
            run.wait(
                lambda: sum(int(_heartbeat(run, w).get("episodes", 0)) for w in run.names("rollout")) >= 4,
                "episodes in flight",
            )
            snap: dict = {}
            cut_ms, cut_bytes = run.redis_crash(1.0, before_kill=lambda: snap.update(_episode_entries(run)))
            after = _episode_entries(run)
            lost = [
                (eid, entry_id, n)
                for eid, entries in snap.items()
                for entry_id, n in entries
                if entry_id not in {e for e, _ in after.get(eid, [])}
            ]
            seen["lost"].append({"cut_ms": cut_ms, "bytes": cut_bytes, "entries": lost})
            run.wait_version(run.version() + 2, timeout=120)
        run.wait(lambda: run.procs["driver-1"].poll() is not None, "the driver ending the run", timeout=180)
        seen["driver_rc"] = run.procs["driver-1"].returncode
        seen["final_version"] = run.version()
        seen["exit_codes"] = run.stop()
        seen["report"] = check(read_run(run.client, run.keys, run.cfg.run_path))
        seen["run"] = run
        print(format_report(seen["report"], run.cfg.run), [(len(x["entries"]), x["bytes"]) for x in seen["lost"]])
        yield seen
    finally:
        run.close()


def test_redis_crash_loses_at_most_the_last_second_and_it_is_regenerated(redis_crash_drill):
    seen = redis_crash_drill
    report = seen["report"]
    assert seen["driver_rc"] == 0 and seen["final_version"] >= 8
    _warm_stops_exit_0(seen)
    assert report.ok, format_report(report, "crash")
    # the crashes did lose episode events
    assert sum(len(crash["entries"]) for crash in seen["lost"]) > 0
    # and only those of the last second
    for crash in seen["lost"]:
        for eid, entry_id, _ in crash["entries"]:
            assert int(entry_id.split("-")[0]) >= crash["cut_ms"] - 50, (eid, entry_id, crash["cut_ms"])
    # lost tails were detected (the fence) and continued from the stream
    assert report.tail_resumes >= 1
    lost_tokens = sum(n for crash in seen["lost"] for _, _, n in crash["entries"])
    # workers x max_groups_in_flight x group_size: each may hold unflushed tokens
    in_flight = 2 * 4 * 2
    assert report.tokens_generated_again is not None
    assert report.tokens_generated_again <= lost_tokens + 2 * FLUSH_TOKENS * in_flight


@pytest.mark.slow
def test_stalled_worker_wakes_fenced_and_the_taker_stalls_too(tmp_path, tool_model):
    """a rollout worker stalls (SIGSTOP) past heartbeat_ttl holding groups; the other claims them and
    stalls right after its claim; the first wakes (and takes them back), then the second wakes, fenced. No
    process exits with an error, no episode fails, no traceback in any log, and the checker counts 0."""
    # max_versions well past what the drill needs: the run must not end before (or while) the workers stall
    run = LiveRun(tmp_path, **_config(tmp_path, tool_model, "stall", max_versions=60)).start()
    try:
        run.wait_version(1)
        first, second = run.names("rollout")
        run.wait(
            lambda: int(_heartbeat(run, first).get("groups", 0)) >= 1 and _pending_of(run, first) >= 1,
            f"{first} holding groups",
            poll=0.01,
        )
        _stall(run, first)
        held = _pending_of(run, first)
        run.wait(lambda: _pending_of(run, first) == 0, f"{second} claiming {first}'s {held} groups", poll=0.01)
        # right after its claim
        _stall(run, second)
        _wake(run, first)
        run.wait(lambda: _pending_of(run, second) == 0, f"{first} taking its groups back from {second}", poll=0.05)
        _wake(run, second)
        woke_at = run.version()
        # training goes on after both woke
        run.wait_version(woke_at + 2, timeout=120)
        # warm stop of every process (groups still in flight are not lost)
        codes = run.stop()
        report = check(read_run(run.client, run.keys, run.cfg.run_path))
        failed = [
            key
            for key in run.client.scan_iter(match=run.keys.episode("*"), count=1000)
            if fold(run.client.xrange(key)).status == "failed"
        ]
        logs = {log.name: log.read_text(errors="replace") for log in run.logs}
        fenced = logs[f"{second}.log"].count("fenced: another worker owns this group now")
    finally:
        run.close()
    print(format_report(report, "stall"), codes, f"{second} fenced {fenced} times")
    assert all(code == 0 for code in codes.values()), codes
    assert not failed, failed
    assert not [name for name, text in logs.items() if "Traceback" in text], {
        name: text[text.index("Traceback") :][:2000] for name, text in logs.items() if "Traceback" in text
    }
    assert report.ok, format_report(report, "stall")
    assert report.takeovers >= 1

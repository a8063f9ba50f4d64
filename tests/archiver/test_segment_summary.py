"""A segment row's analysis columns come off its entry columns without a fold, and they are what the fold says;
an episode of another shape is folded instead. The archiver runs at the configured low CPU priority."""

from __future__ import annotations

import os

import pytest

from shared.protocol.archive import entries as segment_entries
from shared.protocol.archive import segments
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.sources import load
from tests.archiver.tiers_support import row_of

ANALYSIS = ["group_id", "worker", "status", "finish_reason", "reward", "num_generated", "version"]


def _write(log: EpisodeLog, eid: str, events: list[tuple[str, dict, int]]) -> None:
    log.open(eid)
    log.append(
        eid,
        "started",
        {
            "episode_id": eid,
            "group_id": eid.rsplit("-", 1)[0],
            "index": 1,
            "prompt_ids": [5, 6],
            "sampling": {"max_tokens": 8, "seed": 11},
        },
        1,
    )
    for kind, data, policy in events:
        if kind == "tokens":
            log.append_tokens(eid, data["ids"], data["logprobs"], policy)
        else:
            log.append(eid, kind, data, policy)
        log.flush_or_raise([eid])
    log.close(eid)


def _folded(entries) -> dict:
    ep = fold(entries)
    return {
        "group_id": ep.group_id,
        "worker": ep.last_worker,
        "status": ep.status,
        "finish_reason": ep.finish_reason,
        "reward": ep.reward,
        "num_generated": ep.num_generated,
        "version": max(ep.versions, default=-1),
    }


SHAPES = {
    "plain": [
        ("tokens", {"ids": [3, 4], "logprobs": [-0.5, 0.0]}, 2),
        ("finished", {"reason": "stop", "reward": 1, "details": {"x": 1}}, 2),
    ],
    "resumed": [
        ("tokens", {"ids": [3], "logprobs": [-0.5]}, 2),
        ("aborted", {"reason": "pause", "num_tokens": 1}, 2),
        ("resumed", {"num_tokens": 1}, 5),
        ("tokens", {"ids": [7, 8, 9], "logprobs": [-1.0] * 3}, 5),
        ("finished", {"reason": "length", "reward": 0.25}, 5),
    ],
    "tools": [
        ("tokens", {"ids": [3], "logprobs": [-0.5]}, 4),
        ("tool_call", {"call_id": "c", "name": "calc", "args": "1+1"}, 4),
        ("tool_result", {"call_id": "c", "ok": True, "output": "2", "ids": [9, 9]}, 4),
        ("tokens", {"ids": [3], "logprobs": [-0.5]}, 3),
        ("finished", {"reason": "stop", "reward": 0.0}, 3),
    ],
    "failed": [("tokens", {"ids": [3], "logprobs": [-0.5]}, 2), ("failed", {"error": "engine died"}, 2)],
    "no tokens": [("failed", {"error": "prompt too long", "where": "prompt"}, 0)],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_columns_summary_is_the_folds_without_a_fold(client, keys, shape):
    log = EpisodeLog(client, keys, "w7")
    _write(log, "g-1", SHAPES[shape])
    entries = client.xrange(keys.episode("g-1"))
    row = row_of("g-1", entries)
    assert segments.ended(segments.flat(entries))
    # the fast way, no fold
    assert segment_entries.Columns().add("g-1", segments.flat(entries)) is not None
    assert {k: row[k] for k in ANALYSIS} == _folded(entries)


def test_an_episode_of_another_shape_is_folded_and_one_not_ended_is_not_ended(client, keys):
    log = EpisodeLog(client, keys, "w7")
    _write(log, "g-2", [("tokens", {"ids": [3], "logprobs": [-0.5]}, 2)])
    entries = client.xrange(keys.episode("g-2"))
    assert not segments.ended(segments.flat(entries))
    row = row_of("g-2", entries)
    # not ended: the fold decides
    assert segment_entries.Columns().add("g-2", segments.flat(entries)) is None
    assert row["status"] == "running" == _folded(entries)["status"]
    # kept whole: the fold decides
    odd = entries + [(b"9999999999999-0", {b"type": b"finished", b"odd": b"1"})]
    row = row_of("g-2", odd)
    assert segment_entries.Columns().add("g-2", segments.flat(odd)) is None
    assert row["others"] and row["status"] == "" and row["group_id"] == ""


def test_archiver_nice_is_checked_and_the_archiver_lowers_its_priority(client, keys, redis_url, tmp_path):
    with pytest.raises(ConfigError, match="archiver_nice.*0..19"):
        load(env={}, overrides={"archiver_nice": "20"})
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.archiver",
            "--run",
            keys.run,
            "--run-dir",
            str(tmp_path),
            "--redis-url",
            redis_url,
            "--log-retention-versions",
            "2",
            "--archiver-nice",
            "7",
        ],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, nice = time.monotonic() + 60, None
        while time.monotonic() < deadline and proc.poll() is None:
            nice = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
            if nice == max(7, os.nice(0)):
                break
            time.sleep(0.2)
        assert nice == max(7, os.nice(0)), (nice, proc.poll())
    finally:
        proc.kill()
        proc.wait()

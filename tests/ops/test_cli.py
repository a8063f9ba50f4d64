"""The `streamrl` command as a person runs it: real subprocesses, real server."""

import json

import msgpack

from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import ROLLOUT_GROUP
from tests.support.helpers import finished, raw, started, tokens
from tests.support.procs import run_module


def streamrl(env, *args, stdin: bytes | None = None):
    return run_module("services.ops.cli.main", *args, env=env, input=stdin, timeout=60)


def test_hand_written_episode_replays(cli_env, keys):
    """docs/events.md's recipe: redis-cli -x with a msgpack payload per event."""
    key = keys.episode("e1")
    events = [
        (
            "started",
            {
                "episode_id": "e1",
                "group_id": "g1",
                "index": 0,
                "prompt_ids": [20, 21, 22],
                "sampling": {"max_tokens": 8},
                "task": {},
            },
        ),
        ("tokens", {"ids": [30, 31], "logprobs": [-0.5, -1.25]}),
        ("finished", {"reason": "stop", "reward": 1.0, "details": {}}),
    ]
    for seq, (kind, data) in enumerate(events):
        out = streamrl(
            cli_env,
            "redis-cli",
            "--",
            "-x",
            "XADD",
            key,
            "*",
            "type",
            kind,
            "v",
            "1",
            "policy",
            "0",
            "worker",
            "me",
            "seq",
            str(seq),
            "data",
            stdin=msgpack.packb(data),
        )
        assert out.returncode == 0, out.stderr
    out = streamrl(cli_env, "replay", "e1", "--no-text")
    assert out.returncode == 0, out.stderr
    text = out.stdout.decode()
    assert "status finished (stop), reward 1.000" in text and "2 tokens" in text and "v0:2" in text
    data = json.loads(streamrl(cli_env, "replay", "e1", "--json", "--no-text").stdout)
    assert data["tokens"] == [30, 31] and data["logprobs"] == [-0.5, -1.25] and data["versions"] == [0, 0]
    assert [e["kind"] for e in data["events"]] == ["started", "tokens", "finished"]


def test_garbage_entry_is_one_line_naming_it(cli_env, client, keys):
    entries = raw([started(), tokens(1, [1, 2]), finished(2)])
    key = keys.episode("e1")
    client.xadd(key, entries[0][1])
    bad_id = client.xadd(
        key, {"type": "tokens", "v": "1", "policy": "0", "worker": "x", "seq": "1", "data": b"\xc1garbage"}
    ).decode()
    out = streamrl(cli_env, "replay", "e1")
    err = out.stderr.decode().strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert bad_id in err and "'data'" in err


def test_unknown_episode_is_one_line(cli_env, keys):
    out = streamrl(cli_env, "replay", "nope")
    assert out.returncode == 2 and b"no episode 'nope'" in out.stderr and b"Traceback" not in out.stderr


def test_bad_config_flag_is_one_line(cli_env):
    out = streamrl(cli_env, "inspect", "--flush-ms", "never")
    assert out.returncode == 2 and out.stderr.decode().count("\n") == 1 and b"flush_ms" in out.stderr


def test_no_server_is_one_line(cli_env):
    env = {**cli_env, "REDIS_URL": "redis://127.0.0.1:1/0"}
    out = streamrl(env, "inspect")
    assert out.returncode == 3 and b"Traceback" not in out.stderr and b"no Redis answering" in out.stderr


def test_inspect_lists_streams_groups_and_pending(cli_env, client, keys):
    log = EpisodeLog(client, keys, "w")
    for e in ("a", "b"):
        log.open(e)
        log.append(e, "started", started(episode_id=e).data, 0)
    log.flush_or_raise()
    client.xadd(keys.prompts, {"group": "g1"})
    client.xadd(keys.prompts, {"group": "g2"})
    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="0")
    client.xreadgroup(ROLLOUT_GROUP, "w1", {keys.prompts: ">"}, count=1)
    out = streamrl(cli_env, "inspect")
    text = out.stdout.decode()
    assert out.returncode == 0, out.stderr
    assert f"{keys.prompts}  length 2" in text
    assert "group rollout: 1 consumers, 1 pending, lag 1" in text
    assert "2 streams, 2 entries" in text
    listed = json.loads(streamrl(cli_env, "inspect", "--json").stdout)
    assert {s["key"] for s in listed} == {keys.prompts, keys.episode("a"), keys.episode("b")}


def test_stop_asks_a_live_run_to_end_and_says_in_one_line_when_there_is_nothing_to_stop(
    cli_env, client, keys, redis_url, tmp_path
):
    from shared.runtime import runstate

    runstate.bind(client, keys, tmp_path / "runs" / keys.run, redis_url)
    assert runstate.end_requested(client, keys) is None
    out = streamrl(cli_env, "stop")
    assert out.returncode == 0 and b"asked to end" in out.stdout, out.stderr
    assert runstate.end_requested(client, keys).startswith("streamrl stop at ")
    # (the driver ending on it, with the check: tests/ops/test_ui_browser.py ends its live run so)
    runstate.mark_ended(client, keys, 7)
    out = streamrl(cli_env, "stop")
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "has ended at version 7" in lines[0], out.stderr

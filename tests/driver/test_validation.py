"""Validation rounds, the live status view and TensorBoard output."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.driver import validation
from services.driver.status import format_line, snapshot
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams import metrics, versions
from shared.protocol.streams import samples as psamples
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from shared.runtime.tensorboard import flatten
from tests.support.models import scripted_model
from tests.support.rollout_harness import make_worker, samples, tick_until

# greedy decoding of this model answers A: right and B: wrong
SCRIPTS = [("1+3=", "answer: 4"), ("2+2=", "answer: 5")]
ROWS = [{"prompt": "1+3=", "answer": "4"}, {"prompt": "2+2=", "answer": "4"}]


@pytest.fixture(scope="module")
def answering_dir(tmp_path_factory) -> str:
    return scripted_model(tmp_path_factory.mktemp("answering"), SCRIPTS)


@given(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=60), st.floats(0.05, 0.9))
def test_split_keeps_each_prompt_on_one_side_and_ignores_order(prompts, fraction):
    rows = [{"prompt": p, "answer": "0"} for p in prompts]
    train, held = validation.split(rows, fraction)
    assert len(train) + len(held) == len(rows)
    assert (held and train) or (len(set(prompts)) == 1 and not held)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert validation.split(list(reversed(rows)), fraction)[1] == list(reversed(held))


def test_split_fraction_is_roughly_kept_and_zero_holds_nothing():
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(30) for b in range(30)]
    train, held = validation.split(rows, 0.1)
    assert 50 < len(held) < 130
    assert validation.split(rows, 0.0) == (rows, [])
    assert validation.split([{"prompt": "x"}] * 3, 0.5) == ([{"prompt": "x"}] * 3, [])
    with pytest.raises(ValueError, match="fraction"):
        validation.split(rows, 1.0)


def test_round_groups_are_greedy_and_sampled_and_parse_back():
    groups = validation.round_groups(7, ROWS + ROWS, size=5)
    assert [g.group_id for g in groups] == ["val-v00007-g000", "val-v00007-s000", "val-v00007-g001", "val-v00007-s001"]
    assert groups[0].sampling == {"temperature": 0.0} and groups[1].sampling == {}
    assert groups[0].task == {"answer": "4"} and all(g.n == 1 for g in groups)
    assert [validation.parse_group_id(g.group_id) for g in groups[:2]] == [(7, "greedy"), (7, "sampled")]
    assert validation.parse_group_id("q0000001") is None and validation.parse_group_id("val-vx-g1") is None


def test_worker_serves_validation_first_past_a_closed_gate_and_never_into_samples(client, keys, answering_dir):
    cfg = Config(run=keys.run, model_dir=answering_dir, max_tokens=12, tools="", temperature=0.0)
    enqueue(client, keys, [PromptGroup("q1", 2, prompt="1+3=", task={"answer": "4"})])
    # the gate admits no training group
    client.hset(keys.gate, mapping={"version": 0, "limit": 0})
    validator = validation.Validator(client, keys, ROWS, every=5, size=8)
    assert validator.maybe_request(0) and not validator.maybe_request(0)
    # version 0 may still be asked for
    assert len(list(client.scan_iter(match=keys.enqueued("val-v00000-*")))) == 4
    assert not validator.maybe_request(3)
    worker = make_worker(cfg, client)
    done = []
    tick_until(worker, lambda: done.extend(validator.poll()) or done)
    # the training group still waits
    assert samples(client, keys) == [] and client.xlen(keys.prompts) == 1
    assert client.xpending(keys.val_prompts, ROLLOUT_GROUP)["pending"] == 0
    [summary] = done
    assert summary["version"] == 0 and summary["n"] == 4
    # 1+3 right, 2+2 wrong
    assert summary["reward_greedy"] == 0.5
    entries = [rec for _, rec in metrics.read(client, keys, "validation")]
    assert entries == [summary]
    # a restarted driver
    again = validation.Validator(client, keys, ROWS, every=5, size=8)
    assert not again.maybe_request(0) and again.poll() == []
    # the newest version moved on (3): round 0's markers went, and no driver asks for it again
    assert list(client.scan_iter(match=keys.enqueued("val-v00000-*"))) == [] and client.xlen(keys.val_prompts) == 4

    # a round requested by a driver that then restarted completes in the new one, duplicate prompts or not
    first = validation.Validator(client, keys, ROWS + ROWS, every=5, size=8)
    assert first.maybe_request(5)
    restarted = validation.Validator(client, keys, ROWS + ROWS, every=5, size=8)
    done.clear()
    tick_until(worker, lambda: done.extend(restarted.poll()) or done)
    assert [d["version"] for d in done] == [5] and done[0]["n"] == 4


def test_the_requested_set_keeps_the_newest_round_and_a_restarted_driver_asks_for_none_again(client, keys):
    """``validation:requested`` held every round ever asked for (it grew with the run); the newest round
    now stands for those before it, since the driver asks only for the newest version."""
    assert (
        validation.asked_before({10}, 10) and validation.asked_before({10}, 5) and not validation.asked_before({10}, 15)
    )
    assert not validation.asked_before(set(), 0)
    validator = validation.Validator(client, keys, ROWS, every=5, size=8)
    for version in range(0, 101):
        validator.maybe_request(version)
    # not the 21 rounds asked for
    assert client.smembers(keys.val_requested) == {b"100"}
    assert client.xlen(keys.val_prompts) == 21 * 4
    restarted = validation.Validator(client, keys, ROWS, every=5, size=8)
    # none again
    assert not any(restarted.maybe_request(v) for v in (0, 50, 95, 100, 101))
    assert restarted.maybe_request(105) and client.smembers(keys.val_requested) == {b"105"}
    assert client.xlen(keys.val_prompts) == 22 * 4


def test_status_line_and_cli(client, keys, cli_env):
    versions.publish(client, keys, versions.Version(3, "/x", "0", 3))
    # the trainer's snapshot, older than the records after it
    metrics.record(client, keys, "snapshot", {"version": 1, "step": 1, "bytes": 10, "seconds": 0.1, "time": 1.0})
    metrics.record(client, keys, "train", {"step": 3, "reward_mean": 0.25, "staleness_max": 1, "stale_dropped": 2})
    metrics.record(client, keys, "validation", {"version": 2, "reward_mean": 0.5, "reward_greedy": 0.75})
    client.xadd(keys.samples, psamples.encode(psamples.Sample("g", ["g-0", "g-1"])))
    snap = snapshot(client, keys)
    line = format_line(snap)
    assert "version   3" in line and "reward 0.250" in line and "val@v2 0.500 (greedy 0.750)" in line
    assert "dropped 2" in line and snap["samples_per_s"] > 0 and "scored 0" not in line
    assert "snapshot v1 " in line and "a crash re-trains 2 versions" in line
    cut = format_line({**snap, "train": {"reward_mean": 0.0, "batch_policy_failures": 60, "samples": 64}})
    assert "reward 0.000 (60/64 cut short by max_tokens, the context or max_tool_calls: scored 0)" in cut
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "status"], env=cli_env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "reward 0.250" in out.stdout
    env = {**cli_env, "STREAMRL_RUN": "no-such-run"}
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "status"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "no-such-run" in out.stderr


def test_flatten_keeps_finite_numbers_and_nests():
    got = flatten({"a": 1, "b": float("nan"), "c": "x", "d": True, "staleness": {"0": 5, "1": 2}})
    assert got == {"a": 1.0, "staleness/0": 5.0, "staleness/1": 2.0}


def test_trainer_writes_tensorboard_scalars(client, keys, tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from services.trainer.trainer import Trainer
    from shared.runtime import logs
    from tests.trainer.test_trainer import _write_group

    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        run_dir=str(tmp_path / "runs"),
        tensorboard=True,
        weights_dir=str(tmp_path / "w"),
        batch_groups=1,
    )
    for g in ("a", "b"):
        _write_group(client, keys, g)
    trainer = Trainer(cfg, client, logs.get("trainer-test"))
    trainer.run(should_stop=lambda: trainer.version >= 2)
    trainer.tensorboard.close()
    acc = EventAccumulator(str(cfg.run_path / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/reward_mean")]
    assert steps == [1, 2] and "train/staleness/0" in acc.Tags()["scalars"]
    assert any(name.endswith(".trainer") for name in os.listdir(cfg.run_path / "tensorboard"))


def test_pass_at_k_and_mean_at_k():
    groups = [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    s = validation.summarize(5, {"sampled": [r for g in groups for r in g]}, [], groups, k=4)
    assert s["pass@4"] == 2 / 3
    assert s["mean@4"] == (0.25 + 0 + 1) / 3


def test_round_groups_sample_k_per_prompt_and_dedupe_chat_prompts():
    chat = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(3)]
    groups = validation.round_groups(2, chat + chat, size=5, k=4)
    assert [g.n for g in groups] == [1, 4] * 3
    assert groups[1].prompt == chat[0]["prompt"]
    train, held = validation.split(chat * 2, 0.3)
    assert held and {validation.prompt_key(r["prompt"]) for r in train}.isdisjoint(
        validation.prompt_key(r["prompt"]) for r in held
    )

"""The run checker's counts on hand-built streams (pure), and `streamrl check` on a real server."""

from __future__ import annotations

import json
import subprocess
import sys

from services.ops.check import checker
from services.ops.check.checker import ConsumerGroup, RunData, check, episode_stats, read_run
from shared.protocol.episode.events import Event
from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP
from shared.protocol.streams.prompts import PromptGroup, encode_group
from tests.support.helpers import finished, raw, started, tokens


def _b(fields: dict) -> dict:
    return {k: (v if isinstance(v, bytes) else str(v).encode()) for k, v in fields.items()}


def _prompts(*group_ids, n=2, start=1):
    return [(f"{start + i}-0", _b(encode_group(PromptGroup(g, n, prompt="1+1=")))) for i, g in enumerate(group_ids)]


def _sample(entry_id, group_id, n=2):
    eids = ",".join(f"{group_id}-{i}" for i in range(n))
    return (entry_id, _b({"group_id": group_id, "episodes": eids, "worker": "w", "n": n}))


def _episode(eid, ntok=3, worker="w", extra=()):
    evs = [
        Event(
            "started",
            0,
            worker,
            0,
            {
                "episode_id": eid,
                "group_id": eid.rsplit("-", 1)[0],
                "index": 0,
                "prompt_ids": [5, 6],
                "sampling": {"max_tokens": 32},
                "task": {},
            },
        ),
        tokens(1, range(10, 10 + ntok), worker=worker),
    ]
    evs += list(extra)
    evs.append(finished(len(evs)))
    return checker._entries(raw(evs))


def _finished_run(groups=("g1", "g2"), ntok=3) -> RunData:
    """Every group finished, published once, trained once; one worker generated exactly what the streams hold."""
    eps = {f"{g}-{i}": _episode(f"{g}-{i}", ntok) for g in groups for i in range(2)}
    return RunData(
        prompts=_prompts(*groups),
        rollout=ConsumerGroup(f"{len(groups)}-0"),
        samples=[_sample(f"{100 + i}-0", g) for i, g in enumerate(groups)],
        trainer=ConsumerGroup(f"{99 + len(groups)}-0"),
        episodes=eps,
        ledger=[{"version": 1, "groups": list(groups), "skipped": []}],
        reports={"w": {"worker": "w", "tokens": ntok * len(eps), "final": True}},
    )


def test_clean_run_counts_zero():
    r = check(_finished_run())
    assert r.ok and r.tokens_generated_again == 0
    assert (r.groups_enqueued, r.groups_published, r.groups_trained, r.episodes) == (2, 2, 2, 4)
    assert r.tokens_in_streams == 12


def test_a_whole_run_that_trained_nothing_is_not_ok():
    """Episodes rolled out (all failed, say: every group judged untrainable) and no version published: a whole
    run's check (read with its config) says the trainer trained nothing instead of ok."""
    from services.ops.check.checker import format_report

    data = _finished_run()
    data.ledger = [{"version": 0, "groups": [], "skipped": ["g1", "g2"]}]
    assert check(data).ok, "a component's streams read alone are not held to training"
    data.expect_training = True
    r = check(data)
    assert r.trained_nothing == 1 and not r.ok
    text = format_report(r, "x")
    assert "the trainer trained nothing: 0 versions published, 4 episodes attempted" in text
    assert text.endswith("FAILED: a count that must be 0 is not")
    # a version published, or nothing attempted: not flagged
    data.versions = [1]
    assert check(data).trained_nothing == 0
    empty = RunData(expect_training=True)
    assert check(empty).trained_nothing == 0


def test_group_delivered_never_published_nor_pending_is_lost():
    data = _finished_run(("g1", "g2", "g3"))
    data.samples = data.samples[:2]
    data.ledger[0]["groups"] = ["g1", "g2"]
    r = check(data)
    assert r.groups_lost == 1 and r.details["groups_lost_in_rollout"] == ["g3"] and not r.ok


def test_group_pending_or_undelivered_is_in_flight_not_lost():
    data = _finished_run(("g1", "g2", "g3", "g4"))
    data.samples = data.samples[:2]
    data.ledger[0]["groups"] = ["g1", "g2"]
    # g3 pending at a worker, g4 never delivered
    data.rollout = ConsumerGroup("3-0", pending={"3-0"})
    r = check(data)
    assert r.groups_lost == 0 and r.groups_in_flight == 2 and r.ok


def test_validation_group_delivered_never_published_is_lost():
    data = _finished_run()
    data.val_prompts = _prompts("v1", "v2", start=500)
    # v2 in flight
    data.val_rollout = ConsumerGroup("501-0", pending={"501-0"})
    data.val_samples = []
    r = check(data)
    assert r.groups_lost == 1 and r.details["groups_lost_in_rollout"] == ["val:v1"]
    data.val_samples = [_sample("600-0", "v1")]
    assert check(data).groups_lost == 0


def test_sample_acked_but_in_no_ledger_record_is_lost_unless_the_trainer_holds_it():
    data = _finished_run(("g1", "g2"))
    data.ledger[0]["groups"] = ["g1"]
    r = check(data)
    assert r.groups_lost == 1 and r.details["groups_lost_in_training"] == ["g2"]
    # delivered, not acknowledged: the trainer has it in hand
    data.trainer.pending = {"101-0"}
    assert check(data).groups_lost == 0
    # not read yet
    data.trainer = ConsumerGroup("100-0")
    assert check(data).groups_lost == 0
    data.trainer = ConsumerGroup("101-0")
    # judged untrainable: accounted for
    data.ledger.append({"version": 1, "groups": [], "skipped": ["g2"]})
    assert check(data).groups_lost == 0


def test_two_terminal_events_and_two_samples_entries_count_as_finished_twice():
    data = _finished_run()
    entries = data.episodes["g1-0"]
    dup = dict(entries[-1][1])
    dup["seq"] = str(len(entries)).encode()
    data.episodes["g1-0"] = entries + [("999-0", dup)]
    assert episode_stats(data.episodes["g1-0"]).terminal_events == 2
    r = check(data)
    assert r.episodes_finished_twice == 1 and r.details["episodes_finished_twice"] == ["g1-0"]
    data = _finished_run()
    data.samples.append(_sample("150-0", "g1"))
    data.trainer = ConsumerGroup("150-0")
    r = check(data)
    assert r.episodes_finished_twice == 1 and r.details["groups_published_twice"] == ["g1"]


def test_group_in_two_ledger_records_is_trained_twice():
    data = _finished_run()
    data.ledger.append({"version": 2, "groups": ["g2"], "skipped": []})
    data.ledger.append({"version": 3, "groups": ["g2"], "skipped": []})
    r = check(data)
    assert r.samples_trained_twice == 2 and r.details["groups_trained_twice"] == ["g2"] and not r.ok


def test_tokens_generated_again_is_generated_minus_stored():
    data = _finished_run()
    # A crashed with 2 tokens unflushed
    data.reports = {"A": {"worker": "A", "tokens": 7, "final": True}, "w": {"worker": "w", "tokens": 7, "final": True}}
    # 14 generated, 12 stored
    assert check(data).tokens_generated_again == 2
    # no final record: a crash without a probe
    data.reports["A"]["final"] = False
    r = check(data)
    # unknown, not a failure
    assert r.tokens_generated_again is None and r.ok
    data.reports.pop("A")
    # w alone reports 7: an undercount shows as negative
    assert check(data).tokens_generated_again == -5
    data.reports = {}
    assert check(data).details["workers_without_final_report"] == ["w"]


def test_resume_kinds_takeover_and_tail():
    base = [started(), tokens(1, [1, 2, 3])]
    takeover = base + [
        Event("resumed", 0, "B", 2, {"num_tokens": 3, "takeover_from": "A"}),
        tokens(3, [4]),
        finished(4),
    ]
    st = episode_stats(checker._entries(raw(takeover)))
    assert (st.takeovers, st.tail_resumes, st.policy_tokens, st.status) == (1, 0, 4, "finished")
    paused = base + [
        Event("aborted", 0, "w", 2, {"reason": "pause", "num_tokens": 3}),
        Event("resumed", 1, "w", 3, {"num_tokens": 3}),
        finished(4),
    ]
    st = episode_stats(checker._entries(raw(paused)))
    assert (st.takeovers, st.tail_resumes) == (0, 0)
    tail = base + [Event("resumed", 0, "w", 2, {"num_tokens": 3}), finished(3)]
    assert episode_stats(checker._entries(raw(tail))).tail_resumes == 1
    tool = base + [
        Event("tool_call", 0, "w", 2, {"call_id": "c1", "name": "calc", "args": "1+1"}),
        Event("tool_result", 0, "w", 3, {"call_id": "c1", "ok": True, "output": "2", "ids": [9]}),
        # result came back while paused
        Event("resumed", 1, "w", 4, {"num_tokens": 4}),
        finished(5),
    ]
    assert episode_stats(checker._entries(raw(tool))).tail_resumes == 0


def test_trained_group_whose_episode_lost_its_finish_counts():
    data = _finished_run()
    # the finished event is gone: running in the stream
    data.episodes["g2-1"] = data.episodes["g2-1"][:-1]
    data.reports["w"]["tokens"] = 12
    r = check(data)
    assert r.trained_unfinished == 1 and r.details["trained_unfinished"] == ["g2"]
    # informational: trained when finished, then lost by a Redis crash (not trained again)
    assert r.ok


def test_bad_input_must_be_dead_lettered_once_a_service_read_it():
    data = _finished_run()
    data.prompts.append(("3-0", {"group_id": b"bad group", "n": b"2", "data": b"\xc1"}))
    data.samples.append(("120-0", {"garbage": b"1"}))
    data.control.append(("50-0", {"type": b"cmd", "cmd": b"explode", "sync": b"s"}))
    data.control.append(
        (
            "51-0",
            _b({"type": "ack", "cmd": "pause", "sync": "s", "worker": "w", "ok": "1", "version": "0", "error": ""}),
        )
    )
    data.episodes["g1-1"] = data.episodes["g1-1"] + [("998-0", {"type": b"tokens", "v": b"9", "seq": b"x"})]
    data.rollout, data.trainer = ConsumerGroup("3-0"), ConsumerGroup("120-0")
    r = check(data)
    assert r.bad_input_found == 4 and r.bad_input_not_dead_lettered == 4 and not r.ok
    data.dead = [
        {"stream": "prompts", "entry": "3-0", "reason": "x"},
        {"stream": "samples", "entry": "120-0", "reason": "x"},
        {"stream": "control", "entry": "50-0", "reason": "x"},
        {"stream": "ep:g1-1", "entry": "998-0", "reason": "x"},
    ]
    r = check(data)
    assert r.bad_input_not_dead_lettered == 0
    # dead-lettered or not, an episode stream that does not fold cannot be replayed or trained: not ok
    assert r.episodes_unreadable == 1 and r.details["episodes_unreadable"][0].startswith("g1-1 (") and not r.ok
    data.episodes["g1-1"] = data.episodes["g1-1"][:-1]
    assert check(data).ok
    # a dead letter for another entry does not cover this one
    data.dead[0]["entry"] = "2-0"
    assert check(data).details["bad_input_not_dead_lettered"] == ["prompts 3-0"]
    # not delivered yet: nobody could have dead-lettered it
    data.rollout = ConsumerGroup("2-0")
    assert check(data).bad_input_not_dead_lettered == 0


def test_streamrl_check_on_a_real_server(cli_env, client, keys, tmp_path):
    """The command: reads the streams and the ledger; human table, --json, exit 1 when a count fails."""
    env = {**cli_env, "STREAMRL_RUN_DIR": str(tmp_path)}
    for entry_id, fields in _prompts("g1", "g2"):
        client.xadd(keys.prompts, fields)
    # both delivered (the group starts after them)
    client.xgroup_create(keys.prompts, ROLLOUT_GROUP, id="$")
    for g in ("g1", "g2"):
        for i in range(2):
            for _, f in raw([started(episode_id=f"{g}-{i}"), tokens(1, [1, 2]), finished(2)]):
                client.xadd(keys.episode(f"{g}-{i}"), f)
    client.xadd(keys.samples, {"group_id": "g1", "episodes": "g1-0,g1-1", "worker": "w", "n": "2"})
    client.xgroup_create(keys.samples, TRAINER_GROUP, id="$")
    client.xadd(keys.metrics, {"kind": "rollout", "json": json.dumps({"worker": "w", "tokens": 8, "final": True})})
    ledger = tmp_path / keys.run / "trainer" / "trained.jsonl"
    ledger.parent.mkdir(parents=True)
    ledger.write_text(json.dumps({"version": 1, "groups": ["g1"], "skipped": []}) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "check", "--json"], env=env, capture_output=True, timeout=60
    )
    report = json.loads(out.stdout)
    # g2 was delivered, never published, not pending: lost
    assert out.returncode == 1, out.stderr
    assert report["groups_lost"] == 1 and report["details"]["groups_lost_in_rollout"] == ["g2"]
    assert report["tokens_generated_again"] == 0 and report["tokens_in_streams"] == 8
    client.xadd(keys.samples, {"group_id": "g2", "episodes": "g2-0,g2-1", "worker": "w", "n": "2"})
    with open(ledger, "a") as fh:
        fh.write(json.dumps({"version": 2, "groups": ["g2"], "skipped": []}) + "\n")
    client.xgroup_setid(keys.samples, TRAINER_GROUP, id="$")
    out = subprocess.run(
        [sys.executable, "-m", "services.ops.cli.main", "check"], env=env, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    text = out.stdout.decode()
    assert "prompt groups lost" in text and "samples trained twice" in text and text.rstrip().endswith("ok")


def test_a_group_enqueued_twice_and_a_version_published_twice_fail_the_check():
    data = _finished_run()
    assert check(data).groups_enqueued_twice == 0
    # g1 again: a retried XADD that was not idempotent
    data.prompts.append(("9-0", data.prompts[0][1]))
    r = check(data)
    assert r.groups_enqueued_twice == 1 and r.details["groups_enqueued_twice"] == ["g1"] and not r.ok
    data = _finished_run()
    data.versions = [1, 2, 3]
    assert check(data).ok and check(data).versions_missing == 0
    data.versions = [1, 2, 2, 3]
    r = check(data)
    assert r.versions_repeated == 1 and r.details["versions_repeated"] == [2] and not r.ok
    # a gap alone (a Redis crash lost version 2's event) is reported, not a failure
    data.versions = [1, 3]
    r = check(data)
    assert r.ok and r.versions_missing == 1 and r.details["versions_missing"] == [2]


def test_a_worker_reporting_an_older_version_than_before_fails_the_check():
    """The control-acks row: the acks of each worker carry the version it runs after the command; one lower than an
    earlier one (a backwards load), or a pulled load of an older version, is a failure."""
    from shared.protocol.streams import control

    def ack(entry_id, worker, cmd, version):
        return (entry_id, _b(control.ack(control.Command(cmd, f"s{version}", version), worker, True, version)))

    data = _finished_run()
    data.control = [
        ack("1-0", "A", "load", 1),
        ack("2-0", "B", "load", 1),
        ack("3-0", "A", "resume", 2),
        ack("4-0", "B", "pause", 1),
    ]
    data.pull_loads = [("C", 1), ("C", 2)]
    assert check(data).ok and check(data).loads_backwards == 0
    # A went back from 2 to 1
    data.control.append(ack("5-0", "A", "load", 1))
    data.pull_loads.append(("C", 1))
    r = check(data)
    assert r.loads_backwards == 2 and not r.ok
    assert r.details["loads_backwards"] == [
        "A: load ack 5-0 at version 1 after 2",
        "C: pulled load of 1 at version 1 after 2",
    ]
    assert "weight loads going backwards" in checker.format_report(r, "demo")


def test_agent_group_never_published_with_no_job_in_hand_is_lost():
    data = _finished_run(("g1",))
    data.agent_groups = _prompts("a1", "a2", "a3", start=50)
    # a1 published; a2's episode 1 still has a job; a3 has nothing
    data.samples.append(_sample("200-0", "a1"))
    data.agents_busy = {"a2-1"}
    r = check(data)
    assert r.details["groups_lost_in_rollout"] == ["a3"] and r.groups_lost == 1
    assert r.groups_enqueued == 4 and r.groups_in_flight == 1
    data.agents_busy.add("a3-0")
    assert check(data).groups_lost == 0


def test_the_check_reads_every_pending_entry_past_one_page_of_1000(client, keys, tmp_path):
    """2,000 samples delivered to the trainer and not acknowledged (two full pages, then an empty one): the
    check holds all of them in flight, none is missed at a page boundary."""
    pipe = client.pipeline(transaction=False)
    for i in range(2000):
        pipe.xadd(keys.samples, {"group_id": f"p{i:04d}", "episodes": f"p{i:04d}-0", "worker": "w", "n": "1"})
    ids = [e.decode() for e in pipe.execute()]
    client.xgroup_create(keys.samples, TRAINER_GROUP, id="0")
    client.xreadgroup(TRAINER_GROUP, "trainer", {keys.samples: ">"}, count=2000)
    # one acknowledged, right at the first page's end
    client.xack(keys.samples, TRAINER_GROUP, ids[999])
    data = read_run(client, keys, tmp_path)
    assert data.trainer.pending == set(ids) - {ids[999]}


def _versions_run(token_policy: int, trained_at: int, temperature: float = 1.0) -> RunData:
    """One group g1, two episodes whose 3 policy tokens each were made by ``token_policy``, committed in the ledger
    line of version ``trained_at + 1`` (so trained by policy ``trained_at``)."""
    data = _finished_run(("g1",))
    for i in range(2):
        eid = f"g1-{i}"
        evs = [
            Event(
                "started",
                0,
                "w",
                0,
                {
                    "episode_id": eid,
                    "group_id": "g1",
                    "index": 0,
                    "prompt_ids": [5, 6],
                    "sampling": {"max_tokens": 32, "temperature": temperature},
                    "task": {},
                },
            ),
            tokens(1, [10, 11, 12], policy=token_policy),
            finished(2),
        ]
        data.episodes[eid] = checker._entries(raw(evs))
    data.ledger = [{"commit": trained_at + 1, "version": trained_at + 1, "groups": ["g1"], "skipped": []}]
    return data


def test_tokens_trained_past_the_staleness_bound_fail_the_check_and_masked_ones_do_not():
    # 3 versions stale
    data = _versions_run(token_policy=2, trained_at=5)
    r = check(data)
    # no bound: shown, not judged
    assert r.tokens_past_staleness_bound is None and r.oldest_trained == 3 and r.ok
    # hard_max_staleness 2: the trainer must have masked all six
    data.staleness_bound = 2
    r = check(data)
    assert r.tokens_past_staleness_bound == 6 and not r.ok
    assert r.details["tokens_past_staleness_bound"] == ["g1 (6 tokens at version 5)"]
    # it did
    data.stale_tokens_masked = 6
    assert check(data).tokens_past_staleness_bound == 0 and check(data).ok
    # exactly at the bound trains
    data.staleness_bound = 3
    data.stale_tokens_masked = 0
    assert check(data).tokens_past_staleness_bound == 0
    # greedy rows are not trained at all
    greedy = _versions_run(token_policy=2, trained_at=5, temperature=0.0)
    greedy.staleness_bound = 0
    assert check(greedy).tokens_past_staleness_bound == 0


def test_the_staleness_bound_comes_from_the_run_config():
    from services.ops.check.data import staleness_bound
    from shared.runtime.config.keys import Config

    assert staleness_bound(Config(mode="sync", max_staleness=0)) == 0
    assert staleness_bound(Config(hard_max_staleness=4)) == 4
    assert staleness_bound(Config()) is None and staleness_bound(None) is None


def test_a_repack_hand_over_must_name_its_source():
    base = [
        started(),
        tokens(1, [1, 2, 3], worker="S"),
        Event("aborted", 0, "S", 2, {"reason": "repack", "num_tokens": 3}),
    ]
    marked = base + [Event("resumed", 0, "T", 3, {"num_tokens": 3, "repacked": "S"}), finished(4)]
    assert episode_stats(checker._entries(raw(marked))).repack_unmarked == 0
    orphan = base + [Event("resumed", 0, "T", 3, {"num_tokens": 3, "takeover_from": "S"}), finished(4)]
    # the target re-opened it as an orphan
    assert episode_stats(checker._entries(raw(orphan))).repack_unmarked == 1
    bare = base + [Event("resumed", 0, "T", 3, {"num_tokens": 3}), finished(4)]
    assert episode_stats(checker._entries(raw(bare))).repack_unmarked == 1
    dead_target = base + [Event("resumed", 0, "U", 3, {"num_tokens": 3, "takeover_from": "T"}), finished(4)]
    # the target died first
    assert episode_stats(checker._entries(raw(dead_target))).repack_unmarked == 0
    data = _finished_run(("g1",))
    data.episodes["g1-0"] = checker._entries(raw(bare))
    data.reports["w"]["tokens"] = 3
    r = check(data)
    assert r.repacks_unmarked == 1 and r.details["repacks_unmarked"] == ["g1-0"] and not r.ok


def test_an_episode_the_platform_failed_fails_the_check_and_one_the_agent_failed_does_not():
    """A failed event's ``where`` tells the agent's own error (the episode's outcome) from the gateway lost for
    good (the platform's): only the second fails the check."""
    data = _finished_run()

    def failed_with(where: str):
        ep = _episode("g2-0")[:-1]
        return ep + checker._entries(raw([Event("failed", 0, "agents", len(ep), {"error": "x", "where": where})]))

    data.episodes["g2-0"] = failed_with("agent")
    r = check(data)
    assert r.ok and r.episodes_failed_by_infrastructure == 0
    data.episodes["g2-0"] = failed_with("gateway")
    r = check(data)
    assert r.episodes_failed_by_infrastructure == 1 and not r.ok
    assert r.details["episodes_failed_by_infrastructure"] == ["g2-0"]
    assert "episodes the platform failed" in checker.format_report(r, "x") and "FAILED" in checker.format_report(r, "x")

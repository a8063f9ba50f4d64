"""Hypothesis properties: fold over generated episodes and their mutations, every stream codec
round-tripping through a real server, the trainer batch's alignment around tool tokens, and the checker's
counts under one injected fault.

Expectations are computed here, from what the generators meant, never by calling the code under test."""

from __future__ import annotations

import json
from dataclasses import replace
from uuid import uuid4

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.ops.check.checker import ConsumerGroup, RunData, _entries, check, episode_stats
from services.ops.check.report import MUST_BE_ZERO
from services.trainer.batch import build_batch
from shared.protocol import gate
from shared.protocol.archive import ledger
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import Event, encode
from shared.protocol.episode.fold import Episode, fold
from shared.protocol.keys import ROLLOUT_GROUP, Keys
from shared.protocol.streams import calls, control, dead_letters, metrics, prompts, samples, versions
from shared.protocol.streams.prompts import PromptGroup, encode_group
from tests.support.helpers import finished, raw, started, tokens

FIXTURES = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=25)

# float32 values survive the "<f4" packing exactly
logprob = st.floats(-30.0, 0.0, width=32)


# ---------------------------------------------------------------------------------------------------------------
# 1. fold over generated valid episodes, and over the same episodes with one entry dropped, doubled or swapped

gen_step = st.tuples(st.just("gen"), st.lists(st.tuples(st.integers(0, 2**32 - 1), logprob), min_size=1, max_size=6))
pause_step = st.tuples(st.just("pause"), st.sampled_from(["pause", "shutdown", "debug"]), st.integers(0, 2))
tool_step = st.tuples(st.just("tool"), st.lists(st.integers(0, 2**32 - 1), max_size=4), st.booleans())


@st.composite
def episodes(draw):
    """(events of a valid finished episode, the tokens/logprobs/versions/mask it must fold to)."""
    prompt = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=5))
    evs = [
        Event(
            "started",
            0,
            "w0",
            0,
            {
                "episode_id": "e1",
                "group_id": "g1",
                "index": 0,
                "prompt_ids": prompt,
                "sampling": {"max_tokens": 64},
                "task": {},
            },
        )
    ]
    want = {"tokens": [], "logprobs": [], "versions": [], "mask": []}
    policy, worker = 0, "w0"
    for i, step in enumerate(draw(st.lists(st.one_of(gen_step, pause_step, tool_step), max_size=8))):
        seq = len(evs)
        if step[0] == "gen":
            ids, lps = [t for t, _ in step[1]], [lp for _, lp in step[1]]
            evs.append(Event("tokens", policy, worker, seq, {"ids": ids, "logprobs": lps}))
            want["tokens"] += ids
            want["logprobs"] += lps
            want["versions"] += [policy] * len(ids)
            want["mask"] += [1] * len(ids)
        # aborted at the stream's length, resumed there under a newer (or same) policy
        elif step[0] == "pause":
            n = len(want["tokens"])
            evs.append(Event("aborted", policy, worker, seq, {"reason": step[1], "num_tokens": n}))
            policy, worker = policy + step[2], f"w{i}"
            evs.append(Event("resumed", policy, worker, seq + 1, {"num_tokens": n}))
        else:
            call_id = f"c{i}"
            evs.append(Event("tool_call", policy, worker, seq, {"call_id": call_id, "name": "calc", "args": "1+1"}))
            evs.append(
                Event(
                    "tool_result",
                    policy,
                    worker,
                    seq + 1,
                    {"call_id": call_id, "ok": step[2], "output": "2", "ids": step[1]},
                )
            )
            want["tokens"] += step[1]
            want["logprobs"] += [0.0] * len(step[1])
            want["versions"] += [-1] * len(step[1])
            want["mask"] += [0] * len(step[1])
    evs.append(Event("finished", policy, worker, len(evs), {"reason": "stop", "reward": 0.5, "details": {}}))
    return evs, want


@settings(max_examples=60, deadline=None)
@given(episodes())
def test_fold_of_a_generated_episode_gives_the_tokens_versions_logprobs_and_mask_it_was_built_from(episode):
    evs, want = episode
    ep = fold(raw(evs))
    assert (ep.tokens, ep.logprobs, ep.versions, ep.mask) == (
        want["tokens"],
        want["logprobs"],
        want["versions"],
        want["mask"],
    )
    assert ep.status == "finished" and ep.reward == 0.5 and ep.last_seq == len(evs) - 1
    assert len(ep.aborts) == len(ep.resumes) == sum(e.kind == "aborted" for e in evs)
    assert not ep.pending_tool_calls and ep.num_generated == sum(want["mask"])


@st.composite
def mutated(draw):
    """(a valid episode with one entry dropped, doubled or two neighbours swapped, index of the entry fold must
    name in it, the seq that entry carries, 'gap' or 'duplicate')."""
    evs, _ = draw(episodes())
    kind = draw(st.sampled_from(["drop", "double", "swap"]))
    # any entry but the last (a stream cut short at its end is a running episode, not an error)
    if kind == "drop":
        i = draw(st.integers(0, len(evs) - 2))
        # the entry after the hole
        return evs[:i] + evs[i + 1 :], i, evs[i + 1].seq, "gap"
    if kind == "double":
        i = draw(st.integers(0, len(evs) - 1))
        # the copy, not the original
        return evs[: i + 1] + [evs[i]] + evs[i + 1 :], i + 1, evs[i].seq, "duplicate"
    i = draw(st.integers(0, len(evs) - 2))
    # the one that came forward
    return evs[:i] + [evs[i + 1], evs[i]] + evs[i + 2 :], i, evs[i + 1].seq, "gap"


@settings(max_examples=100, deadline=None)
@given(mutated())
def test_fold_names_the_entry_after_a_dropped_one_the_copy_of_a_doubled_one_and_the_first_of_a_swapped_pair(case):
    evs, index, seq, problem = case
    # ids in stream order, as XRANGE gives them after the mutation
    entries = raw(evs)
    with pytest.raises(EventError) as err:
        fold(entries)
    assert err.value.entry_id == entries[index][0].decode()
    assert err.value.field == "seq" and err.value.problem == f"{problem}: expected {index}, got {seq}"


# ---------------------------------------------------------------------------------------------------------------
# 2. every stream codec of shared/protocol/schema.py: what is written through it is read back equal (real server)


def fresh(keys: Keys) -> Keys:
    """A run of its own for one example (examples of one test share the fixture's server and namespace)."""
    return Keys(f"{keys.run}-{uuid4().hex[:8]}")


text = st.text(max_size=12)
ids_text = st.text(st.characters(blacklist_characters=" :*,", blacklist_categories=("Cs",)), min_size=1, max_size=10)
hexes = st.text("0123456789abcdef", max_size=64)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6,
)
msgpack_maps = st.dictionaries(text, msgpack_values, max_size=3)
json_maps = st.dictionaries(text, json_values, max_size=4)


@FIXTURES
@given(episode=episodes())
def test_episode_events_written_to_a_stream_fold_back_to_the_episode(client, keys, episode):
    evs, want = episode
    key = fresh(keys).episode("e1")
    for ev in evs:
        client.xadd(key, encode(ev))
    ep = fold(client.xrange(key))
    assert (ep.tokens, ep.logprobs, ep.versions, ep.mask) == (
        want["tokens"],
        want["logprobs"],
        want["versions"],
        want["mask"],
    )
    assert [(e.kind, e.policy, e.worker, e.seq, e.data) for e in ep.events] == [
        (e.kind, e.policy, e.worker, e.seq, e.data) for e in evs
    ]


chat = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    min_size=1,
    max_size=3,
)
# sampling as the codecs accept it (shared/protocol/episode/sampling.py; tests/protocol/test_poison.py feeds them
# the rest)
sampling_maps = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 100),
        "top_p": st.floats(0, 1, exclude_min=True),
        "top_k": st.integers(0, 1000),
        "max_tokens": st.integers(1, 4096),
        "seed": st.integers(-(2**63), 2**64 - 1),
        "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=4),
    },
)
prompt_groups = st.builds(
    lambda gid, n, prompt, task, sampling: PromptGroup(gid, n, prompt[0], prompt[1], task, sampling),
    ids_text,
    st.integers(1, 64),
    st.one_of(st.tuples(text | chat, st.none()), st.tuples(st.none(), st.lists(st.integers(0, 2**32 - 1), max_size=8))),
    msgpack_maps,
    sampling_maps,
)


@FIXTURES
@given(groups=st.lists(prompt_groups, min_size=1, max_size=4, unique_by=lambda g: g.group_id))
def test_prompt_groups_read_back_as_enqueued_and_enqueue_again_adds_nothing(client, keys, groups):
    k = fresh(keys)
    entry_ids = prompts.enqueue(client, k, groups)
    assert prompts.enqueue(client, k, groups) == [None] * len(groups)
    back = [prompts.decode_group(*entry) for entry in client.xrange(k.prompts)]
    assert back == [replace(g, entry_id=e) for g, e in zip(groups, entry_ids)]


sample_values = st.builds(
    samples.Sample, ids_text, st.lists(ids_text, min_size=1, max_size=4), text, st.integers(1, 16)
)


@FIXTURES
@given(published=st.lists(sample_values, min_size=1, max_size=4, unique_by=lambda s: s.group_id))
def test_published_samples_read_back_equal_and_their_prompts_are_acknowledged(client, keys, published):
    k = fresh(keys)
    client.xgroup_create(k.prompts, ROLLOUT_GROUP, id="0", mkstream=True)
    pub = samples.Publisher(client, k)
    for s in published:
        prompt_entry = client.xadd(k.prompts, {"group_id": s.group_id}).decode()
        client.xreadgroup(ROLLOUT_GROUP, "w1", {k.prompts: ">"})
        pub.publish(s, k.samples, k.prompts, prompt_entry)
        # a retry: no second entry
        pub.publish(s, k.samples, k.prompts, prompt_entry)
    good, bad = samples.read_all(client, k.samples)
    assert not bad and good == [replace(s, entry_id=g.entry_id) for s, g in zip(published, good)]
    assert len(good) == len(published) and samples.read_after(client, k.samples, "0-0")[0] == good
    assert client.xpending(k.prompts, ROLLOUT_GROUP)["pending"] == 0


version_values = st.builds(
    versions.Version,
    st.integers(1, 10**6),
    text.filter(bool),
    hexes,
    st.integers(0, 10**9),
    # the codec writes time to 3 decimals
    st.integers(1, 10**10).map(lambda ms: ms / 1000),
    url=text,
)


@FIXTURES
@given(
    published=st.lists(version_values, min_size=1, max_size=4, unique_by=lambda v: v.version).map(
        lambda vs: sorted(vs, key=lambda v: v.version)
    )
)
def test_published_versions_read_back_equal_and_an_old_one_republished_adds_nothing(client, keys, published):
    k = fresh(keys)
    entry_ids = [versions.publish(client, k, v) for v in published]
    for v in published:
        # not newer than the newest: a no-op
        assert versions.publish(client, k, v) == entry_ids[-1]
    want = [replace(v, entry_id=e) for v, e in zip(published, entry_ids)]
    assert versions.read_all(client, k) == want and versions.latest(client, k) == want[-1]
    assert versions.read_after(client, k, "0-0") == want


commands = st.builds(
    control.Command, st.sampled_from(control.COMMANDS), ids_text, st.integers(-1, 10**6), text, hexes, url=text
).filter(lambda c: c.cmd not in control.WITH_WEIGHTS or (c.version >= 0 and c.path))
# worker, ok, version, error
acks = st.tuples(ids_text, st.booleans(), st.integers(-1, 10**6), text)


@FIXTURES
@given(sent=st.lists(st.tuples(commands, acks), min_size=1, max_size=4, unique_by=lambda ca: (ca[0].sync, ca[0].cmd)))
def test_control_commands_and_acks_read_back_equal_and_a_retried_send_adds_nothing(client, keys, sent):
    k = fresh(keys)
    entry_ids = [control.send_command(client, k, c) for c, _ in sent]
    for c, (worker, ok, version, error) in sent:
        assert control.send_ack(client, k, c, worker, ok, version, error)
        assert control.send_ack(client, k, c, worker, ok, version, error) is None
        assert control.send_command(client, k, c) is None
    read = control.read_after(client, k, "0-0")
    assert [x for _, x in read[: len(sent)]] == [replace(c, entry_id=e) for (c, _), e in zip(sent, entry_ids)]
    assert [control.decode_ack(x) for _, x in read[len(sent) :]] == [
        control.Ack(c.cmd, c.sync, w, ok, v, err) for c, (w, ok, v, err) in sent
    ]


@FIXTURES
@given(
    letters=st.lists(
        st.builds(dead_letters.DeadLetter, text, ids_text, text, text),
        max_size=4,
        unique_by=lambda d: (d.stream, d.entry),
    )
)
def test_dead_letters_read_back_equal_and_a_second_for_the_same_entry_adds_nothing(client, keys, letters):
    k = fresh(keys)
    for d in letters:
        assert dead_letters.send(client, k, d.stream, d.entry, d.reason, d.by)
        assert not dead_letters.send(client, k, d.stream, d.entry, "again", "someone else")
    assert dead_letters.read_all(client, k) == letters


@FIXTURES
@given(records=st.lists(st.tuples(st.sampled_from(metrics.KINDS), json_maps), min_size=1, max_size=5))
def test_metrics_records_read_back_equal_and_one_written_again_reads_once_in_its_last_place(client, keys, records):
    k = fresh(keys)
    identity_field = {
        "train": "step",
        "sync": "sync",
        "validation": "version",
        "publish": "version",
        "rollout": "i",
        "agent": "episode",
        "snapshot": "version",
    }
    records = [(kind, {**data, identity_field.get(kind, "i"): i}) for i, (kind, data) in enumerate(records)]
    for kind, data in records:
        metrics.record(client, k, kind, data)
    assert [d for _, d in metrics.read(client, k)] == [d for _, d in records]
    for kind in metrics.KINDS:
        assert [d for _, d in metrics.read(client, k, kind)] == [d for kn, d in records if kn == kind]
    # a retried XADD
    metrics.record(client, k, *records[0])
    again = [d for _, d in records[1:]] + [records[0][1]]
    # no identity: both copies stay
    if records[0][0] == "fault_probe":
        again = [records[0][1]] + again
    assert [d for _, d in metrics.read(client, k)] == again


@FIXTURES
@given(records=st.lists(json_maps, min_size=1, max_size=4), torn=st.integers(1, 20))
def test_ledger_records_read_back_equal_and_a_torn_last_line_is_ignored_then_cut(tmp_path, records, torn):
    directory = tmp_path / uuid4().hex
    # a reader that keeps up with the file (the archiver's)
    tail = ledger.LedgerTail(directory)
    assert tail.read() == []
    for n, rec in enumerate(records, 1):
        ledger.append_ledger(directory, rec)
        assert tail.read() == records[:n]
    assert ledger.read_ledger(directory) == records
    # a crash mid-append: no newline
    partial = json.dumps(records[0]).encode()[:torn]
    with open(directory / ledger.FILE, "ab") as fh:
        fh.write(partial)
    assert ledger.read_ledger(directory) == records == tail.read()
    assert ledger.repair_ledger(directory) == len(partial)
    ledger.append_ledger(directory, {"commit": 1})
    assert ledger.read_ledger(directory) == records + [{"commit": 1}] == tail.read()


call_requests = st.builds(
    lambda ep, digest, extends, ids, sampling, messages: calls.CallRequest(
        ep, digest, extends, ids, sampling, messages
    ),
    st.sampled_from(["e1", "e2"]),
    text,
    st.integers(-1, 20),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8),
    st.builds(lambda extra, max_tokens: {**extra, "max_tokens": max_tokens}, sampling_maps, st.integers(1, 4096)),
    text,
)


@FIXTURES
@given(requests=st.lists(call_requests, min_size=1, max_size=5, unique_by=lambda r: (r.episode_id, r.digest)))
def test_call_requests_read_back_equal_numbered_per_episode_and_a_retry_gets_the_same_call(client, keys, requests):
    k = fresh(keys)
    requester = calls.Requester(client, k)
    # calls made so far in each episode: the next call's index
    want, made = [], {"e1": 0, "e2": 0}
    for r in requests:
        index = made[r.episode_id]
        made[r.episode_id] += 1
        assert requester.request(replace(r)) == (index, True)
        # a retry: the call already made
        assert requester.request(replace(r)) == (index, False)
        want.append(replace(r, call=index))
    back = [calls.decode_request(*entry) for entry in client.xrange(k.calls)]
    assert back == [replace(w, entry_id=b.entry_id) for w, b in zip(want, back)] and len(back) == len(want)


@FIXTURES
@given(version=st.integers(0, 10**6), limit=st.integers(0, 10**6), max_staleness=st.integers(0, 100))
def test_an_opened_gate_reads_back_its_version_and_limit(client, keys, version, limit, max_staleness):
    k = fresh(keys)
    assert gate.peek(client, k) == (None, None) and gate.opened_version(client, k) is None
    gate.open(client, k, version, limit, max_staleness)
    assert gate.peek(client, k) == (version, limit) and gate.opened_version(client, k) == version


# ---------------------------------------------------------------------------------------------------------------
# 3. the trainer's batch: each generated token's log-prob, version and mask sit where the model predicts it

generated = st.lists(st.tuples(st.integers(3, 999), logprob, st.integers(0, 6)), min_size=1, max_size=4)
tool_output = st.lists(st.integers(3, 999), min_size=1, max_size=3)


@st.composite
def trained_episodes(draw, index):
    """An Episode whose response interleaves generated chunks (id, log-prob, version) and tool output (masked)."""
    ep = Episode(
        f"e{index}",
        "g",
        index,
        draw(st.lists(st.integers(3, 999), min_size=1, max_size=5)),
        {"temperature": 1.0},
        {},
        status="finished",
        finish_reason="stop",
        reward=draw(st.floats(0, 1)),
    )
    for chunk in draw(st.lists(st.one_of(generated, tool_output), min_size=1, max_size=5)):
        for tok in chunk:
            token, lp, version, mask = (tok, 0.0, -1, 0) if isinstance(tok, int) else (*tok, 1)
            ep.tokens.append(token)
            ep.logprobs.append(lp)
            ep.versions.append(version)
            ep.mask.append(mask)
    return ep


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.tuples(trained_episodes(0), trained_episodes(1)).map(list), min_size=1, max_size=3),
    trainer_version=st.integers(0, 8),
    hard_max_staleness=st.integers(0, 3),
)
def test_batch_puts_each_generated_tokens_logprob_and_version_where_the_model_predicts_it(
    groups, trainer_version, hard_max_staleness
):
    batch = build_batch(groups, pad_id=0, trainer_version=trainer_version, hard_max_staleness=hard_max_staleness)
    rows = [ep for group in groups for ep in group]
    assert batch.episode_ids == [ep.episode_id for ep in rows]
    for i, ep in enumerate(rows):
        full = ep.prompt_ids + ep.tokens
        assert batch.input_ids[i, : len(full)].tolist() == full and batch.lengths[i] == len(full)
        width = batch.targets.shape[1]
        want_mask, want_logp, want_version = [0.0] * width, [0.0] * width, [-1] * width
        for j, token in enumerate(ep.tokens):
            # the token's position; the logits at t - 1 predict it
            t = len(ep.prompt_ids) + j
            assert batch.targets[i, t - 1] == token
            if ep.mask[j]:
                fresh_enough = hard_max_staleness == 0 or trainer_version - ep.versions[j] <= hard_max_staleness
                want_mask[t - 1] = 1.0 if fresh_enough else 0.0
                want_logp[t - 1], want_version[t - 1] = ep.logprobs[j], ep.versions[j]
        # prompt, tool output and padding never train
        assert batch.loss_mask[i].tolist() == want_mask
        assert batch.behav_logp[i].tolist() == want_logp and batch.versions[i].tolist() == want_version


# ---------------------------------------------------------------------------------------------------------------
# 4. the checker: one fault injected into a clean run moves its own count, by the amount injected, and no other

COUNTS = MUST_BE_ZERO + ("versions_missing", "tokens_generated_again", "trained_unfinished")


@st.composite
def clean_runs(draw):
    """Every group enqueued, delivered, published once, trained once; one worker generated what the streams hold
    (built as tests/ops/test_checker.py builds its RunData)."""
    groups = [f"g{i}" for i in range(draw(st.integers(1, 4)))]
    size, ntok = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    # group k is made by policy k and committed at version k + 1 (trained by policy k): 0 versions stale
    episodes = {
        f"{g}-{i}": _entries(
            raw([started(episode_id=f"{g}-{i}", policy=k), tokens(1, range(ntok), policy=k), finished(2, policy=k)])
        )
        for k, g in enumerate(groups)
        for i in range(size)
    }
    return RunData(
        prompts=[(f"{1 + i}-0", encode_group(PromptGroup(g, size, prompt="1+1="))) for i, g in enumerate(groups)],
        rollout=ConsumerGroup(f"{len(groups)}-0"),
        samples=[
            (f"{100 + i}-0", samples.encode(samples.Sample(g, [f"{g}-{j}" for j in range(size)], "w", size)))
            for i, g in enumerate(groups)
        ],
        trainer=ConsumerGroup(f"{99 + len(groups)}-0"),
        episodes=episodes,
        ledger=[{"commit": 1 + i, "version": 1 + i, "groups": [g], "skipped": []} for i, g in enumerate(groups)],
        # as in mode sync
        staleness_bound=0,
        reports={"w": {"worker": "w", "tokens": ntok * len(episodes), "final": True}},
        versions=list(range(1, draw(st.integers(1, 4)))),
    )


def inject(data: RunData, fault: str, group: str, amount: int) -> dict[str, int]:
    """Put one fault of kind ``fault`` into ``data`` (about ``group``); the counts it must move, and by how much."""
    position = int(group[1:])
    if fault == "group delivered, never published":
        data.samples.pop(position)
        data.ledger[position]["groups"] = []
        return {"groups_lost": 1}
    if fault == "sample acknowledged, in no ledger record":
        data.ledger[position]["groups"] = []
        return {"groups_lost": 1}
    if fault == "group enqueued twice":
        data.prompts.append(("90-0", encode_group(PromptGroup(group, 1, prompt="again"))))
        return {"groups_enqueued_twice": 1}
    if fault == "group trained again":
        data.ledger += [{"version": 9, "groups": [group], "skipped": []}] * amount
        return {"samples_trained_twice": amount}
    if fault == "group published twice":
        data.samples.append(("200-0", data.samples[position][1]))
        data.trainer = ConsumerGroup("200-0")
        return {"episodes_finished_twice": 1}
    # its stream no longer folds: the trainer set it aside (a dead letter)
    if fault == "episode finished twice":
        entries = data.episodes[f"{group}-0"]
        data.episodes[f"{group}-0"] = entries + [("999-0", {**entries[-1][1], "seq": str(len(entries)).encode()})]
        data.dead.append({"stream": f"ep:{group}-0", "entry": "", "reason": "after the episode finished"})
        # and the stream no longer folds
        return {"episodes_finished_twice": 1, "episodes_unreadable": 1}
    if fault == "version published twice":
        data.versions.append(data.versions[-1] if data.versions else 0)
        return {"versions_repeated": 1}
    if fault == "version missing":
        data.versions.append((data.versions[-1] if data.versions else 0) + 2)
        return {"versions_missing": 1}
    if fault == "tokens generated again":
        data.reports["w"]["tokens"] += amount
        return {"tokens_generated_again": amount}
    if fault == "trained episode lost its finish":
        data.episodes[f"{group}-0"] = data.episodes[f"{group}-0"][:-1]
        return {"trained_unfinished": 1}
    if fault == "bad control entry":
        data.control.append(("60-0", {"type": "cmd", "cmd": "explode", "sync": "s"}))
        return {"bad_input_not_dead_lettered": 1}
    if fault == "bad samples entry, read":
        data.samples.append(("300-0", {"garbage": "1"}))
        data.trainer = ConsumerGroup("300-0")
        return {"bad_input_not_dead_lettered": 1}
    if fault == "bad prompts entry, delivered":
        data.prompts.append(("50-0", {"group_id": "bad group", "n": "2"}))
        data.rollout = ConsumerGroup("50-0")
        return {"bad_input_not_dead_lettered": 1}
    # the group's commit came `amount` versions later than its tokens
    if fault == "tokens trained stale":
        data.ledger[position] = {
            **data.ledger[position],
            "commit": position + 1 + amount,
            "version": position + 1 + amount,
        }
        return {
            "tokens_past_staleness_bound": sum(
                episode_stats(x).policy_tokens for eid, x in data.episodes.items() if eid.rsplit("-", 1)[0] == group
            )
        }
    if fault == "repack hand-over unmarked":
        entries = data.episodes[f"{group}-0"]
        # where the hand-over happened: after every token so far
        n = episode_stats(entries).policy_tokens
        hand_over = raw(
            [
                Event("aborted", 0, "S", 2, {"reason": "repack", "num_tokens": n}),
                Event("resumed", 0, "T", 3, {"num_tokens": n}),
            ]
        )
        data.episodes[f"{group}-0"] = (
            entries[:2]
            + [(f"99{i}-1", f) for i, (_, f) in enumerate(_entries(hand_over))]
            + [(entries[2][0], {**entries[2][1], "seq": b"4"})]
        )
        return {"repacks_unmarked": 1}
    if fault == "episode failed by the platform":
        entries = data.episodes[f"{group}-0"]
        failed = Event("failed", 0, "agents", len(entries) - 1, {"error": "lost the gateway", "where": "gateway"})
        data.episodes[f"{group}-0"] = entries[:-1] + [(entries[-1][0], f) for _, f in _entries(raw([failed]))]
        return {"episodes_failed_by_infrastructure": 1}
    assert fault == "unreadable episode entry"
    data.episodes[f"{group}-0"] = data.episodes[f"{group}-0"] + [("998-0", {"type": b"tokens", "v": b"9"})]
    return {"bad_input_not_dead_lettered": 1, "episodes_unreadable": 1}


FAULTS = (
    "group delivered, never published",
    "sample acknowledged, in no ledger record",
    "group enqueued twice",
    "group trained again",
    "group published twice",
    "episode finished twice",
    "version published twice",
    "version missing",
    "tokens generated again",
    "trained episode lost its finish",
    "bad control entry",
    "bad samples entry, read",
    "bad prompts entry, delivered",
    "unreadable episode entry",
    "episode failed by the platform",
    "tokens trained stale",
    "repack hand-over unmarked",
)


@settings(max_examples=150, deadline=None)
@given(data=clean_runs(), fault=st.sampled_from(FAULTS), pick=st.data(), amount=st.integers(1, 3))
def test_one_injected_fault_moves_its_own_count_by_the_amount_injected_and_no_other(data, fault, pick, amount):
    clean = check(data)
    assert clean.ok and all(getattr(clean, name) == 0 for name in COUNTS)
    group = pick.draw(st.sampled_from([s["group_id"] for _, s in data.samples]))
    moves = inject(data, fault, group, amount)
    faulty = check(data)
    assert {name: getattr(faulty, name) - getattr(clean, name) for name in COUNTS} == {
        name: moves.get(name, 0) for name in COUNTS
    }
    assert faulty.ok == (not set(moves) & set(MUST_BE_ZERO))

"""`streamrl check`: read a whole run back and count what exactly-once forbids.

The counts (definitions; docs/faults.md has the long form):

groups_lost
    prompt groups enqueued in ``prompts`` (valid entries) that are not in
    ``samples``, not pending in the rollout consumer group (delivered to a
    worker, not acknowledged) and not still waiting to be delivered (the same
    for validation groups, ``prompts:val`` -> ``samples:val``). Plus
    ``samples`` entries the trainer acknowledged whose group is in no ledger
    record (acknowledged but never trained nor judged untrainable).
episodes_finished_twice
    episode streams with more than one terminal event (``finished``/``failed``),
    plus prompt groups that have more than one ``samples`` entry.
samples_trained_twice
    prompt group ids that appear in the ``groups`` of more than one ledger
    record (``runs/<run>/trainer/trained.jsonl``), counted once per extra time.
tokens_generated_again
    tokens the rollout workers generated (the ``tokens`` counter of each
    worker's last ``rollout`` metrics record, written by its warm shutdown or,
    for a crash drill, by the fault probe) minus the policy tokens in all the
    run's episode streams. A token generated once is in a stream exactly once,
    so this is the number of tokens that were generated, lost (unflushed at a
    crash, or dropped with a fenced or Redis-lost tail) and generated again.
    ``None`` when a worker that wrote tokens has no final record (a crash with
    no probe: its last counter is stale, so the count is unknown).
trained_unfinished (informational)
    trained groups (ledger) whose episodes are, in the stream now, neither
    finished nor failed: the trainer trained them (finished: it reads nothing
    else) and then a Redis restart lost their last second; they are being
    generated again and will not be trained again (the ledger has them).
    0 on a run without a Redis crash.
bad_input_not_dead_lettered
    undecodable entries of ``prompts`` (delivered), ``samples`` (read by the
    trainer) and ``control``, and unreadable episode streams that a service
    used (its group was delivered), with no dead letter naming that stream
    (and, for the first three, that entry).

Informational counts: takeovers (resumes after a crashed worker), tail
resumes (a worker found the stream behind what it had written, e.g. after a
Redis restart lost the last second, and continued from the stream), dead
letters, groups trained / skipped, groups pending at the end.

``read_run`` does the I/O; everything else is pure functions over plain data.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared.protocol import control
from shared.protocol.events import TERMINAL_KINDS, EventError, decode
from shared.protocol.fold import fold
from shared.protocol.keys import ROLLOUT_GROUP, TRAINER_GROUP, Keys
from shared.protocol.prompts import decode_group

MUST_BE_ZERO = ("groups_lost", "episodes_finished_twice", "samples_trained_twice", "bad_input_not_dead_lettered")


def _s(v) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _entries(raw) -> list[tuple[str, dict]]:
    """XRANGE reply -> [(entry id, {str field: bytes value})]."""
    return [(_s(i), {_s(k): v for k, v in f.items()}) for i, f in raw]


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class ConsumerGroup:
    last_delivered: str = "0-0"
    pending: set[str] = field(default_factory=set)

    def delivered(self, entry_id: str) -> bool:
        return id_key(entry_id) <= id_key(self.last_delivered)


@dataclass
class RunData:
    """Everything the checker reads, as plain data (hand-built in unit tests)."""
    prompts: list[tuple[str, dict]] = field(default_factory=list)
    rollout: ConsumerGroup = field(default_factory=ConsumerGroup)
    samples: list[tuple[str, dict]] = field(default_factory=list)
    trainer: ConsumerGroup = field(default_factory=ConsumerGroup)
    control: list[tuple[str, dict]] = field(default_factory=list)
    episodes: dict[str, list[tuple[str, dict]]] = field(default_factory=dict)  # episode id -> entries
    ledger: list[dict] = field(default_factory=list)
    dead: list[dict] = field(default_factory=list)  # {stream, entry, reason, by}
    reports: dict[str, dict] = field(default_factory=dict)  # worker -> its last rollout metrics record
    val_prompts: list[tuple[str, dict]] = field(default_factory=list)  # validation rounds (never trained)
    val_rollout: ConsumerGroup = field(default_factory=ConsumerGroup)
    val_samples: list[tuple[str, dict]] = field(default_factory=list)
    prompts_key: str = "prompts"
    samples_key: str = "samples"
    control_key: str = "control"
    episode_key_prefix: str = "ep:"


# --- pure counting functions -------------------------------------------------------------------

def valid_groups(prompts: list[tuple[str, dict]]) -> tuple[dict[str, list[str]], list[str]]:
    """{group id: [entry ids]} of decodable prompt entries, and the ids of undecodable ones."""
    groups: dict[str, list[str]] = {}
    bad = []
    for entry_id, fields in prompts:
        try:
            g = decode_group(entry_id, fields)
        except EventError:
            bad.append(entry_id)
            continue
        groups.setdefault(g.group_id, []).append(entry_id)
    return groups, bad


def sample_groups(samples: list[tuple[str, dict]]) -> tuple[dict[str, list[tuple[str, list[str]]]], list[str]]:
    """{group id: [(entry id, episode ids)]} of well-formed samples entries, and the ids of the others."""
    out: dict[str, list[tuple[str, list[str]]]] = {}
    bad = []
    for entry_id, fields in samples:
        group_id, eids = _s(fields.get("group_id", b"")), _s(fields.get("episodes", b""))
        if not group_id or not eids:
            bad.append(entry_id)
            continue
        out.setdefault(group_id, []).append((entry_id, eids.split(",")))
    return out, bad


def ledger_counts(ledger: list[dict]) -> tuple[Counter, set[str]]:
    """(times each group was trained, groups ever judged untrainable)."""
    trained = Counter(g for rec in ledger for g in rec.get("groups", []))
    skipped = {g for rec in ledger for g in rec.get("skipped", [])}
    return trained, skipped


def _lost_in_rollout(prompts, rollout: ConsumerGroup, samples, prefix: str = "") -> list[str]:
    groups, _ = valid_groups(prompts)
    published, _ = sample_groups(samples)
    lost = []
    for group_id, entry_ids in groups.items():
        if group_id in published:
            continue
        if any(e in rollout.pending or not rollout.delivered(e) for e in entry_ids):
            continue  # still in flight, or still waiting for a worker: not lost
        lost.append(prefix + group_id)
    return lost


def count_lost(data: RunData) -> tuple[list[str], list[str]]:
    """(prompt groups lost between prompts and samples, samples groups lost between samples and the ledger).
    Validation groups (``prompts:val`` -> ``samples:val``, never trained) count in the first, as ``val:<id>``."""
    published, _ = sample_groups(data.samples)
    lost_in_rollout = _lost_in_rollout(data.prompts, data.rollout, data.samples)
    lost_in_rollout += _lost_in_rollout(data.val_prompts, data.val_rollout, data.val_samples, "val:")
    trained, skipped = ledger_counts(data.ledger)
    lost_in_training = []
    for group_id, entries in published.items():
        if group_id in trained or group_id in skipped:
            continue
        if any(e in data.trainer.pending or not data.trainer.delivered(e) for e, _ in entries):
            continue  # the trainer has it in hand (uncommitted) or has not read it yet
        lost_in_training.append(group_id)
    return sorted(lost_in_rollout), sorted(lost_in_training)


@dataclass
class EpisodeStats:
    terminal_events: int = 0
    policy_tokens: int = 0
    takeovers: int = 0
    tail_resumes: int = 0
    bad_entries: int = 0
    status: str = "unreadable"  # fold's status, or 'unreadable' when fold refuses the stream
    error: str = ""


def episode_stats(entries: list[tuple[str, dict]]) -> EpisodeStats:
    """Counts from one episode stream, event by event (so a stream that fold refuses still counts)."""
    st = EpisodeStats()
    previous = None
    for entry_id, fields in entries:
        try:
            ev = decode(entry_id, fields)
        except EventError:
            st.bad_entries += 1
            continue
        if ev.kind in TERMINAL_KINDS:
            st.terminal_events += 1
        elif ev.kind == "tokens":
            st.policy_tokens += len(ev.data["ids"])
        elif ev.kind == "resumed":
            if ev.data.get("takeover_from"):
                st.takeovers += 1
            elif previous is not None and previous.kind not in ("aborted", "tool_result") and "call" not in ev.data:
                # not after an abort, nor a tool result that came back during a pause, nor a takeover:
                # the writer found the stream behind what it had written and continued from the stream
                st.tail_resumes += 1
        previous = ev
    try:
        st.status = fold(entries).status
    except EventError as exc:
        st.error = str(exc)
    return st


def tokens_generated_again(reports: dict[str, dict], stats: dict[str, EpisodeStats],
                           writers: set[str]) -> tuple[int | None, list[str]]:
    """Σ tokens each worker generated − Σ policy tokens in the streams; None (and who) when a
    worker that wrote tokens, or reported any, has no final report (its counter is not complete)."""
    missing = sorted(w for w in writers | set(reports) if not reports.get(w, {}).get("final"))
    if missing:
        return None, missing
    generated = sum(int(r.get("tokens", 0)) + int(r.get("call_tokens", 0)) for r in reports.values())
    return generated - sum(s.policy_tokens for s in stats.values()), []


def token_writers(episodes: dict[str, list[tuple[str, dict]]]) -> set[str]:
    """Workers that wrote (well-formed) tokens events."""
    out = set()
    for entries in episodes.values():
        for entry_id, f in entries:
            if _s(f.get("type", b"")) == "tokens":
                try:
                    out.add(decode(entry_id, f).worker)
                except EventError:
                    pass
    return out


def dead_lettered(dead: list[dict], stream: str, entry_id: str | None = None) -> bool:
    return any(d.get("stream") == stream and (entry_id is None or d.get("entry") == entry_id) for d in dead)


def count_bad_input(data: RunData, stats: dict[str, EpisodeStats]) -> tuple[list[str], int]:
    """(bad entries no dead letter names, bad entries found) over prompts, samples, control, episodes."""
    missing, found = [], 0
    _, bad_prompts = valid_groups(data.prompts)
    for entry_id in bad_prompts:
        found += 1
        if data.rollout.delivered(entry_id) and not dead_lettered(data.dead, data.prompts_key, entry_id):
            missing.append(f"{data.prompts_key} {entry_id}")
    _, bad_samples = sample_groups(data.samples)
    for entry_id in bad_samples:
        found += 1
        if data.trainer.delivered(entry_id) and not dead_lettered(data.dead, data.samples_key, entry_id):
            missing.append(f"{data.samples_key} {entry_id}")
    for entry_id, fields in data.control:
        try:
            control.decode_entry(entry_id, fields)
        except EventError:
            found += 1
            if not dead_lettered(data.dead, data.control_key, entry_id):
                missing.append(f"{data.control_key} {entry_id}")
    groups, _ = valid_groups(data.prompts)
    used = {g for g, ids in groups.items() if any(data.rollout.delivered(e) for e in ids)}
    for eid, st in stats.items():
        if st.status != "unreadable" and not st.bad_entries:
            continue
        found += 1
        group_id = eid.rsplit("-", 1)[0]
        key = data.episode_key_prefix + eid
        if group_id in used and not dead_lettered(data.dead, key):
            missing.append(key)
    return missing, found


@dataclass
class Report:
    groups_enqueued: int = 0
    groups_published: int = 0
    groups_trained: int = 0
    groups_skipped: int = 0
    groups_in_flight: int = 0  # pending or undelivered at the end, not lost
    episodes: int = 0
    groups_lost: int = 0
    episodes_finished_twice: int = 0
    samples_trained_twice: int = 0
    tokens_generated_again: int | None = 0
    trained_unfinished: int = 0
    bad_input_not_dead_lettered: int = 0
    bad_input_found: int = 0
    dead_letters: int = 0
    takeovers: int = 0
    tail_resumes: int = 0
    tokens_in_streams: int = 0
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(getattr(self, k) == 0 for k in MUST_BE_ZERO)

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "must_be_zero": list(MUST_BE_ZERO)}


def check(data: RunData) -> Report:
    r = Report()
    groups, _ = valid_groups(data.prompts)
    published, _ = sample_groups(data.samples)
    trained, skipped = ledger_counts(data.ledger)
    stats = {eid: episode_stats(entries) for eid, entries in data.episodes.items()}
    lost_rollout, lost_training = count_lost(data)
    twice_done = sorted(eid for eid, st in stats.items() if st.terminal_events > 1)
    twice_published = sorted(g for g, entries in published.items() if len(entries) > 1)
    twice_trained = sorted(g for g, n in trained.items() if n > 1)
    regen, no_report = tokens_generated_again(data.reports, stats, token_writers(data.episodes))
    unfinished = sorted(g for g in trained if g in published
                        for eid in published[g][-1][1] if stats.get(eid) and stats[eid].status in ("running", "paused"))
    bad_missing, bad_found = count_bad_input(data, stats)
    r.groups_enqueued, r.groups_published = len(groups), len(published)
    r.groups_trained, r.groups_skipped = len(trained), len(skipped - set(trained))
    r.groups_in_flight = sum(1 for g, ids in groups.items() if g not in published and g not in lost_rollout)
    r.episodes = len(stats)
    r.groups_lost = len(lost_rollout) + len(lost_training)
    r.episodes_finished_twice = len(twice_done) + len(twice_published)
    r.samples_trained_twice = sum(trained[g] - 1 for g in twice_trained)
    r.tokens_generated_again = regen
    r.trained_unfinished = len(set(unfinished))
    r.bad_input_not_dead_lettered, r.bad_input_found = len(bad_missing), bad_found
    r.dead_letters = len(data.dead)
    r.takeovers = sum(s.takeovers for s in stats.values())
    r.tail_resumes = sum(s.tail_resumes for s in stats.values())
    r.tokens_in_streams = sum(s.policy_tokens for s in stats.values())
    r.details = {"groups_lost_in_rollout": lost_rollout[:50], "groups_lost_in_training": lost_training[:50],
                 "episodes_finished_twice": twice_done[:50], "groups_published_twice": twice_published[:50],
                 "groups_trained_twice": twice_trained[:50], "trained_unfinished": sorted(set(unfinished))[:50],
                 "bad_input_not_dead_lettered": bad_missing[:50], "workers_without_final_report": no_report,
                 "tokens_generated": {w: int(rep.get("tokens", 0)) for w, rep in sorted(data.reports.items())}}
    return r


def format_report(r: Report, run: str) -> str:
    rows = [("prompt groups lost", r.groups_lost, True), ("episodes finished twice", r.episodes_finished_twice, True),
            ("samples trained twice", r.samples_trained_twice, True),
            ("tokens generated again", "unknown" if r.tokens_generated_again is None else r.tokens_generated_again,
             False),
            ("trained, then lost by Redis", r.trained_unfinished, False),
            ("bad input not dead-lettered", r.bad_input_not_dead_lettered, True)]
    lines = [f"run {run!r}: {r.groups_enqueued} groups enqueued, {r.groups_published} finished, "
             f"{r.groups_trained} trained, {r.groups_skipped} judged untrainable, {r.groups_in_flight} in flight; "
             f"{r.episodes} episodes, {r.tokens_in_streams} policy tokens in streams"]
    for name, value, must in rows:
        flag = ("ok" if value == 0 else "FAIL") if must else ""
        lines.append(f"  {name:<32} {value!s:>8}  {flag}")
    lines.append(f"  {'takeovers after a crash':<32} {r.takeovers:>8}")
    lines.append(f"  {'resumes after a lost tail':<32} {r.tail_resumes:>8}")
    lines.append(f"  {'bad input found / dead letters':<32} {f'{r.bad_input_found}/{r.dead_letters}':>8}")
    for name, items in r.details.items():
        if items and name != "tokens_generated":
            lines.append(f"  {name}: {', '.join(map(str, items))}")
    lines.append("ok" if r.ok else "FAILED: a count that must be 0 is not")
    return "\n".join(lines)


# --- I/O ---------------------------------------------------------------------------------------

def _consumer_group(client, stream: str, name: str) -> ConsumerGroup:
    if not client.exists(stream):
        return ConsumerGroup()
    info = {_s(g["name"]): g for g in client.xinfo_groups(stream)}
    if name not in info:
        return ConsumerGroup()
    pending = set()
    start = "-"
    while True:
        batch = client.xpending_range(stream, name, min=start, max="+", count=1000)
        pending |= {_s(p["message_id"]) for p in batch}
        if len(batch) < 1000:
            break
        ms, seq = id_key(_s(batch[-1]["message_id"]))
        start = f"{ms}-{seq + 1}"
    return ConsumerGroup(_s(info[name]["last-delivered-id"]), pending)


def read_run(client, keys: Keys, run_path: Path) -> RunData:
    from shared.protocol.ledger import read_ledger

    data = RunData(prompts_key=keys.prompts, samples_key=keys.samples, control_key=keys.control,
                   episode_key_prefix=keys.episode(""))
    data.prompts = _entries(client.xrange(keys.prompts))
    data.rollout = _consumer_group(client, keys.prompts, ROLLOUT_GROUP)
    data.samples = _entries(client.xrange(keys.samples))
    data.trainer = _consumer_group(client, keys.samples, TRAINER_GROUP)
    data.control = _entries(client.xrange(keys.control))
    if hasattr(keys, "val_prompts"):
        data.val_prompts = _entries(client.xrange(keys.val_prompts))
        data.val_rollout = _consumer_group(client, keys.val_prompts, ROLLOUT_GROUP)
        data.val_samples = _entries(client.xrange(keys.val_samples))
    for key in client.scan_iter(match=keys.episode("*"), count=1000, _type="stream"):
        data.episodes[keys.episode_id(key)] = _entries(client.xrange(key))
    data.ledger = read_ledger(Path(run_path) / "trainer")
    data.dead = [{k: _s(v) for k, v in f.items()} for _, f in _entries(client.xrange(keys.dead_letters))]
    for _, f in _entries(client.xrange(keys.metrics)):
        if _s(f.get("kind", b"")) == "rollout":
            rec = json.loads(f["json"])
            data.reports[rec.get("worker", "")] = rec
    return data

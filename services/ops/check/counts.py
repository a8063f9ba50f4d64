"""The checker's counts: pure functions over ``RunData`` (definitions in services/ops/check/checker.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from services.ops.check.data import ConsumerGroup, RunData
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import TERMINAL_KINDS, decode
from shared.protocol.episode.fold import fold
from shared.protocol.streams import control, samples
from shared.protocol.streams.prompts import decode_group


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


def sample_groups(entries: list[tuple[str, dict]]) -> tuple[dict[str, list[tuple[str, list[str]]]], list[str]]:
    """{group id: [(entry id, episode ids)]} of well-formed samples entries, and the ids of the others."""
    good, bad = samples.decode_all(entries)
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for s in good:
        out.setdefault(s.group_id, []).append((s.entry_id, s.episodes))
    return out, [entry_id for entry_id, _ in bad]


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
            # still in flight, or still waiting for a worker: not lost
            continue
        lost.append(prefix + group_id)
    return lost


def _lost_agent_groups(data: RunData) -> list[str]:
    """Agent groups recorded by the driver, never published, and with no episode's job waiting or running."""
    groups, _ = valid_groups(data.agent_groups)
    published, _ = sample_groups(data.samples)
    lost = []
    for group_id, entry_ids in groups.items():
        if group_id in published:
            continue
        g = decode_group(entry_ids[0], dict(data.agent_groups)[entry_ids[0]])
        if any(eid in data.agents_busy for eid in g.episode_ids()):
            # still in hand
            continue
        lost.append(group_id)
    return lost


def count_lost(data: RunData) -> tuple[list[str], list[str]]:
    """(prompt groups lost between prompts and samples, samples groups lost between samples and the ledger).
    Validation groups (``prompts:val`` -> ``samples:val``, never trained) count in the first, as ``val:<id>``."""
    published, _ = sample_groups(data.samples)
    lost_in_rollout = _lost_in_rollout(data.prompts, data.rollout, data.samples)
    lost_in_rollout += _lost_in_rollout(data.val_prompts, data.val_rollout, data.val_samples, "val:")
    lost_in_rollout += _lost_agent_groups(data)
    trained, skipped = ledger_counts(data.ledger)
    lost_in_training = []
    for group_id, entries in published.items():
        if group_id in trained or group_id in skipped:
            continue
        if any(e in data.trainer.pending or not data.trainer.delivered(e) for e, _ in entries):
            # the trainer has it in hand (uncommitted) or has not read it yet
            continue
        lost_in_training.append(group_id)
    return sorted(lost_in_rollout), sorted(lost_in_training)


@dataclass
class EpisodeStats:
    terminal_events: int = 0
    policy_tokens: int = 0
    takeovers: int = 0
    tail_resumes: int = 0
    bad_entries: int = 0
    # hand-overs of a repack whose 'resumed' does not name the source in 'repacked'
    repack_unmarked: int = 0
    # policy version -> tokens the loss would train
    trained_versions: Counter = field(default_factory=Counter)
    # fold's status, or 'unreadable' when fold refuses the stream
    status: str = "unreadable"
    error: str = ""
    # the ``where`` of its failed event, when it failed
    failed_where: str = ""


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
            if ev.kind == "failed":
                st.failed_where = str(ev.data.get("where") or "")
        elif ev.kind == "tokens":
            st.policy_tokens += len(ev.data["ids"])
        elif ev.kind == "resumed":
            if previous is not None and previous.kind == "aborted" and previous.data.get("reason") == "repack":
                # the target names it; a takeover of a dead target names the target
                source = previous.worker
                if ev.data.get("repacked") != source and ev.data.get("takeover_from") in (None, source):
                    st.repack_unmarked += 1
            if ev.data.get("takeover_from"):
                st.takeovers += 1
            elif previous is not None and previous.kind not in ("aborted", "tool_result") and "call" not in ev.data:
                # not after an abort, nor a tool result that came back during a pause, nor a takeover:
                # the writer found the stream behind what it had written and continued from the stream
                st.tail_resumes += 1
        previous = ev
    try:
        ep = fold(entries)
    except EventError as exc:
        st.error = str(exc)
        return st
    st.status = ep.status
    # what the trainer's loss would take: policy tokens of sampled (not greedy) rows
    for row in ep.rows:
        if float(row.sampling.get("temperature", 1.0)) > 0:
            st.trained_versions.update(v for v, m in zip(row.versions, row.mask) if m and v >= 0)
    return st


def tokens_generated_again(
    reports: dict[str, dict], stats: dict[str, EpisodeStats], writers: set[str]
) -> tuple[int | None, list[str]]:
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
            try:
                ev = decode(entry_id, f)
            except EventError:
                continue
            if ev.kind == "tokens":
                out.add(ev.worker)
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
        key = data.episode_key_prefix + eid + data.episode_key_suffix
        if group_id in used and not dead_lettered(data.dead, key):
            missing.append(key)
    return missing, found


def enqueued_twice(prompts: list[tuple[str, dict]]) -> list[str]:
    """Prompt groups with more than one (valid) entry in the prompts stream."""
    groups, _ = valid_groups(prompts)
    return sorted(g for g, ids in groups.items() if len(ids) > 1)


def version_sequence(numbers: list[int]) -> tuple[list[int], list[int]]:
    """(versions published again or out of order, versions missing between 1 and the newest), in stream order."""
    repeated, newest = [], 0
    for v in numbers:
        if v <= newest:
            repeated.append(v)
        newest = max(newest, v)
    return repeated, sorted(set(range(1, newest + 1)) - set(numbers))


def loads_backwards(control_entries: list[tuple[str, dict]], pull_loads: list[tuple[str, int]]) -> list[str]:
    """Times a worker reported running an older version than it had reported before: each control ack carries the
    version the worker runs after the command (in stream order, per worker), and each pulled load the version
    loaded (sync_mode pull). A worker never goes back to an older version, in any mode."""
    found, newest = [], {}
    acks = []
    for entry_id, fields in control_entries:
        try:
            entry = control.decode_entry(entry_id, fields)
        except EventError:
            # counted as bad input
            continue
        if isinstance(entry, dict) and entry.get("version", "").lstrip("-").isdigit():
            acks.append((entry["worker"], int(entry["version"]), f"{entry['cmd']} ack {entry_id}"))
    for worker, version, what in [*acks, *((w, v, f"pulled load of {v}") for w, v in pull_loads)]:
        key = (worker, what.startswith("pulled"))
        if version < newest.get(key, -1):
            found.append(f"{worker}: {what} at version {version} after {newest[key]}")
        newest[key] = max(newest.get(key, -1), version)
    return found


def trained_past_bound(data: RunData, stats: dict[str, EpisodeStats]) -> tuple[int | None, int, list[str]]:
    """(tokens trained more than the run's staleness bound behind, the oldest trained token's staleness, which
    groups). A group committed in the ledger line of version V was trained by policy V − 1; each of its finished
    episodes' sampled policy tokens made by version v is V − 1 − v versions stale. The bound is 0 in mode sync (the
    gate opens a version's groups only after every worker runs it) and ``hard_max_staleness`` when set (the
    trainer masks older tokens out: the tokens past it less the trainer's own ``stale_tokens_masked``); with
    neither there is no bound (None)."""
    published, _ = sample_groups(data.samples)
    past, oldest, groups = 0, 0, []
    for rec in data.ledger:
        if "commit" not in rec:
            # a line of groups judged untrainable: nothing trained
            continue
        at = int(rec["version"]) - 1
        for g in rec.get("groups", []):
            n = 0
            for eid in published[g][-1][1] if g in published else []:
                for v, count in stats[eid].trained_versions.items() if eid in stats else ():
                    oldest = max(oldest, at - v)
                    if data.staleness_bound is not None and at - v > data.staleness_bound:
                        n += count
            if n:
                past += n
                groups.append(f"{g} ({n} tokens at version {at})")
    if data.staleness_bound is None:
        return None, oldest, []
    return max(0, past - data.stale_tokens_masked), oldest, groups

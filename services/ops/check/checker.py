"""`streamrl check`: read a whole run back and count what exactly-once forbids.

The counts (definitions; docs/faults.md has the long form):

groups_lost
    prompt groups enqueued in ``prompts`` (valid entries) that are not in
    ``samples``, not pending in the rollout consumer group (delivered to a
    worker, not acknowledged) and not still waiting to be delivered (the same
    for validation groups, ``prompts:val`` -> ``samples:val``). Plus
    ``samples`` entries the trainer acknowledged whose group is in no ledger
    record (acknowledged but never trained nor judged untrainable).
groups_enqueued_twice
    prompt group ids with more than one valid entry in ``prompts`` (or
    ``prompts:val``): a retried enqueue that was not idempotent.
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
versions_repeated
    entries of ``versions`` whose version is not newer than every entry
    before it (published twice, or out of order). ``versions_missing``
    (informational) lists the numbers between 1 and the newest that no entry
    has: 0 on a run without a Redis crash (after one, the trainer republishes
    only its newest version).
bad_input_not_dead_lettered
    undecodable entries of ``prompts`` (delivered), ``samples`` (read by the
    trainer) and ``control``, and unreadable episode streams that a service
    used (its group was delivered), with no dead letter naming that stream
    (and, for the first three, that entry).

tokens_past_staleness_bound
    policy tokens the trainer trained more versions behind than the run's
    bound: a group in the ledger line of version V was trained by policy
    V - 1, and each sampled policy token of its finished episodes made by
    version v is V - 1 - v stale. The bound is 0 with ``mode = sync`` and
    ``hard_max_staleness`` when set (the trainer masks older tokens out, so
    the count is the tokens past it less the trainer's own
    ``stale_tokens_masked``); without either there is no bound ("no bound":
    the admission gate bounds groups in start order only, docs/training.md)
    and the row only shows the stalest token trained.
episodes_unreadable
    episode streams that fold refuses (an undecodable entry, a gap, an event
    after the terminal one), whatever became of them: dead-lettered or not,
    such an episode cannot be replayed, trained or browsed.
episodes_failed_by_infrastructure
    episodes whose ``failed`` event names a part of the platform as the
    cause (``where`` in events.INFRASTRUCTURE_FAILURES: an agent that lost
    the gateway for good), not the episode's prompt, model, reward or agent.
versions_rederived_differently
    versions a restore of the trainer trained again from the log (its newest
    snapshot, then the ledger's commits after it) whose weights' sha256 is
    not the one their version event holds: a non-deterministic kernel, or an
    episode gone from the log. Training goes on from the re-derived weights
    (docs/faults.md); ``versions re-trained at restores`` counts them all.
repacks_unmarked
    long-tail repacks whose hand-over ``resumed`` (the event right after the
    source's ``aborted`` with reason ``repack``) does not name the source in
    ``repacked`` (and is not a takeover from a dead target).

trained_nothing
    1 when a whole run (read with its config) has episodes but the trainer
    published no version and trained no group: a run that could not train
    (every episode failed, say) is not ``ok``.

loads_backwards
    a worker reporting an older version than it reported before: the
    version each control ack carries (what the worker runs after the
    command), in stream order per worker, and each pulled load (``pulls``
    stream, sync_mode pull). A command of an older sync is acked and ignored,
    so no ack goes back.

Informational counts: takeovers (resumes after a crashed worker), tail
resumes (a worker found the stream behind what it had written, e.g. after a
Redis restart lost the last second, and continued from the stream), dead
letters, groups trained / skipped, groups pending at the end.

``read_run`` does the I/O; everything else is pure functions over plain data.
"""

from __future__ import annotations

from services.ops.check.counts import (
    EpisodeStats,
    count_bad_input,
    count_lost,
    dead_lettered,
    enqueued_twice,
    episode_stats,
    ledger_counts,
    loads_backwards,
    sample_groups,
    token_writers,
    tokens_generated_again,
    trained_past_bound,
    valid_groups,
    version_sequence,
)
from services.ops.check.data import ConsumerGroup, RunData, _entries, id_key, read_run
from services.ops.check.report import MUST_BE_ZERO, Report, format_report
from shared.protocol.episode.events import INFRASTRUCTURE_FAILURES

__all__ = [
    "ConsumerGroup",
    "EpisodeStats",
    "MUST_BE_ZERO",
    "Report",
    "RunData",
    "_entries",
    "check",
    "count_bad_input",
    "count_lost",
    "dead_lettered",
    "enqueued_twice",
    "episode_stats",
    "format_report",
    "id_key",
    "ledger_counts",
    "loads_backwards",
    "read_run",
    "sample_groups",
    "token_writers",
    "tokens_generated_again",
    "valid_groups",
    "version_sequence",
]


def check(data: RunData) -> Report:
    r = Report()
    groups, _ = valid_groups(data.prompts + data.agent_groups)
    published, _ = sample_groups(data.samples)
    trained, skipped = ledger_counts(data.ledger)
    stats = {eid: episode_stats(entries) for eid, entries in data.episodes.items()}
    lost_rollout, lost_training = count_lost(data)
    twice_done = sorted(eid for eid, st in stats.items() if st.terminal_events > 1)
    twice_published = sorted(g for g, entries in published.items() if len(entries) > 1)
    twice_trained = sorted(g for g, n in trained.items() if n > 1)
    regen, no_report = tokens_generated_again(data.reports, stats, token_writers(data.episodes))
    unfinished = sorted(
        g
        for g in trained
        if g in published
        for eid in published[g][-1][1]
        if stats.get(eid) and stats[eid].status in ("running", "paused")
    )
    bad_missing, bad_found = count_bad_input(data, stats)
    r.groups_enqueued, r.groups_published = len(groups), len(published)
    r.groups_trained, r.groups_skipped = len(trained), len(skipped - set(trained))
    r.groups_in_flight = sum(1 for g, ids in groups.items() if g not in published and g not in lost_rollout)
    r.episodes = len(stats)
    r.groups_lost = len(lost_rollout) + len(lost_training)
    r.episodes_finished_twice = len(twice_done) + len(twice_published)
    twice_enqueued = enqueued_twice(data.prompts + data.agent_groups) + [
        f"val:{g}" for g in enqueued_twice(data.val_prompts)
    ]
    r.groups_enqueued_twice = len(twice_enqueued)
    repeated, gaps = version_sequence(data.versions)
    r.versions_repeated, r.versions_missing = len(repeated), len(gaps)
    r.samples_trained_twice = sum(trained[g] - 1 for g in twice_trained)
    r.tokens_generated_again = regen
    r.trained_unfinished = len(set(unfinished))
    r.bad_input_not_dead_lettered, r.bad_input_found = len(bad_missing), bad_found
    r.dead_letters = len(data.dead)
    backwards = loads_backwards(data.control, data.pull_loads)
    r.loads_backwards = len(backwards)
    r.staleness_bound = data.staleness_bound
    r.tokens_past_staleness_bound, r.oldest_trained, past = trained_past_bound(data, stats)
    unreadable = sorted(eid for eid, st in stats.items() if st.status == "unreadable")
    r.episodes_unreadable = len(unreadable)
    infra = sorted(eid for eid, st in stats.items() if st.failed_where in INFRASTRUCTURE_FAILURES)
    r.episodes_failed_by_infrastructure = len(infra)
    unmarked = sorted(eid for eid, st in stats.items() if st.repack_unmarked)
    r.repacks_unmarked = sum(stats[eid].repack_unmarked for eid in unmarked)
    r.takeovers = sum(s.takeovers for s in stats.values())
    r.tail_resumes = sum(s.tail_resumes for s in stats.values())
    r.tokens_in_streams = sum(s.policy_tokens for s in stats.values())
    r.versions_replayed = sum(len(rec.get("replayed", [])) for rec in data.replays)
    differing = sorted(v for rec in data.replays for v in rec.get("differing", []))
    r.versions_rederived_differently = len(differing)
    r.trained_nothing = int(
        data.expect_training and r.episodes > 0 and not trained and not any(v > 0 for v in data.versions)
    )
    r.details = {
        "groups_lost_in_rollout": lost_rollout[:50],
        "groups_lost_in_training": lost_training[:50],
        "episodes_finished_twice": twice_done[:50],
        "groups_published_twice": twice_published[:50],
        "groups_trained_twice": twice_trained[:50],
        "groups_enqueued_twice": twice_enqueued[:50],
        "versions_repeated": repeated[:50],
        "versions_missing": gaps[:50],
        "trained_unfinished": sorted(set(unfinished))[:50],
        "bad_input_not_dead_lettered": bad_missing[:50],
        "loads_backwards": backwards[:50],
        "tokens_past_staleness_bound": past[:50],
        "repacks_unmarked": unmarked[:50],
        "episodes_unreadable": [f"{eid} ({stats[eid].error[:200]})" for eid in unreadable[:50]],
        "episodes_failed_by_infrastructure": infra[:50],
        "versions_rederived_differently": differing[:50],
        "workers_without_final_report": no_report,
        "tokens_generated": {w: int(rep.get("tokens", 0)) for w, rep in sorted(data.reports.items())},
    }
    return r

"""The checker's report: what must be zero, and how it prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

MUST_BE_ZERO = (
    "groups_lost",
    "groups_enqueued_twice",
    "episodes_finished_twice",
    "samples_trained_twice",
    "versions_repeated",
    "bad_input_not_dead_lettered",
    "loads_backwards",
    "tokens_past_staleness_bound",
    "repacks_unmarked",
    "episodes_unreadable",
    "episodes_failed_by_infrastructure",
    "versions_rederived_differently",
    "trained_nothing",
)


@dataclass
class Report:
    groups_enqueued: int = 0
    groups_published: int = 0
    groups_trained: int = 0
    groups_skipped: int = 0
    # pending or undelivered at the end, not lost
    groups_in_flight: int = 0
    episodes: int = 0
    groups_lost: int = 0
    groups_enqueued_twice: int = 0
    versions_repeated: int = 0
    versions_missing: int = 0
    episodes_finished_twice: int = 0
    samples_trained_twice: int = 0
    tokens_generated_again: int | None = 0
    trained_unfinished: int = 0
    bad_input_not_dead_lettered: int = 0
    bad_input_found: int = 0
    loads_backwards: int = 0
    # None: the run has no bound (mode async, hard_max_staleness 0)
    tokens_past_staleness_bound: int | None = 0
    staleness_bound: int | None = None
    # versions behind, the stalest token trained
    oldest_trained: int = 0
    repacks_unmarked: int = 0
    episodes_unreadable: int = 0
    episodes_failed_by_infrastructure: int = 0
    # restores: versions the trainer trained again from the log, and those whose weights hashed otherwise
    versions_replayed: int = 0
    versions_rederived_differently: int = 0
    # 1: episodes were rolled out and the trainer published no version nor trained a group (a run that cannot train)
    trained_nothing: int = 0
    dead_letters: int = 0
    takeovers: int = 0
    tail_resumes: int = 0
    tokens_in_streams: int = 0
    details: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        # None: not measurable on this run
        return all(getattr(self, k) in (0, None) for k in MUST_BE_ZERO)

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "must_be_zero": list(MUST_BE_ZERO)}


def format_report(r: Report, run: str) -> str:
    rows = [
        ("prompt groups lost", r.groups_lost, True),
        ("prompt groups enqueued twice", r.groups_enqueued_twice, True),
        ("versions published twice", r.versions_repeated, True),
        ("versions missing", r.versions_missing, False),
        ("episodes finished twice", r.episodes_finished_twice, True),
        ("samples trained twice", r.samples_trained_twice, True),
        ("tokens generated again", "unknown" if r.tokens_generated_again is None else r.tokens_generated_again, False),
        ("trained, then lost by Redis", r.trained_unfinished, False),
        ("bad input not dead-lettered", r.bad_input_not_dead_lettered, True),
        ("weight loads going backwards", r.loads_backwards, True),
        (
            f"tokens trained > {r.staleness_bound} versions stale"
            if r.staleness_bound is not None
            else "tokens trained past a bound",
            "no bound" if r.tokens_past_staleness_bound is None else r.tokens_past_staleness_bound,
            r.tokens_past_staleness_bound is not None,
        ),
        ("repack hand-overs not marked", r.repacks_unmarked, True),
        ("episodes unreadable", r.episodes_unreadable, True),
        ("episodes the platform failed", r.episodes_failed_by_infrastructure, True),
        ("versions re-derived differently", r.versions_rederived_differently, True),
        ("trainer trained nothing", r.trained_nothing, True),
    ]
    lines = [
        f"run {run!r}: {r.groups_enqueued} groups enqueued, {r.groups_published} finished, "
        f"{r.groups_trained} trained, {r.groups_skipped} judged untrainable, {r.groups_in_flight} in flight; "
        f"{r.episodes} episodes, {r.tokens_in_streams} policy tokens in streams"
    ]
    for name, value, must in rows:
        flag = ("ok" if value == 0 else "FAIL") if must else ""
        lines.append(f"  {name:<32} {value!s:>8}  {flag}")
    lines.append(f"  {'stalest token trained (versions)':<32} {r.oldest_trained:>8}")
    lines.append(f"  {'takeovers after a crash':<32} {r.takeovers:>8}")
    lines.append(f"  {'resumes after a lost tail':<32} {r.tail_resumes:>8}")
    lines.append(f"  {'versions re-trained at restores':<32} {r.versions_replayed:>8}")
    lines.append(f"  {'bad input found / dead letters':<32} {f'{r.bad_input_found}/{r.dead_letters}':>8}")
    for name, items in r.details.items():
        if items and name != "tokens_generated":
            lines.append(f"  {name}: {', '.join(map(str, items))}")
    if r.trained_nothing:
        lines.append(f"  the trainer trained nothing: 0 versions published, {r.episodes} episodes attempted")
    lines.append("ok" if r.ok else "FAILED: a count that must be 0 is not")
    return "\n".join(lines)

"""`streamrl episodes`: find the episodes worth looking at (failed, reward 0, aborted three times, taken over,
repacked, spanning several versions) and print their ids for `streamrl replay`.

``summarize`` (pure, over one stream's entries through ``fold``) makes one row per episode; ``Filters.keep`` and
``ordered`` choose and sort rows; ``read_summaries`` is the I/O: every episode stream of the run, read in
pipelined batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from shared.protocol.episode.errors import EventError
from shared.protocol.episode.fold import fold

OUTCOMES = ("finished", "failed", "truncated", "running", "paused", "unreadable")
# finish reasons of an episode cut short
TRUNCATED = ("length", "context")
SORTS = ("id", "reward", "length", "span", "aborts")


@dataclass
class Summary:
    episode_id: str
    group_id: str = ""
    outcome: str = "unreadable"
    reward: float | None = None
    # tokens the policy generated
    length: int = 0
    # distinct policy versions of its tokens
    versions: list[int] = field(default_factory=list)
    aborts: int = 0
    takeovers: int = 0
    repacks: int = 0
    agent: bool = False
    calls: int = 0
    error: str = ""

    @property
    def span(self) -> int:
        return len(self.versions)

    def line(self) -> str:
        reward = "-" if self.reward is None else f"{self.reward:.3f}"
        versions = (
            f"v{self.versions[0]}" + (f"..v{self.versions[-1]}" if self.span > 1 else "") if self.versions else "-"
        )
        extra = "".join(
            f", {n} {what}"
            for n, what in (
                (self.aborts, "aborts"),
                (self.takeovers, "takeovers"),
                (self.repacks, "repacks"),
                (self.calls, "calls"),
            )
            if n
        )
        why = f"  ({self.error[:80]})" if self.error else ""
        return (
            f"{self.episode_id:<24} {self.outcome:<10} reward {reward:>6}  {self.length:>5} tokens  {versions}"
            f"{extra}{why}"
        )


def summarize(episode_id: str, entries) -> Summary:
    try:
        ep = fold(entries)
    except EventError as exc:
        return Summary(episode_id, episode_id.rsplit("-", 1)[0], error=str(exc))
    outcome = ep.status
    if ep.status == "finished" and ep.finish_reason in TRUNCATED:
        outcome = "truncated"
    return Summary(
        episode_id,
        ep.group_id,
        outcome,
        ep.reward,
        ep.num_generated,
        sorted({v for v in ep.versions if v >= 0}),
        len(ep.aborts),
        sum(1 for r in ep.resumes if r.get("takeover_from")),
        sum(1 for r in ep.resumes if r.get("repacked")),
        ep.agent is not None,
        len(ep.calls),
        ep.error or "",
    )


@dataclass
class Filters:
    outcomes: tuple[str, ...] = ()
    reward_below: float | None = None
    reward_above: float | None = None
    min_aborts: int = 0
    min_span: int = 0
    taken_over: bool = False
    repacked: bool = False
    agent: bool | None = None
    group: str = ""

    def __post_init__(self):
        unknown = set(self.outcomes) - set(OUTCOMES)
        if unknown:
            raise ValueError(f"--outcome: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(OUTCOMES)}")

    def keep(self, s: Summary) -> bool:
        return (
            (not self.outcomes or s.outcome in self.outcomes)
            and (self.reward_below is None or (s.reward is not None and s.reward < self.reward_below))
            and (self.reward_above is None or (s.reward is not None and s.reward > self.reward_above))
            and s.aborts >= self.min_aborts
            and s.span >= self.min_span
            and (not self.taken_over or s.takeovers > 0)
            and (not self.repacked or s.repacks > 0)
            and (self.agent is None or s.agent == self.agent)
            and (not self.group or s.group_id == self.group)
        )


def ordered(rows: list[Summary], by: str = "id", descending: bool = False) -> list[Summary]:
    if by not in SORTS:
        raise ValueError(f"--sort: expected one of {', '.join(SORTS)}, got {by!r}")
    # episodes without a reward (failed, still running) last, either way
    if by == "reward":
        return sorted((s for s in rows if s.reward is not None), key=lambda s: s.reward, reverse=descending) + [
            s for s in rows if s.reward is None
        ]
    key = {
        "id": lambda s: s.episode_id,
        "length": lambda s: s.length,
        "span": lambda s: s.span,
        "aborts": lambda s: s.aborts,
    }[by]
    return sorted(rows, key=key, reverse=descending)


def read_summaries(client, keys, batch: int = 500, archive=None) -> Iterator[Summary]:
    """One summary per episode of the run: every episode stream (a SCAN of the episode keys, XRANGEs pipelined by
    ``batch``), then every episode of the archive's segments (``shared/protocol/archive/segments.py``) not in Redis."""
    names: list = []
    hot: set[str] = set()
    for key in client.scan_iter(match=keys.episode("*"), count=1000, _type="stream"):
        names.append(key)
        hot.add(keys.episode_id(key))
        if len(names) == batch:
            yield from _batch(client, keys, names)
            names = []
    yield from _batch(client, keys, names)
    if archive is not None:
        for episode_id, entries in archive.iter_all():
            # a crash mid-move leaves it in both tiers for a moment: counted once
            if episode_id not in hot:
                yield summarize(episode_id, entries)


def _batch(client, keys, names) -> Iterator[Summary]:
    if not names:
        return
    pipe = client.pipeline(transaction=False)
    for key in names:
        pipe.xrange(key)
    for key, entries in zip(names, pipe.execute()):
        yield summarize(keys.episode_id(key), entries)


def to_json(s: Summary) -> dict:
    return {**asdict(s), "span": s.span}

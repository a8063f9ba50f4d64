"""The staleness gate as pure functions (no Redis).

A token produced by policy version v and trained by the trainer at version V is V − v versions
stale; a sample is as stale as its oldest policy-generated token. Tokens no policy generated (prompt,
tool output) carry a negative version (−1) and are ignored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence


def group_capacity(
    current_version: int,
    max_staleness: int,
    groups_per_version: int,
    started_groups: int,
    max_in_flight: int | None = None,
    running_groups: int = 0,
) -> int:
    """How many more prompt groups may start now (AReaL's admission control).

    With η = ``max_staleness``, v = ``current_version``, B = ``groups_per_version`` (groups the trainer
    consumes per version) and S = ``started_groups`` (groups ever started: accepted + running)::

        capacity = max(0, min(max_in_flight − running_groups, (η + v + 1)·B − S))

    the first term only when ``max_in_flight`` is given. Why it bounds staleness: if the trainer consumes
    groups in start order, exactly B per version, the group started k-th (0-based) is trained at version
    ⌊k / B⌋; admitted at version s means k < (η + s + 1)·B, so ⌊k / B⌋ − s ≤ η.
    """
    _check_max_staleness(max_staleness)
    if groups_per_version < 1:
        raise ValueError(f"groups_per_version must be >= 1, got {groups_per_version}")
    for name, value in (
        ("current_version", current_version),
        ("started_groups", started_groups),
        ("running_groups", running_groups),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if max_in_flight is not None and max_in_flight < 0:
        raise ValueError(f"max_in_flight must be >= 0 or None, got {max_in_flight}")
    capacity = (max_staleness + current_version + 1) * groups_per_version - started_groups
    if max_in_flight is not None:
        capacity = min(capacity, max_in_flight - running_groups)
    return max(0, capacity)


def staleness(trainer_version: int, token_versions: Sequence[int]) -> int:
    """max(0, trainer_version − min(generated token versions)); 0 when no token was policy-generated."""
    oldest = min((v for v in token_versions if v >= 0), default=None)
    return 0 if oldest is None else max(0, trainer_version - oldest)


def is_too_stale(trainer_version: int, token_versions: Sequence[int], max_staleness: int) -> bool:
    """staleness(trainer_version, token_versions) > max_staleness."""
    _check_max_staleness(max_staleness)
    return staleness(trainer_version, token_versions) > max_staleness


def staleness_histogram(trainer_version: int, samples_token_versions: Iterable[Sequence[int]]) -> dict[int, int]:
    """Versions behind (max(0, trainer_version − v)) -> number of policy-generated tokens, over all samples."""
    return dict(Counter(max(0, trainer_version - v) for versions in samples_token_versions for v in versions if v >= 0))


def _check_max_staleness(max_staleness: int) -> None:
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")


def version_spans(episodes) -> dict[str, float]:
    """How many policy versions each response's tokens were generated with (a response that crossed two weight
    syncs mid-generation spans 3; verl's ``max_partial_span``): ``version_span_max`` and ``version_span_mean``
    over episodes with policy tokens (objects with ``versions``: −1 for tokens no policy generated)."""
    spans = [len({v for v in ep.versions if v >= 0}) for ep in episodes]
    spans = [n for n in spans if n]
    return {"version_span_max": max(spans, default=0), "version_span_mean": sum(spans) / len(spans) if spans else 0.0}

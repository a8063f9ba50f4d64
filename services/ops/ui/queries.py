"""The episodes page's query string to ``Filters`` and a page (pure): a bad value is a clear error naming the
parameter and what it expects."""

from __future__ import annotations

from dataclasses import dataclass

from services.ops.inspect.episodes import OUTCOMES, SORTS, Filters

MAX_PAGE = 500


class QueryError(ValueError):
    pass


@dataclass
class Query:
    filters: Filters
    sort: str = "id"
    desc: bool = False
    offset: int = 0
    limit: int = 50


def _num(params, name: str, kind, default=None, low=None):
    raw = params.get(name, "")
    if raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise QueryError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {raw[:40]!r}") from None
    if low is not None and value < low:
        raise QueryError(f"{name}: expected >= {low}, got {value}")
    return value


def _flag(params, name: str) -> bool:
    raw = params.get(name, "").lower()
    if raw not in ("", "0", "1", "true", "false", "on", "off"):
        raise QueryError(f"{name}: expected 1/0 or true/false, got {raw[:40]!r}")
    return raw in ("1", "true", "on")


def parse(params) -> Query:
    """``params``: a mapping of query parameters (outcome, reward_below, reward_above, min_aborts, min_span,
    taken_over, repacked, kind, group, sort, desc, offset, limit)."""
    outcomes = tuple(o for o in params.get("outcome", "").split(",") if o)
    unknown = sorted(set(outcomes) - set(OUTCOMES))
    if unknown:
        raise QueryError(f"outcome: unknown {', '.join(unknown)}; expected some of {', '.join(OUTCOMES)}")
    kind = params.get("kind", "")
    if kind not in ("", "agent", "plain"):
        raise QueryError(f"kind: expected agent or plain, got {kind[:40]!r}")
    sort = params.get("sort", "") or "id"
    if sort not in SORTS:
        raise QueryError(f"sort: expected one of {', '.join(SORTS)}, got {sort[:40]!r}")
    filters = Filters(
        outcomes,
        _num(params, "reward_below", float),
        _num(params, "reward_above", float),
        _num(params, "min_aborts", int, 0, 0),
        _num(params, "min_span", int, 0, 0),
        _flag(params, "taken_over"),
        _flag(params, "repacked"),
        None if not kind else kind == "agent",
        params.get("group", ""),
    )
    limit = _num(params, "limit", int, 50, 1)
    if limit > MAX_PAGE:
        raise QueryError(f"limit: expected at most {MAX_PAGE}, got {limit}")
    return Query(filters, sort, _flag(params, "desc"), _num(params, "offset", int, 0, 0), limit)

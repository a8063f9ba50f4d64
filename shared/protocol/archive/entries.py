"""Format 3 and 4 segment rows: an episode's entries split into per-entry columns, so that what episodes share is
stored once per segment (Parquet's dictionary pages) and what they do not is small numbers (delta- and bit-packed).

An entry of the usual shape (fields exactly ``type, v, policy, worker, seq, data`` in that order, ``seq`` its
position, ``policy`` a decimal integer, entry id ``<ms>-<n>``) is one element in each list:

    ms, sub     its entry id's two numbers, ``ms`` as the step from the entry before (the row's ``t0`` is the
                first entry's; steps are a few values per segment, dictionary-coded)
    kinds, hv   its ``type`` and ``v`` (dictionary-coded: a handful of values per segment)
    policies    its ``policy``
    workers     its ``worker`` (dictionary-coded)
    payloads    its ``data``; None for a ``tokens`` entry whose ids and log-probs went to the token columns
                (``tok_counts`` says how many; only a payload that is exactly ``{ids, logprobs}`` as msgpack
                writes it, shared/protocol/archive/columns.py), and in format 4 for the two payloads below

The first ``started`` entry's payload with its own fields (``episode_id``, ``index``, ``sampling.seed``) set to nil:
a group's episodes then share one payload value, prompt ids and all, stored once (the row's ``index`` and ``seed``
columns keep the values taken out; a seed the rollout's rule made, ``episode_seed(base, group, index)``, is kept
as its ``seed_base``, the same in every row). Format 3 keeps it in ``payloads``; format 4 in the row's own
``start`` column, and the last entry's payload when it is the end (``finished`` / ``failed``) in ``end``: one
value per row, so that the rows of a group (written one after the other) repeat the same dictionary index, a run
that Parquet's RLE stores in a few bits, where inside ``payloads`` they alternated with other entries' nulls.

Any other entry keeps its id and fields whole in ``others`` (its ``kinds`` element is empty). ``pack`` checks
that ``unpack`` gives back each moved part byte for byte, and keeps the part whole where it would not.
"""

from __future__ import annotations

import msgpack

from shared.protocol.archive import templates as segment_templates
from shared.protocol.archive.columns import token_payload
from shared.protocol.archive.templates import Templates
from shared.protocol.episode.sampling import episode_seed

HEADERS = [b"type", b"v", b"policy", b"worker", b"seq", b"data"]
LISTS = ("ms", "sub", "kinds", "hv", "policies", "workers", "payloads")
INT64 = (-(1 << 63), 1 << 63)
POSITIONS = [str(n).encode() for n in range(64)]
# decimal text -> its integer (``_int``)
_SHORT: dict[bytes, int] = {}
TERMINAL = (b"finished", b"failed")
PLAIN = {b"started", b"tokens", b"aborted", b"resumed", b"tool_call", b"tool_result", b"finished", b"failed"}


def _int(raw: bytes) -> int | None:
    """The integer a decimal text spells, only when writing it back gives the same bytes. Short ones (an entry id's
    sequence, a policy version: a few values in a segment) are remembered."""
    n = _SHORT.get(raw)
    if n is not None:
        return n
    # the usual case, checked cheaply
    if raw.isdigit() and len(raw) < 19 and (raw[:1] != b"0" or len(raw) == 1):
        n = int(raw)
        if len(raw) <= 6:
            if len(_SHORT) >= 1 << 14:
                _SHORT.clear()
            _SHORT[raw] = n
        return n
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if str(n).encode() == raw and INT64[0] <= n < INT64[1] else None


def _split(position: int, entry_id: bytes, flat: list[bytes]) -> tuple | None:
    """(ms, sub, kind, v, policy, worker, data) of an entry of the usual shape, else None. (The ``_SHORT`` lookups
    are ``_int``'s first step, inlined: three calls an entry were a tenth of the archiver's CPU.)"""
    if (
        len(flat) != 12
        or flat[::2] != HEADERS
        or not flat[1]
        or flat[9] != (POSITIONS[position] if position < len(POSITIONS) else str(position).encode())
    ):
        return None
    ms, _, sub = entry_id.partition(b"-")
    ms, sub, policy = _int(ms), _SHORT.get(sub, sub), _SHORT.get(flat[5], flat[5])
    if sub.__class__ is bytes:
        sub = _int(sub)
    if policy.__class__ is bytes:
        policy = _int(policy)
    if ms is None or sub is None or policy is None or not -(1 << 31) <= policy < 1 << 31:
        return None
    return ms, sub, flat[1], flat[3], policy, flat[7], flat[11]


def _position(position: int) -> bytes:
    return POSITIONS[position] if position < len(POSITIONS) else str(position).encode()


def fill(payload: bytes, episode_id: str, index: int, seed: int | None, seed_base: int | None) -> bytes:
    """A started payload with its own fields put back (the inverse of ``_template``)."""
    data = msgpack.unpackb(payload, raw=False)
    data["episode_id"], data["index"] = episode_id, index
    if seed_base is not None:
        seed = episode_seed(seed_base, data["group_id"], index)
    if seed is not None:
        data["sampling"]["seed"] = seed
    return msgpack.packb(data, use_bin_type=True)


def _template(episode_id: str, data: bytes, seed_base: int | None, templates: Templates | None = None) -> tuple | None:
    """(payload with the episode's own fields nil, index, seed, seed base, group id) of a started payload, or None
    (kept whole). Of ``seed`` and ``seed base`` one at most is set. ``templates``: the last group's template, tried
    first (shared/protocol/archive/templates.py: the same answer off the bytes)."""
    if templates is not None and seed_base is not None:
        fast = templates.match_rule(data, episode_id, seed_base)
        if fast is not None:
            return fast[0], fast[1], None, seed_base, fast[2]
    hit = templates.match(data, episode_id) if templates is not None else None
    if hit is None:
        hit = _take_apart(episode_id, data, templates)
        if hit is None:
            return None
    payload, index, seed, group_id = hit
    if seed is not None and seed_base is not None and seed == episode_seed(seed_base, group_id, index):
        return payload, index, None, seed_base, group_id
    return payload, index, seed, None, group_id


def _take_apart(episode_id: str, data: bytes, templates: Templates | None) -> tuple | None:
    """(template, index, seed, group id) of a started payload, decoded, or None. With ``templates``: the payload's
    ``Cut`` (one pack, with marks in the slots) must give ``data`` back with the decoded values in its slots
    (``match``), and then goes to ``templates`` for the group's next payloads. Else, or when it cannot be cut: the
    template is packed with nil in the slots and the check that ``fill`` gives ``data`` back puts the fields back
    into the same decoded object and packs it (a template is packed from an unpacked object, and unpacking it gives
    that object again: msgpack round-trips what it decoded, so this is what ``fill`` does without decoding the
    template once more)."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except Exception:  # noqa: BLE001 - an undecodable payload is simply kept as it is
        return None
    if not isinstance(d, dict) or d.get("episode_id") != episode_id or type(d.get("index")) is not int:
        return None
    index, seed, sampling, group_id = d["index"], None, d.get("sampling"), d.get("group_id")
    if not -(1 << 31) <= index < 1 << 31 or not isinstance(group_id, str):
        return None
    seeded = (
        isinstance(sampling, dict) and type(sampling.get("seed")) is int and INT64[0] <= sampling["seed"] < INT64[1]
    )
    if templates is not None:
        c = segment_templates.cut(d, seeded, group_id)
        if c is not None and segment_templates.match(c, data, episode_id) == (
            index,
            sampling["seed"] if seeded else None,
        ):
            templates.learn(c)
            return c.template, index, sampling["seed"] if seeded else None, group_id
    d["episode_id"] = d["index"] = None
    if seeded:
        seed, sampling["seed"] = sampling["seed"], None
    try:
        payload = msgpack.packb(d, use_bin_type=True)
        d["episode_id"], d["index"] = episode_id, index
        if seed is not None:
            sampling["seed"] = seed
        if msgpack.packb(d, use_bin_type=True) != data:
            return None
    except Exception:  # noqa: BLE001 - what does not come back whole is kept whole
        return None
    return payload, index, seed, group_id


# one value per episode
ROW = ("index", "seed", "seed_base", "t0", "start", "end")
# an entry kept whole, in each of LISTS
_KEPT = (0, 0, b"", b"", 0, b"", None)
# ROW of an episode kept whole
_WHOLE = (None, None, None, 0, None, None)


class Columns:
    """The entry columns of a segment's episodes, built column by column as each is added (``add``): no row dicts,
    no per-episode lists to transpose into columns afterwards.

        lists      LISTS, each flat: one value per entry of every episode (``entries``: how many per episode)
        row        ROW, one value per episode
        others     the entries kept whole, flat (``others_n``: how many per episode)
        tok_counts the moved ``tokens`` entries' counts, flat (``tok_n``: how many per episode); ``tokens``: each
                   episode's moved tokens; ``ids`` / ``lps``: their raw little-endian bytes, in order
    """

    def __init__(self, seed_base: int | None = None, templates: Templates | None = None):
        # the run's ``seed``
        self.seed_base = seed_base
        self.templates = templates if templates is not None else Templates()
        self.lists: tuple[list, ...] = tuple([] for _ in LISTS)
        self.row: dict[str, list] = {name: [] for name in ROW}
        self.entries: list[int] = []
        self.others: list[list[bytes]] = []
        self.others_n: list[int] = []
        self.tok_counts: list[int] = []
        self.tok_n: list[int] = []
        self.tokens: list[int] = []
        self.ids: list[bytes] = []
        self.lps: list[bytes] = []

    def add(self, episode_id: str, entries: list[tuple[bytes, list[bytes]]]) -> tuple | None:
        """Add an episode's (entry id, flat fields) pairs. Returns ``(group id, last worker, end kind, end payload,
        tokens, newest policy of a token)`` when the episode is plain, else None: its first entry a ``started``
        whose payload was templated, every entry of the usual shape and of a kind in ``PLAIN``, every ``tokens``
        entry moved to the token columns, its last entry its end (shared/protocol/archive/summary.py reads the
        analysis columns off these, without a fold)."""
        parsed, others, counts, ids, lps = [], [], [], [], []
        index = seed = seed_base = group_id = start = end = None
        t0 = last = None
        started, plain, tokens, version, n = False, True, 0, -1, len(entries)
        for position, (entry_id, flat) in enumerate(entries):
            parts = _split(position, entry_id, flat)
            if parts is None:
                parsed.append(_KEPT)
                others.append([entry_id, *flat])
                plain = False
                continue
            ms, sub, kind, v, policy, worker, payload = parts
            if last is None:
                t0 = last = ms
            ms, last = ms - last, ms
            if not -(1 << 31) <= ms < 1 << 31:
                return self._add_whole(entries)
            if kind == b"tokens":
                moved = token_payload(payload)
                if moved is None:
                    plain = False
                else:
                    payload, count = None, len(moved[0]) >> 2
                    counts.append(count)
                    ids.append(moved[0])
                    lps.append(moved[1])
                    tokens += count
                    if count and policy > version:
                        version = policy
            elif kind == b"started" and not started:
                started = True
                taken = _template(episode_id, payload, seed_base=self.seed_base, templates=self.templates)
                if taken is not None:
                    start, index, seed, seed_base, group_id = taken
                    payload = None
            elif kind in TERMINAL and position == n - 1:
                end, payload = payload, None
            elif kind not in PLAIN:
                plain = False
            parsed.append((ms, sub, kind, v, policy, worker, payload))
        for column, values in zip(self.lists, zip(*parsed)):
            column.extend(values)
        for name, value in zip(ROW, (index, seed, seed_base, t0 or 0, start, end)):
            self.row[name].append(value)
        self._counts(n, others, counts, tokens, ids, lps)
        if plain and end is not None and group_id is not None and parsed[0][2] == b"started":
            return group_id, parsed[-1][5], parsed[-1][2], end, tokens, version
        return None

    def _add_whole(self, entries: list[tuple[bytes, list[bytes]]]) -> None:
        """Every entry kept whole in ``others`` (an entry id ``ms`` steps out of int32's range)."""
        for column, blank in zip(self.lists, _KEPT):
            column.extend([blank] * len(entries))
        for name, value in zip(ROW, _WHOLE):
            self.row[name].append(value)
        self._counts(len(entries), [[i, *flat] for i, flat in entries], [], 0, [], [])
        return None

    def _counts(self, n: int, others: list, counts: list[int], tokens: int, ids: list[bytes], lps: list[bytes]):
        self.entries.append(n)
        self.others += others
        self.others_n.append(len(others))
        self.tok_counts += counts
        self.tok_n.append(len(counts))
        self.tokens.append(tokens)
        self.ids += ids
        self.lps += lps


def unpack(episode_id: str, row: dict, ids: bytes, lps: bytes) -> list[tuple[bytes, dict]]:
    """A row's entry columns (and its token bytes, in entry order) -> its entries as XRANGE returns them (a row of
    format 3, without ``start`` / ``end``, or of format 4)."""
    others, counts = iter(row["others"]), iter(row["tok_counts"])
    out, at, started, now = [], 0, False, row["t0"]
    start, end = row.get("start"), row.get("end")
    for position, (ms, sub, kind, v, policy, worker, payload) in enumerate(zip(*(row[n] for n in LISTS))):
        if not kind:
            flat = next(others)
            out.append((flat[0], dict(zip(flat[1::2], flat[2::2]))))
            continue
        now += ms
        if kind == b"started" and not started:
            started = True
            if payload is None:
                payload = start
            if row["index"] is not None:
                payload = fill(payload, episode_id, row["index"], row["seed"], row["seed_base"])
        elif payload is None and kind == b"tokens":
            end_at = at + 4 * next(counts)
            payload = msgpack.packb({"ids": ids[at:end_at], "logprobs": lps[at:end_at]}, use_bin_type=True)
            at = end_at
        elif payload is None:
            payload = end
        fields = dict(zip(HEADERS, (kind, v, str(policy).encode(), worker, _position(position), payload)))
        out.append((f"{now}-{sub}".encode(), fields))
    return out

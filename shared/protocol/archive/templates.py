"""A group's ``started`` payload, taken apart once and matched by its bytes for the group's next episodes.

Format 4 stores the first ``started`` payload of an episode with its own fields (``episode_id``, ``index``,
``sampling.seed``) set to nil (shared/protocol/archive/entries.py): the group's template. Every episode of a group
starts from the same prompt, so its payload is the template's bytes with those three values packed into their
slots. ``Templates`` keeps the last template found, cut at its slots (``Cut``): an episode's payload matches when
it is the pieces with the episode's own id and two integers in between, each packed as ``msgpack.packb`` packs it
(the shortest form). A match says what decoding, templating and re-packing would say (the same template, index
and seed: msgpack packs a map's values one by one, so the same bytes around a slot are the same other fields), for
a few slices instead of a decode and two packs. Anything else is no match (the caller takes the payload apart).
"""

from __future__ import annotations

import msgpack

from shared.protocol.episode.sampling import episode_seed

EPISODE, INDEX, SEED = 0, 1, 2
# the slots' order in a run's own started payloads
_USUAL = [EPISODE, INDEX, SEED]
# as bin values
_MARKS = [f"\x00streamrl-template-slot-{slot}\x00".encode() for slot in (EPISODE, INDEX, SEED)]
_PACKED_MARKS = [msgpack.packb(mark, use_bin_type=True) for mark in _MARKS]
_INTS = {
    0xCC: (1, False),
    0xCD: (2, False),
    0xCE: (4, False),
    0xCF: (8, False),
    0xD0: (1, True),
    0xD1: (2, True),
    0xD2: (4, True),
    0xD3: (8, True),
}
INT32 = (-(1 << 31), 1 << 31)
INT64 = (-(1 << 63), 1 << 63)
_SMALL = [msgpack.packb(n) for n in range(128)]
# msgpack's fixstr header of a string of n bytes
_STR_HEADS = [bytes([0xA0 | n]) for n in range(32)]


def _packed(n: int) -> bytes:
    return _SMALL[n] if 0 <= n < 128 else msgpack.packb(n)


def _int_at(data: bytes, at: int) -> int | None:
    """The msgpack integer at ``data[at]`` (any width; the caller checks it is the shortest), or None."""
    if at >= len(data):
        return None
    tag = data[at]
    if tag < 0x80:
        return tag
    if tag >= 0xE0:
        return tag - 0x100
    width = _INTS.get(tag)
    if width is None or at + 1 + width[0] > len(data):
        return None
    return int.from_bytes(data[at + 1 : at + 1 + width[0]], "big", signed=width[1])


class Cut:
    """A template's bytes cut at its slots: ``pieces[k]`` comes before ``slots[k]``, ``pieces[-1]`` after the last."""

    __slots__ = ("pieces", "slots", "template", "group_id")

    def __init__(self, pieces: list[bytes], slots: list[int], template: bytes, group_id: str):
        self.pieces, self.slots, self.template, self.group_id = pieces, slots, template, group_id


def cut(decoded: dict, seeded: bool, group_id: str) -> Cut | None:
    """The ``Cut`` of a payload: ``decoded`` is the payload decoded (its own values in place, put back after),
    ``seeded`` whether its ``sampling.seed`` is a slot. Its template, the pieces with nil in each slot, is what
    packing it with nil in the slots gives (msgpack packs a map's values one by one). None when a slot cannot be
    told apart."""
    episode_id, index = decoded["episode_id"], decoded["index"]
    sampling = decoded["sampling"] if seeded else None
    seed = sampling["seed"] if seeded else None
    decoded["episode_id"], decoded["index"] = _MARKS[EPISODE], _MARKS[INDEX]
    if seeded:
        sampling["seed"] = _MARKS[SEED]
    try:
        marked = msgpack.packb(decoded, use_bin_type=True)
    except Exception:  # noqa: BLE001 - what does not pack is not cut
        return None
    finally:
        decoded["episode_id"], decoded["index"] = episode_id, index
        if seeded:
            sampling["seed"] = seed
    taken = (EPISODE, INDEX, SEED) if seeded else (EPISODE, INDEX)
    slots = sorted((marked.find(_PACKED_MARKS[slot]), slot) for slot in taken)
    pieces, at = [], 0
    for position, slot in slots:
        if position < 0 or marked.count(_PACKED_MARKS[slot]) != 1:
            return None
        pieces.append(marked[at:position])
        at = position + len(_PACKED_MARKS[slot])
    pieces.append(marked[at:])
    return Cut(pieces, [slot for _, slot in slots], b"\xc0".join(pieces), group_id)


def match(c: Cut, data: bytes, episode_id: str) -> tuple[int, int | None] | None:
    """(index, seed or None) when ``data`` is ``c``'s template with ``episode_id``, an index (int32) and, where the
    template has a seed slot, a seed (int64) in its slots, each packed the shortest way; else None."""
    at, values = 0, [None, None, None]
    for piece, slot in zip(c.pieces, c.slots):
        if not data.startswith(piece, at):
            return None
        at += len(piece)
        if slot == EPISODE:
            packed = _packed_str(episode_id)
            if packed is None or not data.startswith(packed, at):
                return None
            at += len(packed)
            continue
        tag = data[at] if at < len(data) else 0xC0
        # a positive fixint: the shortest form of 0-127
        if tag < 0x80:
            values[slot], at = tag, at + 1
            continue
        value = _int_at(data, at)
        bounds = INT32 if slot == INDEX else INT64
        if value is None or not bounds[0] <= value < bounds[1]:
            return None
        packed = _packed(value)
        if not data.startswith(packed, at):
            return None
        values[slot], at = value, at + len(packed)
    last = c.pieces[-1]
    if len(data) - at != len(last) or not data.endswith(last):
        return None
    return values[INDEX], values[SEED]


def _packed_str(episode_id: str) -> bytes | None:
    """An episode id as ``msgpack.packb`` packs it, or None (not UTF-8 encodable)."""
    try:
        raw = episode_id.encode()
    except UnicodeEncodeError:
        return None
    return _STR_HEADS[len(raw)] + raw if len(raw) < len(_STR_HEADS) else msgpack.packb(episode_id)


class Templates:
    """The last template found (a group's episodes are moved one after the other): ``match`` tries it, ``learn``
    replaces it."""

    def __init__(self):
        self.last: Cut | None = None
        self.hits = self.misses = 0

    def match(self, data: bytes, episode_id: str) -> tuple[bytes, int, int | None, str] | None:
        """(template, index, seed, group id) of a payload the last template matches, or None."""
        if self.last is not None:
            hit = match(self.last, data, episode_id)
            if hit is not None:
                self.hits += 1
                return self.last.template, hit[0], hit[1], self.last.group_id
        self.misses += 1
        return None

    def match_rule(self, data: bytes, episode_id: str, seed_base: int) -> tuple[bytes, int, str] | None:
        """(template, index, group id) when ``data`` is exactly the last template with this episode's id, an index
        of 0-127 and the seed the rollout's rule makes of them (``episode_seed(seed_base, group, index)``) in its
        slots: one join and one compare, the usual case on a run's own episodes. Else None (``match`` decides);
        where this answers, ``match`` gives the same index, and that seed."""
        c = self.last
        if c is None or c.slots != _USUAL:
            return None
        packed = _packed_str(episode_id)
        at = len(c.pieces[0]) + len(c.pieces[1]) + (len(packed) if packed is not None else 0)
        if packed is None or at >= len(data) or data[at] >= 0x80:
            return None
        index = data[at]
        seed = _packed(episode_seed(seed_base, c.group_id, index))
        if data != b"".join((c.pieces[0], packed, c.pieces[1], _SMALL[index], c.pieces[2], seed, c.pieces[3])):
            return None
        self.hits += 1
        return c.template, index, c.group_id

    def learn(self, c: Cut) -> None:
        self.last = c

"""Stop strings: the first token of a completion whose decoded text completes one.

Pure over a ``decode(ids) -> str`` function. Only a tail of the completion is
decoded for each token (enough tokens for the longest stop string and a few
characters more, doubled while a window decodes short: special tokens decode
to nothing, a character's bytes may span tokens), never the whole completion
each step. Checking token by token from the first one not checked before
finds the completing token: a stop string already in an earlier window would
have been found at its own token. The tokens before ``start`` may be a logged
prefix (a resumed call): a stop string that straddles the resume point is
found at the token that completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# characters decoded beyond the longest stop string: a window may start inside a character (decoded as U+FFFD)
SLACK = 4


def tail_text(decode: Callable[[list[int]], str], ids: Sequence[int], end: int, chars: int) -> str:
    """The decoded text of the shortest tail of ``ids[:end]`` (in doubling token counts) that decodes to at least
    ``chars`` characters, or of all of it."""
    k = chars
    while True:
        lo = max(0, end - k)
        text = decode(list(ids[lo:end]))
        if lo == 0 or len(text) >= chars:
            return text
        k *= 2


def first_stop(
    decode: Callable[[list[int]], str], ids: Sequence[int], start: int, stops: Sequence[str]
) -> tuple[int, str] | None:
    """(index of the token whose text completes a stop string, that string) for the first such token at or
    after ``start``, or None. When several complete at that token, the one that begins first (the answer is cut
    the most); ``ids[:start]`` are taken to hold none."""
    if not stops:
        return None
    chars = max(map(len, stops)) + SLACK
    for i in range(start, len(ids)):
        text = tail_text(decode, ids, i + 1, chars)
        hits = [(text.find(s), -len(s), s) for s in stops if s in text]
        if hits:
            return i, min(hits)[2]
    return None

"""What every stream codec does the same way: a field or reply as text or as an integer, and a consumer group made
sure of. One definition each, so a codec module holds only its own stream's schema."""

from __future__ import annotations

import redis


def text(value) -> str:
    """A field or reply value as text: bytes decoded as UTF-8 (a bad byte becomes U+FFFD, never an exception)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def integer(value) -> int:
    """A field or reply value as an integer (``ValueError`` naming the value when it is not one)."""
    return int(text(value))


def ensure_group(client, stream: str, group: str, start: str = "0") -> bool:
    """Create consumer group ``group`` on ``stream`` (and the stream) unless it exists; True when it was created.
    Every process that reads a stream through a group calls this at start: the first one creates, the rest find it."""
    try:
        client.xgroup_create(stream, group, id=start, mkstream=True)
        return True
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False

"""Writes a retried command can repeat, made idempotent by construction.

Every service retries a command through a server restart; a command the server executed whose reply was lost is sent
again. Each write that must happen once is therefore guarded server-side, in the same script as the write: a marker
key set with ``SET NX`` (prompt groups, agent samples, dead letters, gate requests), a field of a sync round's hash
set with ``HSETNX`` (control commands and acks) or a check against the stream's newest entry (versions). The second
execution is a no-op and says so in one debug log line (``duplicate_write_skipped``). docs/faults.md lists every
write and its guard."""

from __future__ import annotations

import structlog

# how long a marker is kept: far longer than any retry, short enough to expire
MARKER_TTL_S = 7 * 24 * 3600
# How long a marker that only guards a retried command is kept (control commands and acks, whose readers also
# drop a duplicate that gets in; a gate call's own token): a process retries a command for at most ``redis_wait``
# seconds, which config_checks keeps at or under half of this; shorter would let a retry through, longer only piles
# markers up (several per version).
RETRY_MARKER_TTL_S = 120


def skipped(write: str, **context) -> None:
    """Log the no-op of a repeated write (a retried command whose first execution's reply was lost)."""
    structlog.get_logger().debug("duplicate_write_skipped", write=write, **context)

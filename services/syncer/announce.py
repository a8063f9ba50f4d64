"""The syncer in ``sync_mode = pull``: a version is announced, not forced.

The trainer's entry on the ``versions`` stream is the announcement (path, sha256, url); each rollout worker
downloads it itself and loads it at a cheap point of its own (services/rollout/weights/puller.py). The syncer sends no
command: it opens the staleness gate for the new version at once, not complete (a worker still on an older
version w reserves only under w's own limit: shared/protocol/gate.py keeps the bound exact whatever mix of
versions runs), and marks it complete once every live worker's heartbeat reports the version or a newer one. It
checks that when a worker says it has loaded (a ``released`` entry of the ``pulls`` stream, written after the
worker's heartbeat carries its new version: one blocking read of both streams, no polling), and every 2 s for
workers whose heartbeat lapsed (a dead worker is not waited for) or a gate lost with a Redis restart. Each
completed version gets a ``sync`` metrics record (``sync_mode`` pull, ``total_s`` from the announcement).
"""

from __future__ import annotations

import time

from shared.protocol import gate
from shared.protocol.episode.errors import EventError
from shared.protocol.streams import metrics, pulls, versions

# longest blocking read; any entry on either stream ends it
BLOCK_MS = 1000
# heartbeats lapse without an event: looked at this often while a version is not complete
CHECK_S = 2.0


class Announcer:
    def __init__(self, syncer):
        # the Syncer: its config, client, keys, gate, live workers, heartbeat
        self.s = syncer
        # version -> time.monotonic() when this syncer saw it
        self.announced: dict[int, float] = {}
        self._next_check = 0.0

    def run(self, should_stop=lambda: False) -> None:
        s = self.s
        last = versions.latest(s.client, s.keys)
        cursor = last.entry_id if last else "0-0"
        s.version = last.version if last else 0
        # complete as soon as every live worker runs it (no record)
        s.set_gate(s.version, complete=False)
        self.check()
        pulls_cursor = pulls.last_id(s.client, s.keys)
        s.log.info("ready", version=s.version, sync_mode="pull")
        while not should_stop():
            s._beat()
            reply = (
                s.client.xread({s.keys.versions: cursor, s.keys.pulls: pulls_cursor}, count=100, block=BLOCK_MS) or []
            )
            loaded = False
            for stream, entries in reply:
                name = stream.decode() if isinstance(stream, bytes) else stream
                if name == s.keys.versions:
                    cursor = entries[-1][0].decode()
                    try:
                        newest = versions.decode(*entries[-1])
                    except EventError as exc:
                        s.log.error("versions entry unreadable; skipped", error=str(exc))
                        continue
                    if newest.version > s.version:
                        self.announce(newest.version)
                else:
                    pulls_cursor = entries[-1][0].decode()
                    loaded |= any(p.event in ("released", "expired") for p in pulls.decode_entries(entries))
            if loaded or time.monotonic() >= self._next_check:
                self.check()

    def announce(self, version: int) -> None:
        """Open the gate for ``version`` at once; it is complete when every live worker runs it."""
        s = self.s
        s.version = version
        self.announced[version] = time.monotonic()
        s.set_gate(version, complete=False)
        s.log.info("version announced; workers pull it", version=version)
        self.check()

    def check(self) -> None:
        s = self.s
        self._next_check = time.monotonic() + CHECK_S
        # a Redis restart lost the gate's update
        if gate.opened_version(s.client, s.keys) != s.version:
            s.log.warning("staleness gate behind the announced version; set again", version=s.version)
            s.set_gate(s.version, complete=False)
        done = gate.complete_version(s.client, s.keys)
        if done is not None and done >= s.version:
            return
        live = s.live_workers()
        behind = sorted(w for w, info in live.items() if int(info.get("version", -1)) < s.version)
        if behind:
            return
        gate.mark_complete(s.client, s.keys, s.version)
        since = self.announced.pop(s.version, None)
        self.announced = {v: t for v, t in self.announced.items() if v > s.version}
        # the version this syncer found at start: no announcement of its own to time
        if since is None:
            return
        record = {
            "version": s.version,
            "sync": f"v{s.version}-pull",
            "workers": len(live),
            "missing": [],
            "refused": {},
            "sync_mode": "pull",
            "total_s": time.monotonic() - since,
            "paused_s": 0.0,
            "waves": 0,
        }
        metrics.record(s.client, s.keys, "sync", record)
        s.log.info("every live worker runs the version; gate complete", version=s.version, workers=len(live))

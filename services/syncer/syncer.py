"""The syncer: moves each published version to the rollout workers and holds
the staleness gate.

For every new version event: have every live rollout worker fetch the version's
file (a download into its own folder when it cannot read the trainer's, else a
sha256 check; either way while it goes on generating) and wait until each holds
a verified copy (up to ``fetch_timeout``), then pause them, wait for each ack
(a worker whose heartbeat lapses, or that stays silent past ``sync_timeout``, is
logged and not waited on), tell them to load their copy, wait, open the gate for
it, resume them, wait. So the pause is never lengthened by a download. Each
phase's duration goes to the metrics stream (``paused_s``: pause + load +
resume, what generation lost). Only generation pauses: rq tool jobs keep running
in their own processes.

The gate is a hash ``gate`` {version, limit}: how many prompt groups may have
started in total under the current version (AReaL's admission control,
``shared.protocol.staleness.group_capacity``); rollout workers reserve starts against it.
"""

from __future__ import annotations

import time
import uuid

import redis

from shared.protocol import control, gate, metrics, versions
from shared.runtime import heartbeat
from shared.runtime.config import Config
from shared.runtime.faults import crash_point
from shared.protocol.keys import Keys
from shared.protocol.staleness import group_capacity




def groups_per_version(cfg: Config) -> int:
    return cfg.batch_groups * cfg.steps_per_version


class Syncer:
    # the phases of a sync, in order; bench/fetch_pause.py drops "fetch" to measure a download inside the pause
    phases = ("fetch", "pause", "load", "resume")

    def __init__(self, cfg: Config, client: redis.Redis, log, heartbeat=lambda: None):
        self.cfg, self.client, self.log = cfg, client, log
        self.heartbeat = heartbeat  # refreshes this process's alive key; called often, also while waiting
        self._next_beat = 0.0
        self.keys = Keys(cfg.run)
        self.version = 0
        self.cursor = "0-0"
        self._next_stuck_check, self._stuck = 0.0, set()  # workers seen paused between syncs

    def live_workers(self) -> dict[str, dict]:
        # the rollout registry (no SCAN of the keyspace, which holds one stream per episode)
        return heartbeat.alive_of(self.client, self.keys, "rollout")

    def set_gate(self, version: int) -> None:
        limit = group_capacity(version, self.cfg.max_staleness, groups_per_version(self.cfg), started_groups=0)
        gate.open(self.client, self.keys, version, limit, self.cfg.max_staleness)

    def start(self) -> None:
        last = versions.latest(self.client, self.keys)
        if last:
            self.cursor, self.version = last.entry_id, last.version
            # restarted mid-sync (workers left paused, or not at the newest version), or workers missed a round
            behind = [w for w, info in self.live_workers().items()
                      if int(info.get("version", -1)) < self.version or info.get("paused") == "1"]
            if behind:
                self.sync(last.version, last.path, last.sha256, last.url)
        self.set_gate(self.version)

    def run(self, should_stop=lambda: False) -> None:
        self.start()
        self.log.info("ready", version=self.version)
        while not should_stop():
            self._beat()
            entries = versions.read_after(self.client, self.keys, self.cursor, block_ms=200)
            if not entries:
                self._resume_if_stuck()
                continue
            self.cursor = entries[-1].entry_id
            newest = entries[-1]  # only the newest matters
            if newest.version > self.version:
                self.sync(newest.version, newest.path, newest.sha256, newest.url)

    def _resume_if_stuck(self) -> None:
        """Between syncs no worker should be paused. One that is, seen twice 2 s apart, lost a command of a
        sync (a Redis restart that lost its last second): it gets the newest version's sync again. The gate
        lost with such a restart is set again too."""
        now = time.monotonic()
        if now < self._next_stuck_check:
            return
        self._next_stuck_check = now + 2.0
        gate_version = gate.opened_version(self.client, self.keys)
        if gate_version != self.version:  # a Redis restart lost the gate's update
            self.log.warning("staleness gate behind the synced version; set again", gate=gate_version,
                             version=self.version)
            self.set_gate(self.version)
        stuck = {w for w, info in self.live_workers().items() if info.get("paused") == "1"}
        latest = versions.latest(self.client, self.keys)
        if stuck & self._stuck and latest:
            self.log.warning("workers paused with no sync under way; syncing again", workers=sorted(stuck))
            self.sync(latest.version, latest.path, latest.sha256, latest.url)
            stuck = set()
        self._stuck = stuck

    def sync(self, version: int, path: str, sha256: str, url: str = "") -> dict:
        sync_id = f"v{version}-{uuid.uuid4().hex[:6]}"
        log = self.log.bind(version=version, sync=sync_id)
        workers = set(self.live_workers())
        durations, missing, refused, why = {}, set(), {}, {}
        t_start = time.monotonic()
        for cmd in self.phases:
            if cmd == "resume":  # open the gate first: the resume wakes the workers, who then claim at once
                self.set_gate(version)
            t0 = time.monotonic()
            cursor = control.last_id(self.client, self.keys)
            weights = cmd in control.WITH_WEIGHTS
            control.send_command(self.client, self.keys, control.Command(
                cmd, sync_id, version, path if weights else "", sha256 if weights else "", url=url if weights else ""))
            crash_point("syncer", cmd)  # tests only (shared/runtime/faults.py)
            timeout = self.cfg.fetch_timeout if cmd == "fetch" else self.cfg.sync_timeout
            acked, failed, silent, dead = self._wait_acks(sync_id, cmd, workers - missing, cursor, timeout)
            durations[f"{cmd}_s"] = time.monotonic() - t0
            for worker, error in failed.items():
                log.error("worker refused the version; it keeps its old weights", worker=worker, error=error)
            refused.update({f"{worker}": f"{cmd}: {error}" for worker, error in failed.items()})
            if dead:
                log.warning("workers died (heartbeat lapsed) before acknowledging; going on without them", cmd=cmd,
                            workers=sorted(dead))
            limit = "fetch_timeout" if cmd == "fetch" else "sync_timeout"
            if silent:
                log.warning(f"workers did not acknowledge within {limit}={timeout:g}s; going on without them", cmd=cmd,
                            workers=sorted(silent))
            why.update({w: f"{cmd}: heartbeat lapsed" for w in dead})
            why.update({w: f"{cmd}: silent past {limit}" for w in silent})
            missing |= silent | dead
        self.version = version
        paused_s = sum(durations.get(f"{c}_s", 0.0) for c in ("pause", "load", "resume"))
        record = {"version": version, "sync": sync_id, "workers": len(workers), "missing": sorted(missing),
                  "missing_why": why, "refused": refused, "total_s": time.monotonic() - t_start,
                  "paused_s": paused_s, **durations}
        metrics.record(self.client, self.keys, "sync", record)
        log.info("synced", workers=len(workers), missing=len(missing), refused=len(refused),
                 **{k: round(v, 4) for k, v in durations.items()})
        return record

    def _wait_acks(self, sync_id: str, cmd: str, workers: set[str], cursor: str, timeout: float):
        """Acks from ``workers`` for (sync, cmd); a worker that dies or stays
        silent past ``timeout`` is returned in ``dead`` or ``silent``."""
        acked: set[str] = set()
        failed: dict[str, str] = {}
        dead: set[str] = set()
        deadline = time.monotonic() + timeout
        next_alive_check = 0.0
        while workers - acked:
            for cursor, entry in control.read_after(self.client, self.keys, cursor, count=1000, block_ms=250):
                if isinstance(entry, dict):  # an ack (a duplicate only re-adds the same worker)
                    a = control.decode_ack(entry)
                    if a.sync == sync_id and a.cmd == cmd:
                        acked.add(a.worker)
                        if not a.ok:
                            failed[a.worker] = a.error
            now = time.monotonic()
            self._beat()
            if now > deadline:
                break
            if now > next_alive_check:  # a dead worker's heartbeat key lapses: stop waiting for it
                next_alive_check = now + 0.25
                waiting = sorted(workers - acked)  # EXISTS per awaited worker, not a SCAN of the keyspace
                pipe = self.client.pipeline(transaction=False)
                for w in waiting:
                    pipe.exists(self.keys.alive("rollout", w))
                dead |= {w for w, alive in zip(waiting, pipe.execute()) if not alive}
                workers -= dead
        return acked, failed, workers - acked, dead

    def _beat(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + 1.0
            self.heartbeat()

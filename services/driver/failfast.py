"""Fail fast: an agent run that cannot train says so, instead of failing episodes at full speed until max_minutes.

The driver reads the ``agent`` metrics records (one per ended episode, services/gateway/runner.py) written since it
started. When the first ``fail_fast_groups`` groups have ended and every one of their episodes failed with the same
error (the episode's own id taken out), while no version has been published, the run stops: the driver prints that
error in one line and exits ``CANNOT_TRAIN`` (`streamrl keep` does not start it again; `streamrl run` exits 1). One
finished episode, another error, or a published version first, and it never fires for this driver. The run is not
ended: started again with the agent fixed, it continues.
"""

from __future__ import annotations

from shared.protocol.keys import Keys
from shared.protocol.streams import metrics

# the driver's exit code when the run cannot train (sysexits EX_CONFIG): starting it again would fail the same way
CANNOT_TRAIN = 78


class FailFast:
    def __init__(self, client, keys: Keys, groups: int, group_size: int):
        self.client, self.keys, self.groups, self.group_size = client, keys, groups, max(1, group_size)
        # off: disabled, or something already went right (or differently) in this driver's time
        self.off = groups <= 0
        last = client.xrevrange(keys.metrics, count=1)
        # only episodes that end from now on: a continued run's old failures are not this agent's
        self.since = f"({last[0][0].decode()}" if last else "-"
        self.reason: str | None = None
        # group -> its episodes seen ended
        self.ended: dict[str, set[str]] = {}

    def poll(self, version: int) -> str | None:
        """The one line to stop the run with, or None to go on."""
        if self.off:
            return None
        if version > 0:
            self.off = True
            return None
        records = metrics.read(self.client, self.keys, "agent", since_id=self.since, count=1000)
        if records:
            self.since = f"({records[-1][0]}"
        for _, r in records:
            if not self.observe(r):
                self.off = True
                return None
        done = sum(len(eps) >= self.group_size for eps in self.ended.values())
        if done < self.groups:
            return None
        # said once
        self.off = True
        why = " ".join((self.reason or "").split())[:300]
        return (
            f"driver: the first {done} groups' episodes all failed and nothing trained; stopping the run: {why} "
            f"(fail_fast_groups = 0 turns this check off)"
        )

    def observe(self, record: dict) -> bool:
        """Take one ended episode; False when it says the run can train (or fails for more than one reason)."""
        error = record.get("error")
        if record.get("status") != "failed" or not error or (self.reason is not None and error != self.reason):
            return False
        self.reason = error
        self.ended.setdefault(record.get("group", ""), set()).add(record.get("episode", ""))
        return True

"""`python -m tests.support.fault_worker`: exactly `python -m services.rollout`, plus a fault probe.

On SIGUSR1 the worker, at the next tick boundary where some episode holds
generated tokens not yet flushed (or after 10 s), writes its final counters
(a ``rollout`` metrics record with ``final: true``, what a warm shutdown
writes) and a ``fault_probe`` record (episodes in flight, tokens generated
but not yet flushed to their streams, once the step writer's batch in flight
has landed), then stops itself with SIGSTOP. The
fault suite then sends SIGKILL: the process dies with exactly that state, so
the tokens a kill -9 loses are known and `streamrl check` can compare them
with the tokens generated again.
"""

from __future__ import annotations

import os
import signal
import time

from services.rollout import __main__ as rollout_main
from services.rollout.worker import RolloutWorker
from shared.protocol.streams import metrics

_run = RolloutWorker.run


def _run_with_probe(self: RolloutWorker, should_stop=lambda: False) -> None:
    asked = {"probe": False}
    signal.signal(signal.SIGUSR1, lambda *_: asked.update(probe=True))

    def probed() -> bool:
        if asked["probe"]:
            asked.setdefault("since", time.monotonic())
            # the step's batch in flight lands first: the kill comes after it
            self.episodes.writes.settle()
            # live episodes: logs open
            unflushed = {eid: self.events.pending_tokens(eid) for eid in self.live}
            if not sum(unflushed.values()) and time.monotonic() - asked["since"] < 10:
                # wait (up to 10 s) for a tick with tokens generated but not yet flushed
                return should_stop()
            self.report(final=True)
            metrics.record(
                self.client,
                self.keys,
                "fault_probe",
                {
                    "worker": self.worker_id,
                    "time": time.time(),
                    "in_flight": len(self.live),
                    "unflushed_tokens": sum(unflushed.values()),
                    "unflushed": unflushed,
                    "tokens": self.stats["tokens"],
                    "flush_tokens": self.cfg.flush_tokens,
                },
            )
            # the kill -9 arrives while stopped here
            os.kill(os.getpid(), signal.SIGSTOP)
        return should_stop()

    return _run(self, should_stop=probed)


RolloutWorker.run = _run_with_probe

if __name__ == "__main__":
    rollout_main.main()

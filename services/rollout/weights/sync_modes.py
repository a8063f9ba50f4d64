"""How a rollout worker takes new versions: one of four ways, chosen once at start (``choose``), so the worker's tick
reads the same in every mode. Each way answers the same questions at the same points of the tick:

    start()            once, before the worker catches up to the newest version
    wake_streams()     streams that wake an idle worker for it; saw(name, entries): their entries
    next_due()         a timer of its own (None: none)
    before_claims()    every tick, before claiming (not paused)
    may_claim()        may the worker claim new groups under the version it runs?
    between_steps()    every tick, after claiming (not paused): a cheap point to load
    relay_wait_s       how long this worker's relay waits for a copy it is still fetching

The ways (config ``mode`` and ``sync_mode``):
- ``Commanded`` (sync_mode global): the syncer's commands on the control stream (fetch, pause, load, resume) bring
  every version; nothing to do between them.
- ``Rolling`` (sync_mode rolling): the same commands, one wave at a time; a worker left out of a sync (silent,
  refused) catches up before it claims anything newer work (``may_claim``).
- ``Pulling`` (sync_mode pull): no command; the worker downloads announced versions and loads them itself
  (``puller.py``).
- ``Lockstep`` (mode sync, the synchronous baseline): commanded, and a worker that missed a sync catches up to the
  gate's version before it claims.

What a way may use of the worker it serves is typed: ``SyncHost`` below, and nothing else of the worker.
"""

from __future__ import annotations

from typing import Protocol

import redis

from services.rollout.engine import EngineError
from services.rollout.weights.local import LocalWeights
from services.rollout.weights.puller import Puller
from shared.protocol import gate
from shared.protocol.keys import Keys
from shared.protocol.streams.versions import Version
from shared.runtime.config.keys import Config


class HostEngine(Protocol):
    # the policy version the engine runs
    version: int


class HostClaims(Protocol):
    # whether the staleness gate refused this worker's last claim
    gated: bool

    def slots_used(self) -> float: ...


class SyncHost(Protocol):
    """What a sync mode needs from the rollout worker it serves."""

    client: redis.Redis
    keys: Keys
    cfg: Config
    log: object
    worker_id: str
    engine: HostEngine
    claims: HostClaims
    weights: LocalWeights

    def catch_up(self) -> None:
        """Load the newest published version."""

    def load_pulled(self, v: Version) -> None:
        """Pause, load a pulled version, resume, beat."""


class Commanded:
    """sync_mode global: the syncer's commands bring every version."""

    # the syncer orders fetches level by level: a relay never waits for its own copy
    relay_wait_s = 0.0

    def __init__(self, host: SyncHost):
        self.host = host
        self.stats: dict = {}

    def start(self) -> None:
        pass

    def wake_streams(self) -> dict:
        return {}

    def saw(self, name: str, entries) -> bool:
        return False

    def next_due(self) -> float | None:
        return None

    def before_claims(self) -> None:
        pass

    def may_claim(self) -> bool:
        return True

    def between_steps(self) -> None:
        pass


class Lockstep(Commanded):
    """mode sync: a gate opened for a newer version than this worker's means it missed a sync; it catches up first."""

    def before_claims(self) -> None:
        gate_version, _ = gate.peek(self.host.client, self.host.keys)
        if gate_version is not None and gate_version > self.host.engine.version:
            self.host.catch_up()


class Rolling(Commanded):
    """sync_mode rolling: the syncer marks the gate complete for v once every worker that took part in the sync runs
    v; a worker left out of it (silent, refused) loads the newest version first, and claims nothing while that fails
    (once per version, logged). A worker behind only while a rolling sync is under way claims under its own
    version's limit (the gate's rule), and waits for its wave."""

    def __init__(self, host: SyncHost):
        super().__init__(host)
        # the gate version a catch-up load failed for
        self._failed_for: int | None = None

    def may_claim(self) -> bool:
        host = self.host
        complete = gate.complete_version(host.client, host.keys)
        if complete is None or complete <= host.engine.version:
            return True
        if self._failed_for != complete:
            try:
                host.catch_up()
            except (OSError, EngineError, ValueError) as exc:
                self._failed_for = complete
                host.log.error(
                    "behind the staleness gate and the newest version does not load; claiming nothing "
                    "until the next version",
                    gate=complete,
                    version=host.engine.version,
                    error=str(exc),
                )
        return complete <= host.engine.version


class Pulling(Commanded):
    """sync_mode pull: announced versions are downloaded while generating and loaded between engine steps, under the
    load lease (``puller.py``)."""

    def __init__(self, host: SyncHost):
        super().__init__(host)
        self.puller = Puller(host.cfg, host.client, host.keys, host.worker_id, host.weights, host.log)
        self.stats = self.puller.stats
        self.relay_wait_s = self.puller.relay_wait_s()

    def start(self) -> None:
        self.puller.start()

    def wake_streams(self) -> dict:
        return self.puller.wake_streams()

    def saw(self, name: str, entries) -> bool:
        return self.puller.saw(name, entries, self.host.engine.version)

    def next_due(self) -> float | None:
        return self.puller.next_due()

    def may_claim(self) -> bool:
        # the gate complete for a newer version than this worker's: it was counted out (load_policy: behind)
        self.puller.complete(gate.complete_version(self.host.client, self.host.keys), self.host.engine.version)
        return True

    def between_steps(self) -> None:
        host = self.host
        host_claims = host.claims
        self.puller.tick(host.engine.version, host_claims.slots_used(), host_claims.gated, host.load_pulled)


def choose(cfg: Config, host: SyncHost) -> Commanded:
    """The way this worker takes new versions, from its config (validated: ``shared/runtime/config/checks.py``)."""
    if cfg.mode == "sync":
        return Lockstep(host)
    return {"global": Commanded, "rolling": Rolling, "pull": Pulling}[cfg.sync_mode](host)

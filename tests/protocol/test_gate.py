"""The staleness gate (shared/protocol/gate.py) from each of its callers, and a stateful model of a run.

Callers: the syncer opens it after each sync; a rollout worker reserves slots before claiming groups and
refunds what it did not use (fewer groups waiting, a dead-lettered entry); the trainer refunds the slot of a
group it will never train, once per group. The state machine drives two workers and a trainer that consumes
in FINISH order over the pure rule (shared/protocol/staleness.py) and the real gate on the test server.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from services.syncer.syncer import Syncer
from services.trainer.trainer import Trainer
from shared.protocol import gate
from shared.protocol.keys import Keys
from shared.protocol.staleness import group_capacity
from shared.protocol.streams import dead_letters, prompts
from shared.protocol.streams.prompts import PromptGroup
from shared.runtime import logs
from shared.runtime.config.keys import Config
from tests.support.rollout_harness import make_worker, samples, tick_until
from tests.trainer.test_trainer import _cfg, _write_group


def test_syncer_opens_the_gate_at_the_synced_version_with_the_rule_s_limit(client, keys):
    cfg = Config(run=keys.run, batch_groups=3, steps_per_version=2, max_staleness=1)
    Syncer(cfg, client, logs.get("syncer-test")).set_gate(4)
    assert gate.peek(client, keys) == (4, group_capacity(4, 1, 6, 0)) == (4, (1 + 4 + 1) * 6)
    assert gate.opened_version(client, keys) == 4 and gate.started(client, keys) == 0


def test_reserve_grants_up_to_the_limit_and_reports_no_gate(client, keys):
    g = gate.Gate(client, keys, sync_mode=False)
    # no gate yet, async: everything may start
    assert g.reserve(5) == gate.Grant(5, False, None)
    # sync: nothing
    assert gate.Gate(client, keys, sync_mode=True).reserve(5) == gate.Grant(0, False, None)
    gate.open(client, keys, 2, 4, 1)
    assert g.reserve(3) == gate.Grant(3, True, 2) and g.reserve(3) == gate.Grant(1, True, 2)
    assert g.reserve(1).granted == 0 and gate.started(client, keys) == 4
    g.refund(2)
    assert gate.started(client, keys) == 2


def test_a_call_s_own_token_lives_as_long_as_a_retry_and_a_named_one_as_long_as_a_restart(client, keys):
    """A per-call token guards only a retry within ``redis_wait``: its marker expires with the retry markers (issue
    33: 600 s of them piled up, one per reservation); a group's token guards a restart and keeps REQUEST_TTL_S."""
    from shared.protocol.streams import once

    gate.open(client, keys, 1, 100, 1)
    g = gate.Gate(client, keys, sync_mode=False)
    g.reserve(2)
    g.refund(1)
    g.reserve(1, token="group:g7")
    gate.refund_group(client, keys, "g7")
    ttls = {
        k.decode().removeprefix(keys.gate_request("")): client.ttl(k)
        for k in client.scan_iter(match=keys.gate_request("*"))
    }
    named = {k: t for k, t in ttls.items() if "group:" in k}
    own = {k: t for k, t in ttls.items() if "group:" not in k}
    assert len(own) == 2 and all(0 < t <= once.RETRY_MARKER_TTL_S for t in own.values()), ttls
    assert len(named) == 2 and all(once.RETRY_MARKER_TTL_S < t <= gate.REQUEST_TTL_S for t in named.values()), ttls


def test_a_worker_behind_the_gate_reserves_under_its_own_version_s_limit(client, keys):
    """A rolling sync opens the gate for version 3 after its first wave; a worker still on version 1 may start
    groups only up to version 1's limit, (η + 1 + 1)·B, so the start-rank bound holds for the version that
    generates the group. No version (the driver of an agent run) means the gate's own limit."""
    per_version, eta = 4, 1
    gate.open(client, keys, 3, group_capacity(3, eta, per_version, 0), eta, per_version, complete=False)
    g = gate.Gate(client, keys, sync_mode=False)
    assert gate.complete_version(client, keys) is None
    assert g.reserve(100, version=1).granted == (eta + 1 + 1) * per_version == 12
    # version 1's limit is spent
    assert g.reserve(100, version=1).granted == 0
    # version 2's limit: 16
    assert g.reserve(5, version=2).granted == 4
    assert g.reserve(100, version=3).granted == (eta + 3 + 1) * per_version - 16 == 4
    assert g.reserve(1).granted == 0 and gate.started(client, keys) == 20
    gate.mark_complete(client, keys, 3)
    assert gate.complete_version(client, keys) == 3 and gate.opened_version(client, keys) == 3


def test_worker_refunds_slots_it_did_not_use_and_a_dead_lettered_entry(client, keys, tiny_model_dir):
    cfg = Config(run=keys.run, model_dir=tiny_model_dir, max_tokens=4, tools="", max_groups_in_flight=4)
    gate.open(client, keys, 0, 3, 0)
    # dead-lettered: no group starts
    client.xadd(keys.prompts, {"group_id": "bad", "n": "two", "data": b"\x80"})
    prompts.enqueue(client, keys, [PromptGroup("good", 1, prompt="1+1=")])
    worker = make_worker(cfg, client)
    tick_until(worker, lambda: len(samples(client, keys)) == 1)
    assert len(dead_letters.read_all(client, keys)) == 1
    # reserved 3 (the limit), read 2 entries (1 refunded), one of them dead-lettered (1 refunded)
    assert gate.started(client, keys) == 1


def test_trainer_refunds_a_group_it_never_trains_once_across_a_restart(client, keys, tiny_model_dir, tmp_path):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=1, max_staleness=1, filter_constant_groups=True)
    gate.open(client, keys, 3, 8, 1)
    # "old" and "fresh" started
    client.set(keys.gate_started, 2)
    # constant rewards: filtered, never trained
    _write_group(client, keys, "old", version=1, rewards=[1.0, 1.0])
    _write_group(client, keys, "fresh", version=2)
    # the second trainer is a restart before the commit: it judges "old" again
    for _ in range(2):
        trainer = Trainer(cfg, client, logs.get("trainer-test"))
        trainer.version = 3
        trainer.restore()
        trainer.version = 3
        assert [g for _, g, _ in trainer.collect(lambda: False)] == ["fresh"]
        # old's slot back, once
        assert gate.started(client, keys) == 1


# groups the trainer consumes per version, max staleness
B, ETA = 2, 1


class GateRun(RuleBasedStateMachine):
    """Two workers reserve/claim/refund, groups finish in any order, the trainer consumes in finish order.

    What the gate promises (asserted below): net of refunds, at most (η + v + 1)·B groups are ever started
    while the gate is at version v, hence at most (η + 1)·B are in flight (started, neither trained nor
    dropped). What it does NOT promise when groups finish out of order: that a group is trained within η
    versions of its start (a slow group can be overtaken by ever newer ones). The model's trainer drops such a
    group and refunds its slot (the real one trains it with importance weights instead, refunding only groups
    it never trains): either way slots are given back once.
    """

    def __init__(self, client):
        super().__init__()
        self.client, self.keys = client, Keys(f"gate-sm-{id(self)}")
        client.delete(self.keys.gate, self.keys.gate_started)
        self.gates = [gate.Gate(client, self.keys, sync_mode=False) for _ in range(2)]
        self.version, self.next_id = 0, 0
        # (group id, version it started under)
        self.running: list[tuple[str, int]] = []
        # in finish order
        self.finished: list[tuple[str, int]] = []
        self.started_net = self.trained = self.dropped = 0
        self.trained_staleness: list[int] = []
        self._open()

    def _open(self):
        gate.open(self.client, self.keys, self.version, group_capacity(self.version, ETA, B, 0), ETA)

    @rule(worker=st.integers(0, 1), want=st.integers(1, 4), use=st.integers(0, 4), bad=st.integers(0, 1))
    def claim(self, worker, want, use, bad):
        grant = self.gates[worker].reserve(want)
        assert grant.gated and grant.version == self.version
        read = min(use, grant.granted)
        # fewer groups waiting than reserved
        self.gates[worker].refund(grant.granted - read)
        bad = min(bad, read)
        for _ in range(bad):
            # a dead-lettered entry starts no group
            self.gates[worker].refund()
        for _ in range(read - bad):
            self.running.append((f"g{self.next_id}", grant.version))
            self.next_id += 1
        self.started_net += read - bad

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 10_000))
    def finish(self, pick):
        self.finished.append(self.running.pop(pick % len(self.running)))

    @precondition(lambda self: self.finished)
    @rule()
    def train_next(self):
        # finish order
        group_id, started_at = self.finished.pop(0)
        staleness = self.version - started_at
        if staleness > ETA:
            assert gate.refund_group(self.client, self.keys, group_id)
            # judged again after a restart
            assert not gate.refund_group(self.client, self.keys, group_id)
            self.started_net -= 1
            self.dropped += 1
            return
        self.trained_staleness.append(staleness)
        self.trained += 1
        # a new version; the syncer opens the gate for it
        if self.trained % B == 0:
            self.version += 1
            self._open()

    @invariant()
    def slots_match_and_stay_in_bounds(self):
        started = gate.started(self.client, self.keys)
        _, limit = gate.peek(self.client, self.keys)
        # no slot leaked, none given back twice
        assert started == self.started_net
        assert 0 <= started <= limit == (ETA + self.version + 1) * B
        # in flight
        assert started - self.trained <= (ETA + 1) * B

    @invariant()
    def nothing_trained_past_the_bound(self):
        assert all(0 <= s <= ETA for s in self.trained_staleness)


@pytest.mark.timeout(600)
def test_gate_slots_never_leak_and_trained_staleness_stays_bounded_in_finish_order(client):
    run_state_machine_as_test(
        lambda: GateRun(client),
        settings=settings(
            max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )

"""Reading ahead (services/trainer/read_ahead.py): the next entries and their groups' streams are read and folded on a
thread while the trainer trains. What must hold: the folds are the streams' own, at most ``depth`` entries wait
unread by the trainer, and an entry read ahead but never trained is trained once, by the next trainer."""

from __future__ import annotations

import time

from services.trainer.read_ahead import ReadAhead
from services.trainer.trainer import Trainer
from shared.protocol.archive.ledger import read_ledger
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from shared.protocol.keys import TRAINER_GROUP
from shared.protocol.streams import codec
from shared.runtime import logs
from tests.support.procs import wait_until
from tests.trainer.test_trainer import _cfg, _write_group


def _pending(client, keys) -> int:
    return client.xpending(keys.samples, TRAINER_GROUP)["pending"]


def test_entries_read_ahead_come_folded_and_no_more_than_depth_wait(client, keys):
    for i in range(7):
        _write_group(client, keys, f"g{i}", n=2)
    client.xadd(keys.samples, {"group_id": "bad"})
    codec.ensure_group(client, keys.samples, TRAINER_GROUP)
    ahead = ReadAhead(client, keys, "trainer", known=lambda g: g == "g1", depth=3)
    ahead.start()
    try:
        wait_until(lambda: _pending(client, keys) == 3, "three entries read ahead", 10)
        # the thread waits for room: nothing more is read while nobody takes
        time.sleep(0.6)
        assert _pending(client, keys) == 3
        taken = []
        deadline = time.monotonic() + 10
        while len(taken) < 8 and time.monotonic() < deadline:
            taken += ahead.take(timeout=1.0)
    finally:
        ahead.close()
    assert [t.sample.group_id if t.sample else None for t in taken] == [f"g{i}" for i in range(7)] + [None]
    log = EpisodeLog(client, keys, "reader")
    for item in taken[:7]:
        if item.sample.group_id == "g1":
            # known to the trainer: its streams were not read
            assert item.folds is None
            continue
        assert [ep.events for ep in item.folds] == [fold(log.read(e)).events for e in item.sample.episodes]
    # the bad entry comes with why it did not decode, for the trainer to dead-letter
    assert taken[7].error is not None and "episodes" in str(taken[7].error)


def test_entries_read_ahead_but_not_trained_are_trained_once_by_the_next_trainer(
    client, keys, tiny_model_dir, tmp_path
):
    cfg = _cfg(keys, tiny_model_dir, tmp_path, batch_groups=1)
    groups = [f"r{i}" for i in range(4)]
    for g in groups:
        _write_group(client, keys, g)
    first = Trainer(cfg, client, logs.get("trainer-test"))
    # stops after one version: the thread has read the other groups ahead by then
    first.run(should_stop=lambda: first.version >= 1 and _pending(client, keys) == 3)
    assert first.intake.ahead is not None
    assert _pending(client, keys) == 3
    second = Trainer(cfg, client, logs.get("trainer-test"))
    second.run(should_stop=lambda: second.version >= 4)
    trained = [g for line in read_ledger(cfg.run_path / "trainer") for g in line["groups"]]
    assert sorted(trained) == groups
    assert _pending(client, keys) == 0

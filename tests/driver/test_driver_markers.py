"""The driver's enqueue markers go once its counter is past their groups: a restarted driver starts
from the counter and never builds those group ids again; one that died before the counter moved still finds the
markers and enqueues nothing twice."""

from __future__ import annotations

import json

from services.driver.driver import Driver
from shared.protocol.streams import prompts
from shared.protocol.streams.prompts import decode_group
from shared.runtime.config.keys import Config


def _cfg(keys, redis_url, tmp_path) -> Config:
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(50)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return Config(
        run=keys.run,
        redis_url=redis_url,
        run_dir=str(tmp_path / "runs"),
        dataset=str(tmp_path / "rows.jsonl"),
        val_every=0,
        group_size=2,
        seed=1,
    )


def _group_ids(client, keys) -> list[str]:
    return [decode_group(e, f).group_id for e, f in client.xrange(keys.prompts)]


def test_markers_go_with_the_counter_and_a_restarted_driver_enqueues_nothing_twice(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path)
    Driver(cfg).top_up(depth=4)
    # the counter (4) says they are enqueued
    assert list(client.scan_iter(match=keys.enqueued("*"))) == []
    assert int(client.get(keys.driver_enqueued)) == 4
    # restarted: starts at the counter
    Driver(cfg).top_up(depth=8)
    ids = _group_ids(client, keys)
    assert len(ids) == len(set(ids)) == 8 and ids[:4] == [prompts.group_id(0, p) for p in range(4)]
    assert list(client.scan_iter(match=keys.enqueued("*"))) == []


def test_a_driver_that_died_before_its_counter_moved_finds_the_markers(client, keys, redis_url, tmp_path):
    cfg = _cfg(keys, redis_url, tmp_path)
    dying = Driver(cfg)
    # killed between the enqueue and the counter's write
    dying.count_enqueued = lambda group_ids: None
    dying.top_up(depth=3)
    assert len(list(client.scan_iter(match=keys.enqueued("*")))) == 3 and client.get(keys.driver_enqueued) is None
    restarted = Driver(cfg)
    # enqueues the same three group ids again: their markers refuse them
    restarted.top_up(depth=6)
    assert _group_ids(client, keys) == [prompts.group_id(0, p) for p in range(3)]
    # and the counter now covers them
    assert list(client.scan_iter(match=keys.enqueued("*"))) == []
    restarted.top_up(depth=9)
    ids = _group_ids(client, keys)
    assert len(ids) == len(set(ids)) == 9

"""Writes retried after a lost reply or a cut pipeline happen once; a server really gone is said in one line."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest
import redis

from shared.protocol.streams import control, dead_letters, prompts, versions
from shared.protocol.streams.prompts import PromptGroup
from shared.runtime.connection import connect
from tests.support.fault_proxy import FaultProxy


@pytest.fixture
def proxy(redis_url):
    u = urlparse(redis_url)
    p = FaultProxy(u.hostname, u.port, seed=1).start()
    yield p
    p.stop()


def _arm(proxy, **faults):
    """The next command's reply (or pipeline) meets exactly one fault."""
    proxy.drop_reply, proxy.cut_request = faults.get("drop_reply", 0.0), faults.get("cut_request", 0.0)
    proxy.max_faults = sum(proxy.faults.values()) + 1
    proxy.skip = faults.get("skip", 0)


def test_a_dropped_reply_repeats_a_plain_command_but_not_an_idempotent_write(proxy, keys):
    c = connect(proxy.url, retry_for=10)
    # the connection is open (its handshake is not the command a fault meets)
    c.ping()
    _arm(proxy, drop_reply=1.0)
    # not idempotent: the proxy works when this ran twice
    c.incr(keys.driver_enqueued)
    assert int(c.get(keys.driver_enqueued)) == 2 and proxy.faults["reply_dropped"] == 1
    # the script is loaded
    prompts.enqueue(c, keys, [PromptGroup(prompts.group_id(0, 0), 2, prompt="x")])
    # SCRIPT EXISTS (a pipeline with a script checks it first), then the write
    _arm(proxy, drop_reply=1.0, skip=1)
    # the retry
    assert prompts.enqueue(c, keys, [PromptGroup(prompts.group_id(0, 1), 2, prompt="x")]) == [None]
    _arm(proxy, drop_reply=1.0)
    versions.publish(c, keys, versions.Version(1, "/w/1", "a", 1))
    _arm(proxy, drop_reply=1.0)
    assert control.send_command(c, keys, control.Command("pause", "v1-x")) is None
    _arm(proxy, drop_reply=1.0)
    assert not dead_letters.send(c, keys, keys.prompts, "1-0", "bad", "w")
    assert proxy.faults["reply_dropped"] == 5
    assert (c.xlen(keys.prompts), c.xlen(keys.versions), c.xlen(keys.control), c.xlen(keys.dead_letters)) == (
        2,
        1,
        1,
        1,
    )


def test_a_pipeline_cut_midway_and_retried_enqueues_each_group_once(proxy, keys):
    c = connect(proxy.url, retry_for=10)
    groups = [PromptGroup(prompts.group_id(0, i), 2, prompt="x") for i in range(20)]
    # the connection is open and the script loaded: the pipeline below is one write
    prompts.enqueue(c, keys, groups[:1])
    # only a pipeline (several commands in one write) is cut
    _arm(proxy, cut_request=1.0)
    prompts.enqueue(c, keys, groups)
    assert proxy.faults["request_cut"] == 1
    ids = [g.group_id for g in prompts_in(c, keys)]
    assert sorted(ids) == sorted(g.group_id for g in groups)


def prompts_in(c, keys):
    return [prompts.decode_group(i, f) for i, f in c.xrange(keys.prompts)]


@pytest.mark.timeout(60)
def test_a_server_really_gone_is_said_in_one_error_within_redis_wait(proxy):
    c = connect(proxy.url, retry_for=1)
    proxy.down()
    # the service's excepthook makes it one line
    with pytest.raises(redis.exceptions.ConnectionError):
        c.ping()
    proxy.up()
    # back: the same client works again
    assert c.ping()

import random

import pytest

from shared.protocol.episode.events import Event
from shared.protocol.episode.log import Ended, EpisodeLog, Fenced
from shared.runtime.connection import is_cluster_client
from tests.support.helpers import started


class ManualClock:
    """Time the test advances by hand, so flush-by-age is checked exactly."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _start(log: EpisodeLog, episode_id: str = "e1") -> None:
    log.open(episode_id)
    ev = started(episode_id=episode_id)
    log.append(episode_id, "started", ev.data, 0)
    log.flush_or_raise()


def test_replay_equals_what_was_written(client, keys):
    rng = random.Random(7)
    log = EpisodeLog(client, keys, "w1", flush_tokens=16)
    _start(log)
    ids, lps, versions = [], [], []
    for step in range(300):
        version = step // 100
        chunk = [rng.randrange(50000) for _ in range(rng.randrange(1, 4))]
        chunk_lp = [-rng.random() * 5 for _ in chunk]
        log.append_tokens("e1", chunk, chunk_lp, version)
        ids += chunk
        lps += chunk_lp
        versions += [version] * len(chunk)
        log.maybe_flush()
    log.append("e1", "finished", {"reason": "length", "reward": 0.25}, 2)
    log.flush_or_raise()
    ep = log.replay("e1")
    assert ep.tokens == ids and ep.versions == versions and ep.status == "finished"
    # stored as float32
    assert ep.logprobs == pytest.approx(lps, abs=1e-6)
    # chunks coalesce: far fewer entries than appends; a version change starts a new entry
    token_events = [e for e in ep.events if e.kind == "tokens"]
    assert len(token_events) < 300 / 4
    assert {e.policy for e in token_events} == {0, 1, 2}
    assert [e.policy for e in token_events] == sorted(e.policy for e in token_events)


def test_flushes_after_n_tokens(client, keys):
    clock = ManualClock()
    log = EpisodeLog(client, keys, "w", flush_tokens=4, flush_ms=1e9, clock=clock)
    _start(log)
    for i in range(3):
        log.append_tokens("e1", [i], [0.0], 0)
        assert not log.due() and log.maybe_flush() == {}
    assert client.xlen(keys.episode("e1")) == 1
    log.append_tokens("e1", [3], [0.0], 0)
    assert log.due()
    log.maybe_flush()
    assert log.replay("e1").tokens == [0, 1, 2, 3] and log.pending_tokens("e1") == 0


def test_flushes_after_t_milliseconds(client, keys):
    clock = ManualClock()
    log = EpisodeLog(client, keys, "w", flush_tokens=1000, flush_ms=50, clock=clock)
    _start(log)
    log.append_tokens("e1", [9], [0.0], 0)
    clock.now += 0.049
    assert not log.due()
    clock.now += 0.002
    assert log.due()
    log.maybe_flush()
    assert log.replay("e1").tokens == [9]


def test_many_episodes_flush_in_one_pipeline(client, keys):
    log = EpisodeLog(client, keys, "w", flush_tokens=8)
    for e in range(20):
        _start(log, f"e{e}")
    for e in range(20):
        log.append_tokens(f"e{e}", list(range(e + 1)), [0.0] * (e + 1), 0)
    assert log.flush() == {}
    assert [log.replay(f"e{e}").tokens for e in range(20)] == [list(range(e + 1)) for e in range(20)]


def test_second_writer_is_fenced(client, keys):
    a = EpisodeLog(client, keys, "a")
    _start(a)
    b = EpisodeLog(client, keys, "b")
    # b took the episode over after replaying it
    b.open("e1", next_seq=1)
    b.append_tokens("e1", [1], [0.0], 1)
    b.flush_or_raise()
    # a wakes up and keeps writing
    a.append_tokens("e1", [2], [0.0], 0)
    errors = a.flush()
    assert isinstance(errors["e1"], Fenced)
    ep = b.replay("e1")
    assert ep.tokens == [1] and [e.worker for e in ep.events] == ["a", "b"]


def test_fenced_when_stream_has_garbage_tail(client, keys):
    log = EpisodeLog(client, keys, "w")
    _start(log)
    client.xadd(keys.episode("e1"), {"junk": "1"})
    log.append("e1", "failed", {"error": "x"}, 0)
    assert isinstance(log.flush()["e1"], Fenced)


def test_event_after_tokens_keeps_order(client, keys):
    log = EpisodeLog(client, keys, "w", flush_tokens=100)
    _start(log)
    log.append_tokens("e1", [1, 2], [0.0, 0.0], 0)
    log.append("e1", "tool_call", {"call_id": "c", "name": "calc", "args": "1"}, 0)
    log.append_tokens("e1", [3], [0.0], 0)
    log.flush_or_raise()
    ep = log.replay("e1")
    assert [e.kind for e in ep.events] == ["started", "tokens", "tool_call", "tokens"]
    assert [e.seq for e in ep.events] == [0, 1, 2, 3] and ep.pending_tool_calls


def test_event_dataclass_time_from_entry_id():
    assert Event("tokens", 0, "w", 0, {}, entry_id="1700000000123-4").time_ms == 1700000000123


def test_read_many_equals_read_of_each(client, keys):
    log = EpisodeLog(client, keys, "w1")
    for eid in ("a", "b"):
        _start(log, eid)
    log.append_tokens("b", [3, 4], [-0.1, -0.2], 0)
    log.flush_or_raise()
    assert log.read_many(["b", "missing", "a"]) == [log.read("b"), [], log.read("a")]
    assert len(log.read("b")) == 2


def test_appends_go_on_after_the_server_forgets_its_scripts(client, keys):
    """A Redis restart empties the script cache: the next flush gets NOSCRIPT, loads the script again and
    writes, with no event lost, doubled or out of order."""
    log = EpisodeLog(client, keys, "w1", flush_tokens=4)
    _start(log)
    log.append_tokens("e1", [1, 2, 3, 4], [-0.5] * 4, 0)
    log.flush_or_raise()
    client.script_flush()
    log.append_tokens("e1", [5, 6], [-0.25] * 2, 0)
    log.append("e1", "finished", {"reason": "stop", "reward": 1.0}, 0)
    assert log.flush() == {}
    ep = log.replay("e1")
    assert ep.tokens == [1, 2, 3, 4, 5, 6] and ep.status == "finished" and ep.last_seq == 3


def test_fence_refuses_a_writer_behind_and_a_writer_ahead_and_spares_the_batch_s_other_episodes(client, keys):
    """The fence is the stream's length: a writer that expects fewer entries than the stream holds (another writer
    appended) or more (the server lost the stream's tail) is refused; in the same batch the episodes whose writer
    is right are written."""
    log = EpisodeLog(client, keys, "w")
    for e in ("ok", "behind", "ahead"):
        _start(log, e)
    client.xadd(
        keys.episode("behind"),
        {
            "type": "tokens",
            "v": "2",
            "policy": "0",
            "worker": "other",
            "seq": "1",
            # another writer's entry at seq 1
            "data": b"\x80",
        },
    )
    # this writer believes 5 entries are there; the stream holds 1
    log.open("ahead", next_seq=5)
    for e in ("ok", "behind", "ahead"):
        log.append_tokens(e, [7, 8], [-0.5, -0.25], 0)
    errors = log.flush()
    assert sorted(errors) == ["ahead", "behind"] and all(isinstance(x, Fenced) for x in errors.values())
    assert "holds 2 entries" in str(errors["behind"]) and "expected seq 1" in str(errors["behind"])
    assert "holds 1 entries" in str(errors["ahead"]) and "expected seq 5" in str(errors["ahead"])
    assert client.xlen(keys.episode("behind")) == 2 and client.xlen(keys.episode("ahead")) == 1
    assert log.replay("ok").tokens == [7, 8]
    assert log.written("ok") and "behind" not in log._pending and "ahead" not in log._pending


def test_entries_keep_their_plain_header_fields(client, keys):
    """v and worker travel once per batch and the seq is counted up by the script: every entry still carries
    type, v, policy, worker, seq and the payload, readable with redis-cli."""
    log = EpisodeLog(client, keys, "w-7", flush_tokens=100)
    _start(log)
    log.append_tokens("e1", [1, 2], [0.0, 0.0], 3)
    log.append("e1", "aborted", {"reason": "pause", "num_tokens": 2}, 3)
    log.append_tokens("e1", [4], [0.0], 4)
    assert log.flush() == {}
    entries = client.xrange(keys.episode("e1"))
    headers = [{k.decode() if isinstance(k, bytes) else k: v for k, v in f.items()} for _, f in entries]
    assert [list(h) for h in headers] == [["type", "v", "policy", "worker", "seq", "data"]] * 4
    assert [(h["type"], h["v"], h["policy"], h["worker"], h["seq"]) for h in headers[1:]] == [
        (b"tokens", b"2", b"3", b"w-7", b"1"),
        (b"aborted", b"2", b"3", b"w-7", b"2"),
        (b"tokens", b"2", b"4", b"w-7", b"3"),
    ]
    assert log.entries_written == 4


def test_a_flush_of_many_episodes_is_one_script_call_on_one_server(client, keys):
    """One script call for the whole flush on one server; on a cluster (tests/protocol/test_cluster.py runs this module
    there too) one per episode, each on its stream's node."""
    cluster = is_cluster_client(client)
    nodes = {"target_nodes": client.PRIMARIES} if cluster else {}
    log = EpisodeLog(client, keys, "w", flush_tokens=100)
    for e in range(12):
        log.open(f"e{e}")
        log.append_tokens(f"e{e}", [e, e + 1], [0.0, 0.0], 0)
    client.config_resetstat(**nodes)
    assert log.flush() == {}
    stats = client.info("commandstats", **nodes)
    per_node = list(stats.values()) if cluster else [stats]
    calls = {name: sum(s.get(f"cmdstat_{name}", {}).get("calls", 0) for s in per_node) for name in ("evalsha", "xadd")}
    assert calls == {"evalsha": 12 if cluster else 1, "xadd": 12}
    assert log.entries_written == 12
    assert [client.xlen(keys.episode(f"e{e}")) for e in range(12)] == [1] * 12


def test_send_and_read_writes_starts_only_into_empty_streams_and_reads_after_them(client, keys):
    """Opening a group in one round trip: the starts are written fenced at seq 0 and the streams read after them. A
    stream that already held events keeps them (the start is refused) and its read shows what it held."""
    other = EpisodeLog(client, keys, "other")
    _start(other, "held")
    other.append_tokens("held", [4, 5], [-0.1, -0.2], 0)
    other.flush_or_raise()
    log = EpisodeLog(client, keys, "w")
    for e in ("new", "held"):
        log.open(e)
        log.append(e, "started", started(episode_id=e).data, 0)
    batch = log.take(["new", "held"])
    results, streams = log.send_and_read(batch, ["new", "held", "none"])
    errors = log.settle(batch, results)
    assert list(errors) == ["held"] and isinstance(errors["held"], Fenced)
    assert [len(s) for s in streams] == [1, 2, 0]
    assert log.replay("new").events[0].worker == "w" and log.written("new")
    assert [e.worker for e in log.replay("held").events] == ["other", "other"]
    assert log.replay("held").tokens == [4, 5] and "held" not in log._pending


def test_nothing_is_appended_after_a_terminal_event_whoever_writes_it(client, keys):
    """A writer that re-read the stream (its seq is right) is still refused once the episode ended, and so is a
    batch holding events after its own terminal one; the stream folds afterwards."""
    runner, worker = EpisodeLog(client, keys, "runner"), EpisodeLog(client, keys, "rw1")
    _start(runner)
    runner.open("e1", 1)
    runner.append("e1", "failed", {"error": "agent raised", "where": "agent"}, 0)
    runner.flush_or_raise()
    # the worker read the stream after the end: its seq is the stream's length, yet it is refused
    worker.open("e1", 2)
    worker.append("e1", "resumed", {"num_tokens": 0}, 1)
    errors = worker.flush()
    assert isinstance(errors["e1"], Ended) and "failed at seq 1" in str(errors["e1"])
    assert worker.written("e1")
    _start(worker, "e2")
    worker.open("e2", 1)
    worker.append("e2", "finished", {"reason": "stop", "reward": 1.0}, 0)
    worker.append("e2", "resumed", {"num_tokens": 0}, 0)
    with pytest.raises(Ended, match="after its finished"):
        worker.flush_or_raise()
    assert client.xlen(keys.episode("e2")) == 1
    assert runner.replay("e1").status == "failed" and client.xlen(keys.episode("e1")) == 2


def test_writers_racing_an_end_never_write_after_it(client, keys):
    """Threads append to one episode at the stream's tail (as a writer that rebases on the stream's length does,
    without folding it first) while one of them ends it: the end is the stream's last event, the only terminal
    one, and the stream folds."""
    import threading

    from shared.protocol.episode.fold import fold

    for round_ in range(5):
        eid = f"race{round_}"
        _start(EpisodeLog(client, keys, "starter"), eid)
        go = threading.Barrier(4)
        refused: list[Exception] = []

        def write(name: str, ending: bool) -> None:
            log = EpisodeLog(client, keys, name)
            go.wait()
            for k in range(40):
                log.open(eid, client.xlen(keys.episode(eid)))
                if ending and k >= 10:
                    log.append(eid, "failed", {"error": "cut", "where": "agent"}, 0)
                    if not log.flush():
                        # its end landed
                        return
                else:
                    log.append_tokens(eid, [k], [0.0], 0)
                    refused.extend(e for e in log.flush().values() if isinstance(e, Ended))

        threads = [threading.Thread(target=write, args=(f"w{i}", i == 0)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ep = fold(client.xrange(keys.episode(eid)))
        assert ep.status == "failed" and ep.events[-1].kind == "failed"
        assert sum(e.kind in ("finished", "failed") for e in ep.events) == 1
        assert refused, "no writer came after the end: the race was not run"


def test_a_writer_made_without_the_end_guard_still_refuses_events_after_its_own_end(client, keys):
    """The rollout worker's own writer (guard_end=False: the only writer of its plain episodes) skips reading the
    stream's last entry, and still never writes past an end in its own batch."""
    log = EpisodeLog(client, keys, "rw", guard_end=False)
    _start(log)
    log.append("e1", "finished", {"reason": "stop", "reward": 1.0}, 0)
    log.append("e1", "tokens", {"ids": [1], "logprobs": [0.0]}, 0)
    with pytest.raises(Ended, match="after its finished"):
        log.flush_or_raise()
    assert client.xlen(keys.episode("e1")) == 1

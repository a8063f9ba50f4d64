import msgpack
import pytest

from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import Event
from shared.protocol.episode.fold import PROMPT_VERSION, fold
from tests.support.helpers import finished, raw, started, tokens


def test_fold_rebuilds_tokens_versions_tools_aborts_and_finish():
    evs = [
        started(),
        tokens(1, [10, 11], policy=0, logprobs=[-0.25, -0.5]),
        Event("aborted", 0, "w", 2, {"reason": "pause", "num_tokens": 2}),
        Event("resumed", 1, "w2", 3, {"num_tokens": 2, "takeover_from": "w"}),
        tokens(4, [12], policy=1, worker="w2", logprobs=[-1.0]),
        Event("tool_call", 1, "w2", 5, {"call_id": "c1", "name": "calc", "args": "2+2"}),
        Event("tool_result", 1, "w2", 6, {"call_id": "c1", "ok": True, "output": "4", "ids": [40]}),
        tokens(7, [13, 2], policy=1, worker="w2", logprobs=[-0.125, -2.0]),
        finished(8, reward=0.5, policy=1),
    ]
    ep = fold(raw(evs))
    assert ep.prompt_ids == [5, 6, 7] and ep.task == {"answer": "42"}
    assert ep.tokens == [10, 11, 12, 40, 13, 2]
    assert ep.logprobs == [-0.25, -0.5, -1.0, 0.0, -0.125, -2.0]
    assert ep.versions == [0, 0, 1, PROMPT_VERSION, 1, 1]
    assert ep.mask == [1, 1, 1, 0, 1, 1] and ep.num_generated == 5
    assert ep.aborts == [{"reason": "pause", "version": 0, "num_tokens": 2, "worker": "w", "seq": 2}]
    assert ep.resumes[0]["takeover_from"] == "w" and ep.resumes[0]["version"] == 1
    assert ep.tool_results[0]["output"] == "4" and not ep.pending_tool_calls
    assert (ep.status, ep.finish_reason, ep.reward, ep.last_seq, ep.last_worker) == ("finished", "stop", 0.5, 8, "w")
    assert ep.context_ids == [5, 6, 7, 10, 11, 12, 40, 13, 2]


def test_fold_of_events_equals_fold_of_raw_entries():
    evs = [started(), tokens(1, [1, 2, 3]), finished(2)]
    assert fold(evs).tokens == fold(raw(evs)).tokens == [1, 2, 3]


def test_partial_episode_is_running_or_paused():
    assert fold(raw([started(), tokens(1, [1])])).status == "running"
    paused = fold(raw([started(), tokens(1, [1]), Event("aborted", 0, "w", 2, {"reason": "pause", "num_tokens": 1})]))
    assert paused.status == "paused" and not paused.done


def _bad(entries, index):
    """Fold must fail naming the entry at ``index``."""
    with pytest.raises(EventError) as err:
        fold(entries)
    assert err.value.entry_id == entries[index][0].decode()
    return err.value


def test_gap_is_refused():
    err = _bad(raw([started(), tokens(1, [1]), tokens(3, [2])]), 2)
    assert err.field == "seq" and "gap: expected 2, got 3" in str(err)


def test_duplicate_is_refused():
    err = _bad(raw([started(), tokens(1, [1]), tokens(1, [1])]), 2)
    assert err.field == "seq" and "duplicate: expected 2, got 1" in str(err)


def test_unknown_kind_is_refused():
    entries = raw([started(), tokens(1, [1])])
    entries[1][1][b"type"] = b"teleported"
    assert _bad(entries, 1).field == "type"


def test_unknown_schema_version_is_refused():
    entries = raw([started(), tokens(1, [1])])
    entries[1][1][b"v"] = b"9"
    err = _bad(entries, 1)
    assert err.field == "v" and "unknown schema version 9" in str(err)


def test_undecodable_payload_is_refused():
    entries = raw([started(), tokens(1, [1])])
    # msgpack array header promising two items, one given
    entries[1][1][b"data"] = b"\x92\x01"
    assert _bad(entries, 1).field == "data"


def test_tokens_after_finish_are_refused():
    err = _bad(raw([started(), tokens(1, [1]), finished(2), tokens(3, [2])]), 3)
    assert err.field == "type" and "after the episode finished" in str(err)


def test_first_event_must_be_started():
    assert _bad(raw([tokens(0, [1])]), 0).field == "type"


def test_second_started_is_refused():
    assert _bad(raw([started(), started(seq=1)]), 1).field == "type"


def test_resume_count_must_match_stream():
    evs = [started(), tokens(1, [1, 2]), Event("resumed", 1, "w", 2, {"num_tokens": 5})]
    assert _bad(raw(evs), 2).field == "data.num_tokens"


def test_tool_result_needs_its_call():
    evs = [started(), Event("tool_result", 0, "w", 1, {"call_id": "nope", "ok": True, "output": "", "ids": []})]
    assert _bad(raw(evs), 1).field == "data.call_id"


def test_empty_stream_is_refused():
    with pytest.raises(EventError, match="empty stream"):
        fold([])


def test_missing_payload_field_names_kind():
    entries = raw([started(), finished(1)])
    entries[1][1][b"data"] = msgpack.packb({"reason": "stop"})
    err = _bad(entries, 1)
    assert err.field == "data.reward" and "'finished'" in str(err)

"""Expert routes in the episode log: the wire form, the schema's checks, the fold's alignment with tokens, and the
log writer joining routed chunks."""

import msgpack
import numpy as np
import pytest

from shared.protocol.episode import routes
from shared.protocol.episode.errors import EventError
from shared.protocol.episode.events import Event, decode, encode
from shared.protocol.episode.fold import fold
from shared.protocol.episode.log import EpisodeLog
from tests.protocol.test_fold_calls import agent_started, call, done
from tests.support.helpers import finished, raw, started
from tests.support.moe_episodes import SHAPE, random_routes, routed_tokens


@pytest.mark.parametrize("experts", [8, 256, 300])
def test_pack_unpack_round_trip_in_the_narrowest_width(experts):
    shape = routes.RouteShape(4, 2, experts)
    r = random_routes(5, shape)
    wire = routes.pack(r)
    assert len(wire["planes"]) == 5 * 4 * 2 * (1 if experts <= 256 else 2)
    back = routes.unpack("1-0", "data.routes", wire, 5)
    assert back.dtype == r.dtype and np.array_equal(back, r)


def test_planes_are_layer_major_so_a_steady_layer_is_one_run_of_bytes():
    r = np.zeros((6, 2, 1), dtype=np.uint8)
    r[:, 0, 0], r[:, 1, 0] = 3, np.arange(6)
    assert routes.pack(r)["planes"] == bytes([3] * 6 + list(range(6)))


def test_canonical_sorts_each_layers_choice():
    r = routes.canonical(np.array([[[5, 1], [0, 7]]]), SHAPE)
    assert r.tolist() == [[[1, 5], [0, 7]]] and r.dtype == np.uint8


def test_a_tokens_entry_carries_its_routes_through_encode_and_decode():
    r = random_routes(4)
    ev = decode("1-0", encode(routed_tokens(1, [1, 2, 3, 4], r)))
    assert np.array_equal(ev.data["routes"], r)


@pytest.mark.parametrize(
    ("wire", "field", "says"),
    [
        ({"layers": 3, "k": 2, "planes": b"\x00" * 5}, "data.routes.planes", "expected 24 or 48 bytes"),
        ({"layers": 0, "k": 2, "planes": b""}, "data.routes.layers", "positive integer"),
        ({"layers": 3, "k": True, "planes": b""}, "data.routes.k", "positive integer"),
        ({"layers": 3, "k": 2, "planes": [1, 2]}, "data.routes.planes", "expected bytes"),
        ([1, 2, 3], "data.routes", "expected a map"),
    ],
)
def test_a_malformed_routes_field_is_named(wire, field, says):
    fields = encode(routed_tokens(1, [1, 2, 3, 4], random_routes(4)))
    payload = msgpack.unpackb(fields["data"])
    payload["routes"] = wire
    fields["data"] = msgpack.packb(payload, use_bin_type=True)
    with pytest.raises(EventError) as err:
        decode("7-0", fields)
    assert err.value.field == field and says in err.value.problem and err.value.entry_id == "7-0"


def test_mismatch_names_layers_top_k_and_expert_range():
    r = random_routes(2)
    assert routes.mismatch("1-0", "data.routes", r, SHAPE) is None
    wrong_layers = routes.mismatch("1-0", "data.routes", r, routes.RouteShape(2, 2, 8))
    assert "3 layers x top-2" in str(wrong_layers) and "2 MoE layers" in str(wrong_layers)
    r[0, 0, 1] = 9
    too_big = routes.mismatch("1-0", "data.routes", r, SHAPE)
    assert "expert index 9" in str(too_big) and "8 experts" in str(too_big)


def test_fold_aligns_routes_with_tokens_across_an_unrouted_chunk_and_tool_output():
    a, b = random_routes(2, seed=1), random_routes(1, seed=2)
    evs = [
        started(),
        Event("tokens", 0, "w", 1, {"ids": [9], "logprobs": [-0.1]}),
        routed_tokens(2, [10, 11], a),
        Event("tool_call", 0, "w", 3, {"call_id": "c", "name": "calc", "args": "1"}),
        Event("tool_result", 0, "w", 4, {"call_id": "c", "ok": True, "output": "1", "ids": [40, 41]}),
        routed_tokens(5, [12], b, policy=1),
        finished(6),
    ]
    ep = fold(raw(evs))
    assert len(ep.routes) == len(ep.tokens) == 6
    assert ep.routes[0] is None and ep.routes[3] is None and ep.routes[4] is None
    assert np.array_equal(np.stack([ep.routes[1], ep.routes[2]]), a) and np.array_equal(ep.routes[5], b[0])


def test_a_dense_episode_folds_with_no_routes():
    assert (
        fold(raw([started(), Event("tokens", 0, "w", 1, {"ids": [1], "logprobs": [-1.0]}), finished(2)])).routes == []
    )


def test_an_agent_chain_row_holds_each_calls_routes_and_none_for_the_bridge():
    a, b = random_routes(2, seed=3), random_routes(1, seed=4)
    evs = [
        agent_started(),
        call(1, 0, -1, [5, 6]),
        routed_tokens(2, [7, 8], a, call_index=0),
        done(3, 0, 2),
        call(4, 1, 0, [30]),
        routed_tokens(5, [9], b, call_index=1),
        done(6, 1, 1),
        Event("finished", 1, "runner", 7, {"reason": "stop", "reward": 1.0}),
    ]
    ep = fold(raw(evs))
    assert ep.tokens == [7, 8, 30, 9] and ep.mask == [1, 1, 0, 1]
    assert ep.routes[2] is None and np.array_equal(ep.routes[3], b[0])
    assert np.array_equal(np.stack(ep.routes[:2]), a)


def test_the_log_joins_routed_chunks_of_one_version_and_keeps_unrouted_ones_apart(client, keys):
    log = EpisodeLog(client, keys, "w")
    log.open("e1")
    log.append("e1", "started", started().data, 0)
    a, b = random_routes(2, seed=5), random_routes(3, seed=6)
    log.append_tokens("e1", [1, 2], [-0.5, -0.5], 0, a)
    log.append_tokens("e1", [3, 4, 5], [-0.5] * 3, 0, b)
    log.append_tokens("e1", [6], [-0.5], 0)
    assert log.flush() == {}
    entries = log.read("e1")
    assert [decode(*e).kind for e in entries] == ["started", "tokens", "tokens"]
    ep = fold(entries)
    assert np.array_equal(np.stack(ep.routes[:5]), np.concatenate([a, b])) and ep.routes[5] is None


def test_a_segment_row_gives_a_routed_episode_back_byte_for_byte(client, keys, tmp_path):
    from shared.protocol.archive import builder, segments

    log = EpisodeLog(client, keys, "w")
    log.open("e1")
    log.append("e1", "started", started().data, 0)
    log.append_tokens("e1", [1, 2, 3], [-0.5] * 3, 0, random_routes(3, seed=7))
    log.append("e1", "finished", finished(3).data, 0)
    assert log.flush() == {}
    entries = log.read("e1")
    segments.write_file(tmp_path, "s1", builder.table_of([("e1", entries)]))
    store = segments.SegmentStore(tmp_path)
    store.add("s1", ["e1"])
    back = store.read("e1")
    assert [(i, dict(f)) for i, f in back] == [(i, dict(f)) for i, f in entries]
    assert np.array_equal(np.stack(fold(back).routes), np.stack(fold(entries).routes))

"""`streamrl replay --routes`: a mixture-of-experts episode's logged experts, token by token, in text and JSON."""

import json

import numpy as np

from services.ops.inspect.views import format_timeline, timeline_json
from shared.protocol.episode.events import Event
from shared.protocol.episode.fold import fold
from tests.support.helpers import finished, raw, started
from tests.support.moe_episodes import random_routes, routed_tokens


def episode():
    r = random_routes(3, seed=9)
    evs = [started(), routed_tokens(1, [10, 11], r[:2]), routed_tokens(2, [12], r[2:], policy=1), finished(3)]
    return fold(raw(evs)), r


def test_the_text_timeline_lists_each_tokens_experts_layer_by_layer_on_request():
    ep, r = episode()
    plain = format_timeline(ep)
    assert "routes: 3 of 3 response tokens, 3 MoE layers x top-2" in plain and "experts per layer" not in plain
    lines = format_timeline(ep, routes=True).splitlines()
    row = next(line for line in lines if line.split()[:2] == ["2", "12"])
    assert row.split()[2] == "v1"
    assert row.endswith(" | ".join(",".join(map(str, layer)) for layer in r[2].tolist()))


def test_json_gives_routes_per_token_on_request_and_their_shape_in_each_event():
    ep, r = episode()
    out = json.loads(json.dumps(timeline_json(ep)))
    assert "routes" not in out
    assert [e["data"].get("routes") for e in out["events"]][1] == {"tokens": 2, "layers": 3, "k": 2}
    full = json.loads(json.dumps(timeline_json(ep, routes=True)))
    assert np.array_equal(np.array(full["routes"]), r)


def test_a_dense_episode_says_it_has_no_routes():
    ep = fold(raw([started(), Event("tokens", 0, "w", 1, {"ids": [1], "logprobs": [-1.0]}), finished(2)]))
    assert "routes:" not in format_timeline(ep)
    assert "routes: none logged" in format_timeline(ep, routes=True)
    assert timeline_json(ep, routes=True)["routes"] == []


def test_routes_under_a_version_are_computed_beside_the_logged_ones(client, keys, redis_url, tmp_path, capsys):
    from services.ops.cli.main import main
    from tests.support.arch_models import make_arch_model
    from tests.support.moe_episodes import rollout, write_group

    moe_dir = make_arch_model("qwen3-moe", tmp_path / "moe")
    eid = write_group(client, keys, "g", rollout(moe_dir, n=1, max_tokens=6))[0]
    where = ["--run", keys.run, "--run-dir", str(tmp_path / "runs"), "--redis-url", redis_url, "--model-dir", moe_dir]
    assert main(["replay", eid, "--routes", "--version", "0", "--json", *where]) == 0
    out = json.loads(capsys.readouterr().out)
    # the weights that sampled route every token as logged
    assert out["routes_under"]["routes"] == out["routes"] and set(out["routes_under"]["layers_changed"]) == {0}
    assert main(["replay", eid, "--routes", "--version", "0", *where]) == 0
    assert "routes under v0" in capsys.readouterr().out
    assert main(["replay", eid, "--version", "0", *where]) != 0
    assert "--version and --weights go with --continue or --routes" in capsys.readouterr().err

"""`streamrl ui` without a browser: the episode index (built once, kept, brought up to date by reading only the
episodes not yet ended), the query string's errors, the episode page's markers against `streamrl replay --json`,
and the routes over a real server (its key, its JSON)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.ops.inspect.episodes import Filters
from services.ops.inspect.run_target import Target
from services.ops.inspect.views import timeline_json
from services.ops.ui import queries
from services.ops.ui.app import make_app
from services.ops.ui.episode_view import episode_view
from services.ops.ui.index import EpisodeIndex, decode_rows, encode_rows
from services.ops.ui.sources import RunSource, Sources
from shared.protocol.episode.events import Event
from shared.protocol.episode.fold import fold
from shared.runtime.config.keys import Config
from tests.ops.test_episodes import STREAMS
from tests.support.helpers import finished, raw, started, tokens


def _write(client, keys, streams):
    for eid, evs in streams.items():
        for _, fields in raw(evs):
            client.xadd(keys.episode(eid), fields)


def test_the_index_is_built_once_kept_and_reads_only_episodes_not_yet_ended(client, keys, tmp_path):
    _write(client, keys, STREAMS)
    # still running
    _write(client, keys, {"g3-0": [started(episode_id="g3-0"), tokens(1, [1], policy=1)]})
    index = EpisodeIndex(client, keys, tmp_path, run_id="r1")
    assert index.refresh() == 5 and len(index.table) == 5
    total, rows = index.query(Filters(min_aborts=2))
    assert total == 1 and rows[0].episode_id == "g1-1"
    # only the running one is read again
    assert index.refresh() == 1
    # ... which now ends
    client.xadd(keys.episode("g3-0"), raw([finished(2, reward=1.0)])[0][1])
    _write(client, keys, {"g4-0": [started(episode_id="g4-0"), tokens(1, [9, 9], policy=4), finished(2, reward=0.5)]})
    # then nothing: every episode has ended
    assert index.refresh() == 2 and index.refresh() == 0
    assert index.query(Filters(outcomes=("finished",)), "reward", True)[1][0].reward == 1.0
    # the next `streamrl ui`: from the cache
    again = EpisodeIndex(client, keys, tmp_path, run_id="r1")
    assert again.load() == 6 and again.refresh() == 0
    # another run of the same name: not its rows
    assert EpisodeIndex(client, keys, tmp_path, run_id="r2").load() == 0
    assert decode_rows("r1", b"\x93torn") == [] and len(decode_rows("r1", encode_rows("r1", again.table))) == 6


def test_a_bad_query_names_its_parameter():
    q = queries.parse(
        {"outcome": "failed,truncated", "min_aborts": "2", "sort": "reward", "desc": "1", "kind": "agent"}
    )
    assert q.filters.outcomes == ("failed", "truncated") and q.filters.min_aborts == 2 and q.desc and q.filters.agent
    for params, message in (
        ({"min_aborts": "two"}, "min_aborts: expected an integer, got 'two'"),
        ({"outcome": "lost"}, "outcome: unknown lost"),
        ({"sort": "size"}, "sort: expected one of"),
        ({"reward_below": "x"}, "reward_below: expected a number"),
        ({"limit": "100000"}, "limit: expected at most"),
        ({"offset": "-1"}, "offset: expected >= 0"),
        ({"kind": "robot"}, "kind: expected agent or plain"),
        ({"desc": "maybe"}, "desc: expected"),
    ):
        with pytest.raises(queries.QueryError, match=message):
            queries.parse(params)


def test_the_episode_page_has_the_replay_json_and_its_markers_where_the_stream_puts_them():
    # aborted twice, resumed, then taken over by worker B
    ep = fold(raw(STREAMS["g1-1"] + []))
    view = episode_view(ep, "demo")
    # the page's data is `streamrl replay --json`'s, unchanged
    assert view["replay"] == timeline_json(ep)
    assert [(m["kind"], m["at"], m["worker"], m["version"]) for m in view["markers"]] == [
        ("aborted", 2, "A", 1),
        ("resumed", 2, "A", 2),
        ("aborted", 3, "A", 1),
        ("takeover", 3, "B", 2),
    ]
    assert view["command"] == "streamrl replay g1-1 --run demo --continue"
    assert view["commands"]["4"] == "streamrl replay g1-1 --run demo --continue --from-seq 4"
    tool = fold(
        raw(
            [
                started(episode_id="t-0"),
                tokens(1, [1, 2], policy=1),
                Event("tool_call", 1, "w", 2, {"call_id": "c1", "name": "calc", "args": "1+1"}),
                Event("tool_result", 1, "w", 3, {"call_id": "c1", "ok": True, "output": "2", "ids": [7, 8, 9]}),
                tokens(4, [3], policy=1),
                finished(5, reward=1.0),
            ]
        )
    )
    marks = episode_view(tool, "demo")["markers"]
    assert [(m["kind"], m["at"]) for m in marks] == [("tool_call", 2), ("tool_result", 2)]
    # the page draws the three result tokens as masked
    assert tool.mask == [1, 1, 0, 0, 0, 1]


def _app(client, keys, tmp_path, api_key=""):
    runs = tmp_path / "runs"
    (runs / keys.run).mkdir(parents=True)
    sources = Sources(Config(run_dir=str(runs)), {})
    target = Target(Config(run=keys.run), keys, runs / keys.run, None)
    sources.runs[keys.run] = RunSource(keys.run, target, client, served=True, stack=sources.stack)
    return TestClient(make_app(sources, api_key))


def test_the_routes_answer_with_a_key_and_refuse_without(client, keys, tmp_path):
    _write(client, keys, STREAMS)
    http = _app(client, keys, tmp_path, api_key="k3y")
    assert http.get("/api/runs").status_code == 401 and http.get("/healthz").status_code == 200
    bearer = {"Authorization": "Bearer k3y"}
    # once, then a cookie
    page = http.get(f"/run/{keys.run}/episodes?key=k3y", follow_redirects=False)
    assert page.status_code == 303 and "key" not in page.headers["location"]
    assert "plotly.min.js" in http.get(f"/run/{keys.run}/episodes").text
    assert http.get("/static/plotly.min.js").headers["content-type"].startswith("application/javascript")
    got = http.get(f"/api/run/{keys.run}/episodes", params={"outcome": "failed,truncated"}, headers=bearer)
    # the first build runs in the background
    for _ in range(50):
        if got.json()["built"]:
            break
        got = http.get(f"/api/run/{keys.run}/episodes", params={"outcome": "failed,truncated"}, headers=bearer)
    assert sorted(r["episode_id"] for r in got.json()["rows"]) == ["g2-0", "g2-1"]
    bad = http.get(f"/api/run/{keys.run}/episodes", params={"min_aborts": "x"}, headers=bearer)
    assert bad.status_code == 400 and "min_aborts: expected an integer" in bad.json()["error"]
    ep = http.get(f"/api/run/{keys.run}/ep/g1-1", headers=bearer).json()
    assert ep["replay"]["versions"] == [1, 1, 2, 3] and len(ep["markers"]) == 4
    assert http.get(f"/api/run/{keys.run}/ep/nope", headers=bearer).status_code == 404
    assert http.get("/api/run/..%2Fetc/ep/x", headers=bearer).status_code == 404
    run = http.get(f"/api/run/{keys.run}", headers=bearer).json()
    assert run["dead_letters"] == [] and run["train"]["step"] == []


def test_the_run_view_adds_up_staleness_and_busy_time():
    from services.ops.ui.run_view import busy, generated, samples_per_s, staleness

    train = [
        {"step": 1, "time": 10.0, "samples": 8, "wait_s": 1.0, "train_s": 1.0, "staleness": {"0": 6, "1": 2}},
        {"step": 2, "time": 12.0, "samples": 8, "wait_s": 0.5, "train_s": 1.0, "staleness": {"0": 8}},
    ]
    assert staleness(train) == {"0": 14, "1": 2} and samples_per_s(train) == [4.0, 4.0]
    rollout = [{"worker": "r1", "busy_s": 1, "idle_s": 2}, {"worker": "r1", "busy_s": 5, "idle_s": 3}]
    assert busy(rollout, train) == {"process": ["r1", "trainer"], "busy_s": [5.0, 2.0], "waiting_s": [3.0, 1.5]}
    assert generated(rollout) == {"tokens": 0, "final": False}
    assert generated(rollout + [{"worker": "r1", "tokens": 40, "call_tokens": 2, "final": True}]) == {
        # the newest report per worker, exact once it is final
        "tokens": 42,
        "final": True,
    }


def test_an_agent_episode_is_drawn_call_by_call_with_forks_and_its_masked_prompt_tokens():
    from tests.protocol.test_fold_calls import agent_started, call, done, toks
    from tests.protocol.test_fold_calls import finished as agent_finished

    evs = [
        agent_started(),
        call(1, 0, -1, [1, 2, 3]),
        toks(2, 0, [10, 11]),
        Event("aborted", 0, "w", 3, {"reason": "pause", "num_tokens": 2, "call": 0}),
        Event("resumed", 1, "w2", 4, {"num_tokens": 2, "call": 0, "takeover_from": "w"}),
        toks(5, 0, [12], policy=1, worker="w2"),
        done(6, 0, 3, worker="w2"),
        call(7, 1, 0, [4, 5], policy=1),
        toks(8, 1, [13], policy=1),
        done(9, 1, 1),
        call(10, 2, -1, [7, 8]),
        toks(11, 2, [14], policy=1),
        done(12, 2, 1),
        agent_finished(13),
    ]
    view = episode_view(fold(raw(evs)), "demo")
    calls = view["calls"]
    assert [(c["index"], c["fork"], c["versions"]) for c in calls] == [
        (0, False, [0, 0, 1]),
        (1, False, [1]),
        (2, True, [1]),
    ]
    # [1,2,3,10,11,12] then 4, 5 new
    assert calls[1]["new_from"] == 6 and len(calls[1]["prompt_pieces"]) == 8
    assert [(m["kind"], m["at"], m["worker"]) for m in calls[0]["markers"]] == [
        ("aborted", 2, "w"),
        ("takeover", 2, "w2"),
    ]
    assert calls[1]["command"] == "streamrl replay e1 --run demo --continue --from-call 1"


def test_the_index_and_the_episode_page_read_episodes_the_archiver_moved(client, keys, tmp_path):
    """the browser reads one log. Episodes moved to segments are listed and drawn as those in Redis are,
    and those that ended and moved between two refreshes are found in the segments."""
    from services.archiver.mover import Mover
    from shared.protocol.archive.segments import SegmentStore
    from tests.archiver.tiers_support import make_run

    http = _app(client, keys, tmp_path)
    run_path = tmp_path / "runs" / keys.run
    store = SegmentStore(run_path / "episodes")
    index = EpisodeIndex(client, keys, None, archive=store)
    # built before the run wrote anything
    assert index.refresh() == 0
    groups = make_run(client, keys, run_path, versions=6)
    eids = sorted(e for es in groups.values() for e in es)
    moved = sorted(e for g in ("g1", "g2", "g3", "g4") for e in groups[g])
    # while all are in Redis
    pages = {e: http.get(f"/api/run/{keys.run}/ep/{e}").json() for e in eids}
    assert Mover(client, keys, run_path, retention=2).step() == len(moved)
    assert not any(client.exists(keys.episode(e)) for e in moved)
    # 4 in Redis, 8 moved unseen
    assert index.refresh() == 12 and sorted(s.episode_id for s in index.table) == eids
    assert index.refresh() == 0
    fresh = EpisodeIndex(client, keys, None, archive=SegmentStore(run_path / "episodes"))
    # both tiers, once each
    assert fresh.refresh() == 12 and sorted(s.episode_id for s in fresh.table) == eids
    assert sorted(s.episode_id for s in fresh.table if s.reward == 1.0) == sorted(
        # make_run's reward: the version's parity
        e
        for e in eids
        if int(e[1]) % 2
    )
    # the page of a moved episode is the page it had in Redis
    for eid in eids:
        assert http.get(f"/api/run/{keys.run}/ep/{eid}").json() == pages[eid], eid
    assert "replay" in pages[moved[0]]


def test_an_moe_episode_page_has_its_routes_and_another_versions_on_request(client, keys, tmp_path):
    from tests.support.arch_models import make_arch_model
    from tests.support.moe_episodes import rollout, write_group

    moe_dir = make_arch_model("qwen3-moe", tmp_path / "moe")
    eid = write_group(client, keys, "g", rollout(moe_dir, n=1, max_tokens=6))[0]
    runs = tmp_path / "runs"
    (runs / keys.run).mkdir(parents=True)
    sources = Sources(Config(run_dir=str(runs)), {})
    target = Target(Config(run=keys.run, model_dir=moe_dir), keys, runs / keys.run, None)
    sources.runs[keys.run] = RunSource(keys.run, target, client, served=True, stack=sources.stack)
    http = TestClient(make_app(sources, ""))
    page = http.get(f"/api/run/{keys.run}/ep/{eid}").json()
    assert len(page["routes"]) == len(page["replay"]["tokens"]) and "routes_under" not in page
    under = http.get(f"/api/run/{keys.run}/ep/{eid}", params={"routes_under": 0}).json()["routes_under"]
    # the weights that sampled: nothing moved
    assert under["routes"] == page["routes"] and set(under["layers_changed"]) == {0}
    assert under["summary"].startswith("routes under v0") and "0 of 6 routed tokens" in under["summary"]
    _write(client, keys, STREAMS)
    dense = http.get(f"/api/run/{keys.run}/ep/g1-1", params={"routes_under": 0})
    assert dense.status_code == 422 and "no routes logged" in dense.json()["error"]

"""A mixture-of-experts episode's routes survive what interrupts its generation: a weight sync that aborts every
episode mid-way and resumes it under the new version (in-process), and a kill -9 of the rollout worker whose
episodes another worker takes over (subprocesses). Each time the routes in the log are compared, token by token,
with the ones the engine handed out and with a plain forward of prompt + tokens under the generating version's
weights."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from services.rollout.engine import Chunk
from services.rollout.engine.torch_engine import TorchEngine
from shared.protocol.keys import ROLLOUT_GROUP
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.models import nudged_weights
from tests.support.moe_episodes import Forward
from tests.support.procs import kill9, stop, wait_until
from tests.support.rollout_harness import (
    acks,
    episodes,
    make_worker,
    samples,
    send,
    snapshot,
    tick_until,
    worker_proc,
)

GROUPS = [(f"g{i}", 2) for i in range(4)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """The default tiny model made as a Qwen3-MoE (8 experts, top-2, 2 MoE layers): the harness's prompts fit its
    tokenizer."""
    from services.ops.launch.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-moe")), moe="qwen3")


class RecordingEngine:
    """The real TorchEngine, unchanged, with a copy of every Chunk it hands the worker (from step, abort and
    abort_all) kept per request: what the worker held, to compare with what reached the log."""

    def __init__(self, engine: TorchEngine):
        self.inner = engine
        self.chunks: dict[str, list[Chunk]] = defaultdict(list)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self) -> list[Chunk]:
        return self._keep(self.inner.step())

    def abort(self, request_id: str) -> Chunk | None:
        chunk = self.inner.abort(request_id)
        if chunk is not None:
            self._keep([chunk])
        return chunk

    def abort_all(self) -> list[Chunk]:
        return self._keep(self.inner.abort_all())

    def _keep(self, chunks: list[Chunk]) -> list[Chunk]:
        for c in chunks:
            routes = None if c.routes is None else np.array(c.routes, copy=True)
            self.chunks[c.request_id].append(
                Chunk(c.request_id, list(c.token_ids), list(c.logprobs), c.version, c.finish_reason, routes)
            )
        return chunks

    def held(self, request_id: str) -> tuple[list[int], list[int], list]:
        """(tokens, each token's version, each token's route or None) over every chunk handed out for a request."""
        tokens, versions, routes = [], [], []
        for c in self.chunks[request_id]:
            tokens += c.token_ids
            versions += [c.version] * len(c.token_ids)
            routes += [None] * len(c.token_ids) if c.routes is None else list(c.routes)
        return tokens, versions, routes


def routes_of(ep) -> np.ndarray:
    """The folded episode's routes as one [n, L, k] array; every token must have one."""
    assert len(ep.routes) == len(ep.tokens), (len(ep.routes), len(ep.tokens))
    missing = [i for i, r in enumerate(ep.routes) if r is None]
    assert not missing, f"tokens without a route at {missing[:10]} of {len(ep.tokens)}"
    return np.stack(ep.routes)


def forward_mismatches(ep, forwards: dict[int, Forward]) -> list[int]:
    """Indices of the episode's tokens whose logged route differs from the forward, under the weights of the version
    that generated the token, of prompt + every token (causal: later tokens do not change earlier positions)."""
    logged = routes_of(ep)
    versions = np.array(ep.versions)
    wrong = []
    for version in sorted(set(ep.versions)):
        expected = forwards[version].routes(ep.prompt_ids, ep.tokens)
        mine = versions == version
        differs = (expected != logged).any(axis=(1, 2)) & mine
        wrong += np.flatnonzero(differs).tolist()
    return sorted(wrong)


def test_a_weight_sync_mid_episode_keeps_every_tokens_route_and_routes_the_rest_under_the_new_version(
    client, keys, moe_dir, tmp_path
):
    """Episodes generate under version 0; the syncer's pause, load (version 1) and resume abort them all mid-way;
    the worker resumes each from its stream and the engine re-prefills it under version 1. Every token of the log
    has the route the engine handed out for it, on both sides of the abort, and that route is what a forward of the
    generating version routes."""
    cfg = Config(run=keys.run, model_dir=moe_dir, max_tokens=40, tools="", flush_tokens=4, routing_replay=True)
    engine = RecordingEngine(TorchEngine(moe_dir, max_batch_size=16, routing_replay=True))
    assert engine.route_shape is not None
    v1_path, v1_sha = nudged_weights(moe_dir, tmp_path / "v1", 1)
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    worker = make_worker(cfg, client, engine=engine)
    tick_until(worker, lambda: sum(len(engine.held(eid)[0]) >= 6 for eid in list(engine.chunks)) >= 6)
    for cmd in ("pause", "load", "resume"):
        send(client, keys, cmd, "s1", version=1, path=str(v1_path), sha256=v1_sha)
    tick_until(worker, lambda: len(samples(client, keys)) == len(GROUPS))
    assert [a["ok"] for a in acks(client, keys, "load")] == ["1"] and worker.engine.version == 1

    forwards = {0: Forward(moe_dir), 1: Forward(moe_dir, v1_path)}
    eps = episodes(client, keys, GROUPS)
    across, told_apart = [], 0
    for eid, ep in eps.items():
        assert ep.status == "finished", (eid, ep.status, ep.error)
        tokens, versions, held = engine.held(eid)
        # the log holds what the engine handed out, in order, each token with its version and its route
        assert ep.tokens == tokens and ep.versions == versions, eid
        logged = routes_of(ep)
        assert all(r is not None for r in held), eid
        assert np.array_equal(logged, np.stack(held)), eid
        assert forward_mismatches(ep, forwards) == [], eid
        if {0, 1} <= set(ep.versions):
            # aborted by the sync mid-episode and resumed under version 1
            assert any(a["reason"] == "pause" for a in ep.aborts) and ep.resumes, eid
            across.append(eid)
            # the versions route differently: the forward under the generating version is what the check needs
            v0_routes = forwards[0].routes(ep.prompt_ids, ep.tokens)
            told_apart += int(((v0_routes != logged).any(axis=(1, 2)) & (np.array(ep.versions) == 1)).sum())
    assert told_apart > 0
    assert across, {eid: sorted(set(ep.versions)) for eid, ep in eps.items()}


def _worker_proc(redis_url, keys, model_dir, worker_id):
    # routing_replay is on by default: the MoE model's worker records routes without being asked
    return worker_proc(redis_url, keys, model_dir, worker_id, max_tokens=40, log_level="warning")


@pytest.mark.slow(seconds=15)
def test_kill_9_mid_episode_keeps_the_flushed_routes_and_the_takeover_routes_every_token_it_adds(
    client, keys, redis_url, moe_dir
):
    """Worker A dies by kill -9 while its episodes generate; B takes them over from their streams and re-prefills
    each under the same weights. The routes A flushed are unchanged, every token of every finished episode has a
    route, and each is what a plain forward of prompt + tokens routes."""
    enqueue(client, keys, [PromptGroup(g, n, prompt=f"{g}: 3*4=") for g, n in GROUPS])
    a = _worker_proc(redis_url, keys, moe_dir, "A")
    try:
        wait_until(
            lambda: sum(len(ep.tokens) >= 8 and not ep.done for ep in snapshot(client, keys, GROUPS).values()) >= 6,
            "worker A generating 6 episodes",
            60,
            [a],
        )
    finally:
        kill9(a)
    before = snapshot(client, keys, GROUPS)
    assert len(samples(client, keys)) < len(GROUPS)
    b = _worker_proc(redis_url, keys, moe_dir, "B")
    try:
        wait_until(lambda: len(samples(client, keys)) == len(GROUPS), "B finishing every group", 90, [b])
    finally:
        stop(b)
    assert sorted(s["group_id"] for s in samples(client, keys)) == sorted(g for g, _ in GROUPS)
    assert client.xpending(keys.prompts, ROLLOUT_GROUP)["pending"] == 0
    forward = {0: Forward(moe_dir)}
    after = episodes(client, keys, GROUPS)
    taken_over, extended, wrong = 0, 0, {}
    for eid, ep in after.items():
        assert ep.status == "finished" and set(ep.versions) == {0}, (eid, ep.status, ep.error)
        logged = routes_of(ep)
        if eid in before and before[eid].tokens:
            old = before[eid]
            # every token flushed before the kill is still there with its route, unchanged
            assert ep.tokens[: len(old.tokens)] == old.tokens, eid
            assert np.array_equal(logged[: len(old.tokens)], routes_of(old)), eid
            if not old.done:
                assert ep.resumes and ep.resumes[0]["takeover_from"] == "A", eid
                taken_over += 1
                # B's own tokens, routed after its re-prefill of A's
                extended += len(ep.tokens) > ep.resumes[0]["num_tokens"]
        if bad := forward_mismatches(ep, forward):
            wrong[eid] = bad
    assert taken_over >= 6 and extended >= 1
    total = sum(len(ep.tokens) for ep in after.values())
    assert not wrong, f"{sum(map(len, wrong.values()))} of {total} tokens route otherwise in a plain forward: {wrong}"

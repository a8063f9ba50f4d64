"""Opening a group: a newly claimed group's starts ride with the read of the other opened groups' streams (one round
trip; a started stream is not read back). A group claimed as new whose streams already hold events (a group held
before, its prompt delivered again) is resumed from them, read in a second round trip: nothing written twice, nothing
dropped."""

from __future__ import annotations

import structlog

from services.rollout.groups.claims import GroupRun
from shared.protocol.episode.fold import fold
from shared.protocol.streams.prompts import PromptGroup, enqueue
from shared.runtime.config.keys import Config
from tests.support.rollout_harness import make_worker, samples, tick_until


def test_a_new_group_whose_streams_hold_events_resumes_from_them(client, keys, tiny_model_dir):
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        max_tokens=48,
        tools="",
        flush_tokens=4,
        flush_ms=1e6,
        heartbeat_ttl=600.0,
        max_groups_in_flight=1,
        temperature=1.0,
    )
    group = PromptGroup("g", 2, prompt="g: 3*4=")
    enqueue(client, keys, [group])
    a = make_worker(cfg, client, "A")
    streams = lambda: {e: client.xrange(keys.episode(e)) for e in group.episode_ids()}  # noqa: E731
    tick_until(a, lambda: "g" in a.groups and all(fold(s).tokens for s in streams().values()))
    a.episodes.flush()
    before = {e: fold(s) for e, s in streams().items()}
    assert not all(ep.done for ep in before.values())
    run = a.groups["g"]
    with structlog.testing.capture_logs() as logs:
        # claimed as new
        a.episodes.open_groups([GroupRun(run.group, list(run.episodes), source=run.source)])
        tick_until(a, lambda: len(samples(client, keys)) == 1 and not a.groups)
    assert not [e for e in logs if e["event"].startswith("fenced")]
    for episode_id, entries in streams().items():
        ep = fold(entries)
        kinds = [e.kind for e in ep.events]
        assert ep.done and kinds.count("started") == 1 and kinds.count("finished") == 1
        # an episode that had ended stays as it was
        assert ("resumed" in kinds) is not before[episode_id].done
        assert ep.tokens[: len(before[episode_id].tokens)] == before[episode_id].tokens
    assert [s["group_id"] for s in samples(client, keys)] == ["g"]

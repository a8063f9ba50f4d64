"""The rollout worker's rq jobs after a Redis crash: a job whose hash came back holding only its worker's heartbeat
fields cannot be read by rq; it counts as gone (a failed outcome for its episode), and the others are still read."""

from __future__ import annotations

import time

from services.rollout.jobs.tool_jobs import Pending, ToolJobs


def test_a_job_hash_left_with_only_a_heartbeat_is_a_failed_outcome_not_a_crash(client, keys):
    jobs = ToolJobs(client, "tools-lost", keys.run, "", "tests.support.debug_tools:noop", 5.0, 5.0)
    jobs.reward("ep-ok", "p", "r", {})
    # what a crashed Redis can come back with: the worker's heartbeat fields, nothing of the job itself
    client.hset("rq:job:lost-1", mapping={"last_heartbeat": "2026-01-01T00:00:00Z", "status": "started"})
    jobs.pending["ep-lost"] = Pending("lost-1", "tool", "c1", time.monotonic() + 60, 5.0)
    out = {o.episode_id: o for o in jobs.poll()}
    assert set(out) == {"ep-lost"} and not out["ep-lost"].ok
    # the readable job is still waited on (queued, nobody runs it here)
    assert set(jobs.pending) == {"ep-ok"}

"""rq workers run only the run's own jobs (shared/runtime/job_guard.py): a job naming any other function, or the
project's job function with another spec, fails with one line and runs nothing."""

from __future__ import annotations

from rq import Queue
from rq.job import Callback, Job, JobStatus
from rq.serializers import JSONSerializer

from services.rollout.jobs.tools_worker import RUN_REWARD, RUN_TOOL, allowed
from shared.runtime.config.keys import Config
from shared.runtime.job_guard import refusal
from tests.support.procs import spawn, stop, wait_until


def test_refusal_admits_only_the_runs_functions_and_specs():
    rules = allowed(Config(tools="calc", reward_fn="services.rollout.jobs.rewards:arithmetic"))
    assert refusal(RUN_TOOL, ("calc", "calc", "1+1"), {}, (), rules) is None
    assert refusal(RUN_REWARD, ("services.rollout.jobs.rewards:arithmetic", "p", "r", {}, None), {}, (), rules) is None
    assert "not one this worker runs" in refusal("os.system", ("id",), {}, (), rules)
    assert "is not the run's" in refusal(RUN_TOOL, ("os:system", "system", "id"), {}, (), rules)
    assert "is not the run's" in refusal(RUN_REWARD, ("builtins:exec", "p", "r", {}), {}, (), rules)
    assert "keyword arguments" in refusal(RUN_TOOL, (), {"config": "calc"}, (), rules)
    assert "callbacks" in refusal(RUN_TOOL, ("calc", "calc", "1"), {}, ("os.system", None, None), rules)


def test_a_live_tools_worker_refuses_os_system_and_runs_nothing(redis_url, client, keys, tmp_path):
    cfg = Config(run=keys.run, tools="calc")
    log = tmp_path / "tools.log"
    proc = spawn(
        "services.rollout.jobs.tools_worker",
        "--run",
        keys.run,
        "--redis-url",
        redis_url,
        "--tools",
        cfg.tools,
        "--log-level",
        "warning",
        log=log,
    )
    marker, marker2 = tmp_path / "pwned", tmp_path / "pwned2"
    try:
        q = Queue(keys.tool_queue, connection=client, serializer=JSONSerializer)
        evil = q.enqueue_call("os.system", args=(f"touch {marker}",))
        other_spec = q.enqueue_call(RUN_TOOL, args=("tests.support.debug_tools:sleep", "sleep", "0"))
        callback = q.enqueue_call(
            RUN_TOOL, args=("calc", "calc", "bad"), on_failure=Callback("os.system"), on_success=Callback("os.system")
        )
        good = q.enqueue_call(RUN_TOOL, args=("calc", "calc", "6*7"))
        jobs = [evil, other_spec, callback, good]
        wait_until(
            lambda: all(
                Job.fetch(j.id, connection=client, serializer=JSONSerializer).get_status()
                in (JobStatus.FINISHED, JobStatus.FAILED)
                for j in jobs
            ),
            "jobs ended",
            procs=[proc],
        )
        fetched = [Job.fetch(j.id, connection=client, serializer=JSONSerializer) for j in jobs]
        assert [j.get_status() for j in fetched] == [JobStatus.FAILED] * 3 + [JobStatus.FINISHED]
        # the run's own job still runs
        assert fetched[3].return_value() == "42"
        for job in fetched[:3]:
            last = job.latest_result().exc_string.strip().splitlines()[-1]
            assert "JobRefused" in last and "refused" in last
        assert not marker.exists() and not marker2.exists()
        # the worker lives on
        assert proc.poll() is None
    finally:
        stop(proc)
    refused = [line for line in log.read_text().splitlines() if "job refused" in line]
    assert len(refused) == 3 and "os.system" in refused[0]


def test_the_agents_worker_runs_only_the_runs_agent():
    from services.gateway.agents_worker import RUN_EPISODE
    from services.gateway.agents_worker import allowed as agent_rules

    rules = agent_rules(Config(run="r", agent="examples.calc:agent"))
    assert refusal(RUN_EPISODE, ({"run": "r", "agent": "examples.calc:agent"},), {}, (), rules) is None
    assert "is not this run's" in refusal(RUN_EPISODE, ({"run": "r", "agent": "os:system"},), {}, (), rules)
    assert "is not this run's" in refusal(
        RUN_EPISODE, ({"run": "other", "agent": "examples.calc:agent"},), {}, (), rules
    )
    assert "spec" in refusal(RUN_EPISODE, ("x",), {}, (), rules)

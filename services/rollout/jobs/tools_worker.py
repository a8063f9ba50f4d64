"""`python -m services.rollout.jobs.tools_worker`: an rq worker that runs tool calls
(JSON serializer, no pickle). Tool jobs keep running while generation pauses.

It runs only the run's own tool and reward jobs (``allowed``: the config's ``tools`` and ``reward_fn``); any
other job fails with one line and runs nothing (shared/runtime/job_guard.py)."""

from __future__ import annotations

from rq import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, Worker

from shared.runtime.job_guard import Check, guarded_job_class, spec_arg
from shared.runtime.service import Service

# the job functions of services/rollout/jobs/tool_jobs.py
RUN_TOOL = "services.rollout.jobs.tools.run_tool"
RUN_REWARD = "services.rollout.jobs.rewards.run_reward"


def allowed(cfg) -> dict[str, Check]:
    """The jobs this run's tools worker runs: its tool calls and its reward, with the specs its config names."""
    return {RUN_TOOL: spec_arg("tools", cfg.tools), RUN_REWARD: spec_arg("reward_fn", cfg.reward_fn)}


def main(argv=None) -> None:
    svc = Service(
        "tools",
        argv,
        extra_args=lambda p: p.add_argument(
            "--fork", action="store_true", help="fork a work horse per job (default: run jobs in-process)"
        ),
    )
    job_class = guarded_job_class(allowed(svc.cfg), svc.log)
    queue = Queue(svc.keys.tool_queue, connection=svc.rq_client, serializer=JSONSerializer, job_class=job_class)
    cls = Worker if svc.args.fork else SimpleWorker
    worker = cls([queue], connection=svc.rq_client, serializer=JSONSerializer, name=svc.worker_id, job_class=job_class)
    svc.log.info("ready", queue=queue.name, worker_class=cls.__name__)
    worker.work(logging_level="WARNING", with_scheduler=False)


if __name__ == "__main__":
    main()

"""rq jobs of a rollout worker: tool calls and reward scoring (JSON serializer, the run's tools queue).

A job's id is derived from its episode (and call), so a worker that takes an episode over re-attaches to the
job already queued or done instead of running it again. ``poll`` reports finished, failed and overdue jobs
(a job no rq worker picks up is not waited on forever); ``forget`` drops the jobs of episodes this worker no
longer owns.

The queues may be on another server than the run's streams (``rq_redis_url``: always when the run's Redis is a
cluster, where rq does not run). The worker's one blocking read cannot include rq's result streams then, so a
worker waiting on jobs looks at them every ``CHECK_S`` instead of waking on their results.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.results import Result
from rq.serializers import JSONSerializer

from services.rollout.jobs import rewards, tools

# queues on another server: how often a worker waiting on jobs looks at them
CHECK_S = 0.1


@dataclass
class Pending:
    job_id: str
    # "tool" | "reward"
    kind: str
    # tool: the call it answers; reward: ""
    call_id: str
    # monotonic; past it the job counts as failed
    deadline: float
    timeout: float


@dataclass(frozen=True)
class Outcome:
    episode_id: str
    kind: str
    call_id: str
    ok: bool
    # tool: output text; reward: [reward, details]; when not ok: the error message
    value: object


class ToolJobs:
    def __init__(
        self,
        client,
        queue_name: str,
        run: str,
        tools_config: str,
        reward_spec: str,
        tool_timeout: float,
        reward_timeout: float,
        wake_on_results: bool = True,
    ):
        """``client``: the rq queues' server; ``wake_on_results``: it is the server of the worker's blocking read
        (which then includes ``result_streams``)."""
        self.client, self.run, self.wake_on_results = client, run, wake_on_results
        self.queue = Queue(queue_name, connection=client, serializer=JSONSerializer)
        self.tools_config, self.reward_spec = tools_config, reward_spec
        self.tool_timeout, self.reward_timeout = tool_timeout, reward_timeout
        # episode id -> its one job in flight
        self.pending: dict[str, Pending] = {}

    def _job_id(self, *parts: str) -> str:
        return re.sub(r"[^A-Za-z0-9_-]", "_", "-".join((self.run, *parts)))

    def _submit(
        self, episode_id: str, kind: str, call_id: str, func, args: tuple, timeout: float, attach: bool
    ) -> None:
        job_id = self._job_id(episode_id, call_id or kind)
        if not attach or not Job.exists(job_id, connection=self.client):
            self.queue.enqueue_call(
                func, args=args, job_id=job_id, timeout=max(1, int(timeout)), result_ttl=3600, failure_ttl=3600
            )
        self.pending[episode_id] = Pending(job_id, kind, call_id, time.monotonic() + 3 * timeout + 5, timeout)

    def tool(self, episode_id: str, call_id: str, name: str, args: str, attach: bool = False) -> None:
        """Run a tool call; ``attach``: the call is already in the stream, its job may exist already."""
        self._submit(
            episode_id, "tool", call_id, tools.run_tool, (self.tools_config, name, args), self.tool_timeout, attach
        )

    def reward(self, episode_id: str, prompt: str, response: str, task: dict, group: list | None = None) -> None:
        self._submit(
            episode_id,
            "reward",
            "",
            rewards.run_reward,
            (self.reward_spec, prompt, response, task, group),
            self.reward_timeout,
            attach=True,
        )

    def waiting(self) -> bool:
        return bool(self.pending)

    def result_streams(self) -> dict[str, str]:
        """rq's result stream of each job in flight, from its start: a blocking read of these returns as soon as a
        job finishes or fails (rq appends its result there), so a worker waiting on jobs needs no polling. None when
        the queues are on another server."""
        if not self.wake_on_results:
            return {}
        return {Result.get_key(p.job_id): "0-0" for p in self.pending.values()}

    def next_deadline(self) -> float | None:
        """The soonest time (time.monotonic) the worker must look at its jobs: one in flight counts as failed for
        taking too long, or (queues on another server) the next check."""
        soonest = min((p.deadline for p in self.pending.values()), default=None)
        if soonest is not None and not self.wake_on_results:
            soonest = min(soonest, time.monotonic() + CHECK_S)
        return soonest

    def forget(self, episode_ids) -> None:
        for episode_id in episode_ids:
            self.pending.pop(episode_id, None)

    def _fetch(self, job_ids: list[str]) -> list[Job | None]:
        """The jobs, None for each one gone. A Redis that crashed can come back with a job's hash holding only what
        its worker wrote after (a heartbeat): rq cannot read that job, and it counts as gone (failed, its episode
        told so), not as a reason for this worker to die."""
        try:
            return Job.fetch_many(job_ids, connection=self.client, serializer=JSONSerializer)
        except NoSuchJobError:
            jobs = []
            for job_id in job_ids:
                try:
                    jobs.append(Job.fetch(job_id, connection=self.client, serializer=JSONSerializer))
                except NoSuchJobError:
                    jobs.append(None)
            return jobs

    def poll(self) -> list[Outcome]:
        if not self.pending:
            return []
        items = list(self.pending.items())
        jobs = self._fetch([p.job_id for _, p in items])
        out = []
        for (episode_id, p), job in zip(items, jobs):
            status = job.get_status(refresh=False) if job is not None else None
            if status == JobStatus.FINISHED:
                value = job.return_value()
                out.append(Outcome(episode_id, p.kind, p.call_id, True, str(value) if p.kind == "tool" else value))
            elif status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                result = job.latest_result()
                exc = (result.exc_string or "").strip().splitlines() if result else []
                message = exc[-1] if exc else f"{p.kind} job {status.value}"
                if "JobTimeoutException" in message:
                    message = f"{p.kind} timed out after {p.timeout:g}s"
                out.append(Outcome(episode_id, p.kind, p.call_id, False, message))
            elif job is None or time.monotonic() > p.deadline:
                if job is not None:
                    job.cancel()
                out.append(
                    Outcome(
                        episode_id, p.kind, p.call_id, False, f"{p.kind} did not complete within {3 * p.timeout + 5:g}s"
                    )
                )
            else:
                continue
            del self.pending[episode_id]
        return out

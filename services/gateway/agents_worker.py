"""`python -m services.gateway.agents_worker`: an rq worker that runs agent episodes.

``SimpleWorker``s (the job runs in this process; the agent's tools run in it
too, and keep running while a weight sync pauses generation). ``agent_concurrency``
of them run in threads of one process (agents mostly wait: on the LLM, on their
tools), each with its own rq name; only the main thread's handles signals, and
the others use rq's timer death penalty (signals reach the main thread only).
A warm stop (SIGTERM) gives running episodes STOP_GRACE_S to end; anything cut
short is run again by a reaper. Run several processes for more (``streamrl run`` starts
``agent_workers`` of them).

Durability: rq 3.0 retries an abandoned job only once its started-registry
entry expires (the job monitoring interval + 60 s) and a maintenance pass runs
(every 10 minutes by default). This worker reaps faster with streamrl's own
heartbeats: it writes ``alive:agents:<id>`` every second, and a job listed in
``agents:running`` under a worker whose heartbeat key has been missing for a
whole ``heartbeat_ttl`` is enqueued again (one claim per job, by a
compare-and-set). The re-run's calls are answered from the episode stream. The
dead worker's job is moved to rq's canceled registry (meta ``superseded_by``),
so rq never lists a failure for an episode that finished.
"""

from __future__ import annotations

import json
import os
import threading
import time

from rq import Queue, SimpleWorker
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from services.gateway import runner
from shared.runtime.connection import connect
from shared.runtime.job_guard import Check, guarded_job_class
from shared.runtime.service import Service

RUN_EPISODE = "services.gateway.runner.run_episode"


def allowed(cfg) -> dict[str, Check]:
    """The one job this run's agents workers run: an episode of the run's own agent (config ``agent``)."""

    def check(args: tuple, kwargs: dict) -> str | None:
        spec = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(spec, dict):
            return "expected one argument, the episode's spec"
        if spec.get("agent") != cfg.agent or spec.get("run") != cfg.run:
            return (
                f"agent {spec.get('agent')!r} of run {spec.get('run')!r} is not this run's ({cfg.agent!r}, {cfg.run!r})"
            )
        return None

    return {RUN_EPISODE: check}


_CLAIM = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
"""


class Reaper:
    def __init__(self, cfg, client, keys, worker_id: str, log, rq_client=None):
        self.cfg, self.client, self.keys, self.worker_id, self.log = cfg, client, keys, worker_id, log
        self.queue = Queue(keys.agent_queue, connection=rq_client or client, serializer=JSONSerializer)
        self.missing: dict[str, float] = {}

    def reap(self) -> int:
        requeued = 0
        for eid, raw in self.client.hgetall(self.keys.agents_running).items():
            entry = json.loads(raw)
            owner = entry["worker"]
            if not self.dead(owner):
                continue
            spec = {**entry["spec"], "attempt": entry["spec"].get("attempt", 0) + 1}
            mine = json.dumps({"worker": f"requeued-by-{self.worker_id}", "spec": spec})
            if self.client.eval(_CLAIM, 1, self.keys.agents_running, eid, raw, mine):
                rerun = self._rerun(spec)
                self.retire(entry.get("job"), rerun.id)
                self.log.warning(
                    "agent episode re-run: its worker died", episode=eid.decode(), dead=owner, attempt=spec["attempt"]
                )
                requeued += 1
        return requeued + self.orphans()

    def dead(self, owner: str) -> bool:
        """Whether the agents worker ``owner`` (its worker id) has been silent for a heartbeat_ttl, as seen here."""
        if owner == self.worker_id or self.client.exists(self.keys.alive("agents", owner)):
            self.missing.pop(owner, None)
            return False
        return time.monotonic() - self.missing.setdefault(owner, time.monotonic()) >= self.cfg.heartbeat_ttl

    def orphans(self) -> int:
        """Jobs rq handed to a worker that died before the episode was recorded in ``agents:running`` (a kill
        between rq's dequeue and the runner's first write): started in rq's books, by a dead worker, with no
        ``agents:running`` entry. Each is claimed (HSETNX, so one reaper wins) and run again like ``reap``'s."""
        requeued = 0
        registry = StartedJobRegistry(queue=self.queue)
        for job_id in registry.get_job_ids(cleanup=False):
            try:
                job = Job.fetch(job_id, connection=self.queue.connection, serializer=JSONSerializer)
            except NoSuchJobError:
                continue
            # thread workers are named <worker id>.<k>
            owner, _, k = (job.worker_name or "").rpartition(".")
            owner = owner if k.isdigit() else job.worker_name or ""
            if job.get_status(refresh=False) != JobStatus.STARTED or not owner or not self.dead(owner):
                continue
            spec = job.args[0] if job.args and isinstance(job.args[0], dict) else None
            if spec is None or "episode_id" not in spec:
                continue
            spec = {**spec, "attempt": spec.get("attempt", 0) + 1}
            mine = json.dumps({"worker": f"requeued-by-{self.worker_id}", "spec": spec})
            if self.client.hsetnx(self.keys.agents_running, spec["episode_id"], mine):
                self.retire(job.id, self._rerun(spec).id)
                self.log.warning(
                    "agent episode re-run: its worker died as it took the job",
                    dead=owner,
                    episode=spec["episode_id"],
                    attempt=spec["attempt"],
                )
                requeued += 1
        return requeued

    def _rerun(self, spec: dict):
        return self.queue.enqueue_call(
            runner.run_episode.__module__ + ".run_episode",
            args=(spec,),
            job_id=f"{spec['run']}-{spec['episode_id']}-r{spec['attempt']}",
            timeout=int(spec.get("timeout", 600)) + 60,
            result_ttl=3600,
            failure_ttl=86400,
            at_front=True,
        )

    def retire(self, job_id: str | None, rerun_id: str) -> None:
        """The dead worker's job is not a failure: its episode runs again as ``rerun_id``. Out of rq's started
        registry (where rq would later find it abandoned and list it failed) into the canceled one, with a note
        of what replaced it; a job already gone or already ended is left as it is."""
        if not job_id:
            return
        try:
            job = Job.fetch(job_id, connection=self.queue.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return
        if job.get_status(refresh=False) != JobStatus.STARTED:
            return
        job.meta["superseded_by"] = rerun_id
        job.save_meta()
        job.cancel()


class ThreadWorker(SimpleWorker):
    """A SimpleWorker for a thread that is not the main one: no signal handlers (the main thread's worker stops
    the others), job timeouts by a timer instead of SIGALRM."""

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self):
        pass


# a warm stop's wait for running episodes: honcho kills -9 what is left after 5 s
STOP_GRACE_S = 3.0


class MainWorker(SimpleWorker):
    """The main thread's worker. On SIGTERM (rq's warm stop: no new job) the episodes running in this process get
    STOP_GRACE_S to end; then the process exits 0 with one line. An episode cut short stays in ``agents:running``
    and a reaper runs it again if the run goes on (its calls answered from its stream); at the end of a run the
    gateway and the rollout workers are stopping too, so no episode could end anyway."""

    others: list = []

    def request_stop(self, signum, frame):
        # an agent whose call breaks from now on was cut by the run's end, not failed (runner.STOPPING)
        runner.STOPPING.set()
        self.log.warning("stopping: an agent call that breaks from now on cuts its episode short, not failed")

        def cut_short() -> None:
            running = [w.get_current_job_id() for w in [self, *self.others]]
            running = [j for j in running if j]
            if running:
                self.log.warning(
                    "stopping: %d agent episode(s) cut short (a reaper runs them again if the run goes on): %s",
                    len(running),
                    ", ".join(running),
                )
                os._exit(0)

        threading.Timer(STOP_GRACE_S, cut_short).start()
        super().request_stop(signum, frame)


def _work(worker) -> None:
    worker.work(with_scheduler=False, logging_level="WARNING")


def main(argv=None) -> None:
    svc = Service("agents", argv)
    runner.WORKER_ID = svc.worker_id
    # from the config, never from a job
    runner.GATEWAY = (svc.cfg.agent_gateway_url, svc.cfg.gateway_api_key)
    # the jobs' rq connection is another server: they write the run's streams through this
    if svc.cfg.rq_redis_url:
        runner.CLIENT = svc.client
    reaper = Reaper(svc.cfg, connect(svc.cfg.redis_url), svc.keys, svc.worker_id, svc.log, svc.rq_connect())
    ttl = svc.cfg.heartbeat_ttl

    # a thread: the heartbeat keeps going while an agent runs in the main thread
    def beat() -> None:
        hb = connect(svc.cfg.redis_url)
        key = svc.keys.alive("agents", svc.worker_id)
        while True:
            try:
                pipe = hb.pipeline()
                pipe.hset(key, mapping={"time": time.time()})
                pipe.pexpire(key, int(ttl * 1000))
                pipe.execute()
                reaper.reap()
            # Redis away for a moment: try again next beat
            except Exception as exc:
                svc.log.warning("heartbeat failed", error=str(exc))
            time.sleep(min(1.0, ttl / 3))

    threading.Thread(target=beat, daemon=True, name="agents-heartbeat").start()
    job_class = guarded_job_class(allowed(svc.cfg), svc.log)
    queue = Queue(svc.keys.agent_queue, connection=svc.rq_client, serializer=JSONSerializer, job_class=job_class)
    main_worker = MainWorker(
        [queue], connection=svc.rq_client, serializer=JSONSerializer, name=svc.worker_id, job_class=job_class
    )
    others = [
        ThreadWorker(
            [queue],
            connection=svc.rq_connect(),
            serializer=JSONSerializer,
            job_class=job_class,
            name=f"{svc.worker_id}.{k}",
        )
        for k in range(1, svc.cfg.agent_concurrency)
    ]
    main_worker.others = others
    threads = [threading.Thread(target=_work, args=(w,), daemon=True, name=w.name) for w in others]
    for t in threads:
        t.start()
    svc.log.info("ready", queue=queue.name, concurrency=svc.cfg.agent_concurrency)
    # returns on SIGTERM once its own episode has ended
    _work(main_worker)
    for w in others:
        # rq's own flag: the loop stops before its next job
        w._stop_requested = True
    deadline = time.monotonic() + STOP_GRACE_S
    while any(w.get_current_job_id() for w in others) and time.monotonic() < deadline:
        # let running episodes end (a cut-short one would be re-run by a reaper anyway)
        time.sleep(0.2)


if __name__ == "__main__":
    main()

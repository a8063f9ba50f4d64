"""`python -m services.rollout.jobs.tools_worker`: an rq worker that runs tool calls
(JSON serializer, no pickle). Tool jobs keep running while generation pauses."""

from __future__ import annotations

from rq import Queue
from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker, Worker


from shared.runtime.service import Service


def main(argv=None) -> None:
    svc = Service("tools", argv, extra_args=lambda p: p.add_argument(
        "--fork", action="store_true", help="fork a work horse per job (default: run jobs in-process)"))
    queue = Queue(svc.keys.tool_queue, connection=svc.rq_client, serializer=JSONSerializer)
    cls = Worker if svc.args.fork else SimpleWorker
    worker = cls([queue], connection=svc.rq_client, serializer=JSONSerializer, name=svc.worker_id)
    svc.log.info("ready", queue=queue.name, worker_class=cls.__name__)
    worker.work(logging_level="WARNING", with_scheduler=False)


if __name__ == "__main__":
    main()

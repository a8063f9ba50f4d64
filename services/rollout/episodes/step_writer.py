"""The step writer: a rollout worker's per-step Redis round trip, off the engine step's critical path.

After an engine step the worker hands this step's writes (the episode log's batch, plus its non-blocking read of
the streams that wake it) to one background thread and runs the next engine step while they travel; it takes the
results after that step (``wait``), one step later. Double buffering: at most one batch is in flight, so the
episodes' seqs stay in order, and whoever needs a write durable now waits for the one in flight first.

The thread only runs the function it is given (``EpisodeLog.send``: encode and one pipeline, on a connection of
its own from the client's pool, a cluster client's included); everything the results change is applied by the
caller's thread.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class StepWriter:
    def __init__(self, name: str = "step-writer"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._future: Future | None = None
        self._context: Any = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def submit(self, fn: Callable[[], Any], context: Any = None) -> None:
        """Run ``fn`` on the writer thread; ``context`` comes back with its result from ``wait``."""
        if self._future is not None:
            raise RuntimeError("a batch is already in flight: wait() for it before submitting another")
        self._future, self._context = self._pool.submit(fn), context

    def wait(self) -> tuple[Any, Any]:
        """(``fn``'s result, the context given with it) of the batch in flight; its exception is raised here."""
        if self._future is None:
            raise RuntimeError("no batch in flight")
        future, context, self._future, self._context = self._future, self._context, None, None
        return future.result(), context

    def close(self) -> None:
        """Wait for the batch in flight (its result is dropped: settle it before closing) and stop the thread."""
        self._pool.shutdown(wait=True)

"""rq workers run only what the run names.

rq's JSON serializer keeps pickle off the wire, but a job still names the function it calls by its import path:
anyone who can write to a queue could have a worker call ``os.system``. A worker's jobs are therefore checked
before anything of them is imported or called: the function must be one of the project's job functions the
worker serves, and its spec argument (the tools, the reward function, the agent) the one the run's config names;
callbacks and dependencies are refused outright. A refused job fails with one line (``JobRefused``) and one
warning in the worker's log; nothing of it runs.

``allowed`` maps a job function's import path to a check of its arguments: ``check(args, kwargs)`` returns why
they are refused, or None.
"""

from __future__ import annotations

from typing import Callable

from rq.job import Job

Check = Callable[[tuple, dict], "str | None"]


class JobRefused(RuntimeError):
    """A queued job this worker will not run; the message says which and why, in one line."""


def refusal(func_name: str | None, args, kwargs, callbacks: tuple, allowed: dict[str, Check]) -> str | None:
    """Pure: why a job calling ``func_name(*args, **kwargs)`` is refused, or None when it may run."""
    if func_name not in allowed:
        return f"function {func_name!r} is not one this worker runs (allowed: {', '.join(sorted(allowed))})"
    if any(callbacks):
        return f"callbacks {[c for c in callbacks if c]} are not allowed"
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        return "arguments are not a list and a mapping"
    return allowed[func_name](tuple(args), kwargs)


def spec_arg(name: str, expected: str, pick=lambda args: args[0] if args else None) -> Check:
    """A check that the job's spec argument (``pick(args)``) is the run's ``expected`` one."""

    def check(args: tuple, kwargs: dict) -> str | None:
        if kwargs:
            return f"keyword arguments {sorted(kwargs)} are not allowed"
        try:
            got = pick(args)
        except (IndexError, KeyError, TypeError):
            got = None
        if got != expected:
            return f"{name} {got!r} is not the run's ({expected!r})"
        return None

    return check


def guarded_job_class(allowed: dict[str, Check], log) -> type[Job]:
    """A Job class whose ``perform`` refuses, before importing anything, every job ``allowed`` does not admit."""

    class GuardedJob(Job):
        def perform(self):
            callbacks = (self._success_callback_name, self._failure_callback_name, self._stopped_callback_name)
            # JSON: reading the job's data runs nothing
            try:
                why = refusal(self.func_name, self.args, self.kwargs, callbacks, allowed)
                if why is None and self.instance is not None:
                    why = "a method of an instance is not allowed"
            # data that does not decode: refused the same way
            except Exception as exc:
                why = f"unreadable job data ({exc.__class__.__name__})"
            if why is not None:
                # none of its callbacks runs either (rq calls the failure callback of a failed job)
                self._success_callback_name = self._failure_callback_name = self._stopped_callback_name = None
                self._success_callback = self._failure_callback = self._stopped_callback = None
                log.warning("job refused: not run", job=self.id, queue=self.origin, reason=why)
                raise JobRefused(f"job {self.id} refused: {why}")
            return super().perform()

    return GuardedJob

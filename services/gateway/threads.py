"""Where a request's blocking work runs: its Redis reads and writes, and the wait for its call, in a thread of one
pool, off the event loop that serves every other request.

A plain executor, not ``anyio.to_thread``: anyio takes a capacity limiter, a cancel scope and its context-variable
lookups on every hop, which on a small box is a good share of a short call's own cost. A request whose client goes
away stops waiting at once; its thread finishes the work it holds (each read blocks at most a second)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any, Callable

# every call held open waits in a thread: room for many agents at once
MAX_THREADS = 512

_pool = concurrent.futures.ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="gateway-call")


async def run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the pool; its result or its exception, awaited."""
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))

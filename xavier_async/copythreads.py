"""Large host copies off the event loop: a small pool of threads owned by one endpoint.

A pack (the source's gather into its send slab) or unpack (the receiver's scatter into
the caches) of host memory with at least ``EndpointConfig.copy_thread_bytes`` bytes runs
on one of ``EndpointConfig.copy_threads`` threads. ``memmove`` and torch's copies release
the GIL, so meanwhile the event loop keeps polling notifications and serving and loading
small batches; it only hands the copy over and is woken when it ends. A table of many
small runs is copied there in a few system calls (:mod:`xavier_async.hostcopy`), so that
the thread does not wait for the GIL once a run.

The contract is the loop's own: a started copy is never abandoned. Its wait is shielded,
so a cancellation that arrives meanwhile is delivered once the copy has ended, and close
drains every load and serve (so every copy) before it joins the threads. Copies of CUDA
memory are kernels already off the loop and never come here.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

import anyio

from .errors import EndpointClosedError
from .hostcopy import mark_copy_thread
from .transports.base import ended_event

T = TypeVar("T")


class CopyThreads:
    """``threads`` copy threads (0: every copy runs on the loop), for copies of at least
    ``min_bytes``; started on first use, joined by :meth:`close`."""

    def __init__(self, threads: int, min_bytes: int) -> None:
        self.threads = threads
        self.min_bytes = min_bytes
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        #: copies run on the threads so far
        self.copies = 0

    def wants(self, nbytes: int) -> bool:
        """Whether a host copy of ``nbytes`` goes to the threads."""
        return self.threads > 0 and nbytes >= self.min_bytes and not self._closed

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a copy thread; returns its result or raises its exception.
        Shielded: once handed over, the copy is waited for to its end."""
        if self._closed:
            raise EndpointClosedError("the endpoint's copy threads are closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="xavier-copy", initializer=mark_copy_thread)
        fut = self._pool.submit(fn, *args)
        self.copies += 1
        done = ended_event(fut)
        with anyio.CancelScope(shield=True):
            await done.wait()
        return fut.result()

    def close(self) -> None:
        """Join the threads (after the endpoint drained its work); idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["CopyThreads"]

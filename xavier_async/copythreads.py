"""Large host copies off the event loop: a small pool of threads owned by one endpoint.

A pack (the source's gather into its send slab) or unpack (the receiver's scatter into
the caches) of host memory with at least ``EndpointConfig.copy_thread_bytes`` bytes runs
on one of ``EndpointConfig.copy_threads`` threads. ``memmove`` and torch's copies release
the GIL, so meanwhile the event loop keeps polling notifications and serving and loading
small batches; it only hands the copy over and is woken when it ends. A table of many
small runs is copied there in a few system calls (:mod:`xavier_async.hostcopy`), so that
the thread does not wait for the GIL once a run. A table of at least twice
``copy_thread_bytes`` is cut into pieces of about equal bytes (at least
``copy_thread_bytes`` each) that every thread copies at once (:meth:`CopyThreads.run_runs`;
``EndpointConfig.split_copies``, off by default): one thread's ``process_vm_readv`` moved
a scattered 12 MiB table at 3.3 GB/s on the 2-core machine, two threads at once 7.0 GB/s
(``scripts/split_copy.py``).

The contract is the loop's own: a started copy is never abandoned. Its wait is shielded,
so a cancellation that arrives meanwhile is delivered once the copy has ended, and close
drains every load and serve (so every copy) before it joins the threads. Copies of CUDA
memory are kernels already off the loop and never come here.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import anyio

from .errors import EndpointClosedError
from .hostcopy import copy_runs, mark_copy_thread, split_runs
from .transports.base import ended_event

T = TypeVar("T")


class CopyThreads:
    """``threads`` copy threads (0: every copy runs on the loop), for copies of at least
    ``min_bytes``; started on first use, joined by :meth:`close`."""

    def __init__(self, threads: int, min_bytes: int, *, split: bool = False) -> None:
        self.threads = threads
        self.min_bytes = min_bytes
        #: whether :meth:`run_runs` cuts a large table across the threads
        self.split = split
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        #: copies run on the threads so far, and those of them cut across several threads
        self.copies = 0
        self.split_copies = 0

    def wants(self, nbytes: int) -> bool:
        """Whether a host copy of ``nbytes`` goes to the threads."""
        return self.threads > 0 and nbytes >= self.min_bytes and not self._closed

    def parts(self, nbytes: int) -> int:
        """How many threads a host copy of ``nbytes`` is cut across by :meth:`run_runs`."""
        if not self.split or self.threads < 2:
            return 1
        return max(1, min(self.threads, nbytes // self.min_bytes))

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._closed:
            raise EndpointClosedError("the endpoint's copy threads are closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="xavier-copy", initializer=mark_copy_thread)
        return self._pool

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a copy thread; returns its result or raises its exception.
        Shielded: once handed over, the copy is waited for to its end."""
        fut = self._executor().submit(fn, *args)
        self.copies += 1
        done = ended_event(fut)
        with anyio.CancelScope(shield=True):
            await done.wait()
        return fut.result()

    async def run_runs(self, table: tuple[list[int], list[int], list[int]]) -> None:
        """Copy a run table of host memory on the threads: cut into :meth:`parts` pieces
        of about equal bytes, all copied at once (:meth:`run_all`)."""
        await self.run_all([functools.partial(copy_runs, *piece)
                            for piece in split_runs(*table, self.parts(sum(table[2])))])

    async def run_all(self, fns: Sequence[Callable[[], object]]) -> None:
        """Run every ``fn()`` at once, each on a copy thread (the pieces of one copy).
        Shielded: every piece handed over is waited for to its end before the first
        failure (if any) is raised; counted as one copy."""
        if len(fns) == 1:
            await self.run(fns[0])
            return
        pool = self._executor()
        futs: list[concurrent.futures.Future[object]] = []
        try:
            for fn in fns:
                futs.append(pool.submit(fn))
        finally:  # even if a submit failed, the pieces handed over are waited for
            ends = [ended_event(f) for f in futs]
            with anyio.CancelScope(shield=True):
                for done in ends:
                    await done.wait()
        self.copies += 1
        self.split_copies += 1
        for f in futs:
            f.result()

    def close(self) -> None:
        """Join the threads (after the endpoint drained its work); idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["CopyThreads"]

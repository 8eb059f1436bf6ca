"""Large host WRITEs through a second NIXL agent, posted from a thread of its own.

Over UCX's shared-memory path a host WRITE is copied inside ``agent.transfer`` by the
thread that posts it: 2.0 ms for 12 MiB on the 16-core GPU host, 2.2-2.7 ms on the
2-core machine, all of it on the event loop, so a small load that arrives meanwhile
waits behind it. Here such a WRITE goes through a second agent of the endpoint's own
(its *bulk* agent: the same send slabs registered again, its own UCX worker) on one
thread of its own, so the event loop's agent and the bulk agent are never driven by the
same thread and the loop only hands the copy over and is woken when it ends. Measured
raw (``scripts/post_thread.py 3 agents``) on the 16-core host: the small requests' p99
102-117 us against 1,073-1,273 us inline, the 12 MiB stream 6.0 against 6.3 GB/s. On
2 cores the third busy thread has no core of its own (p99 2,330-8,480 against
1,196-1,621 us), so it is on by rule only where the process may run on
:data:`BULK_MIN_CPUS` CPUs or more (``NixlTransport(bulk_bytes=...)`` decides).

* The peer learns the bulk agent's name in our hello and maps its notifications (the
  WRITE's "landed") to our rank; it needs no metadata of it: a WRITE's target is the
  peer's own registered receive slab, which the bulk agent learns as the main one does.
* Threads: the bulk agent is built with NIXL's ``STRICT`` thread sync, since the loop
  still makes and releases its handles (rarely) while the thread posts and polls.
* The contract is the loop's own: a started copy is never abandoned. :meth:`BulkLane.ended`
  is woken only when the thread's job has ended: DONE, failed, or still posted when its
  peer was lost or ``write_timeout`` passed (then the copy is *stuck* and the poller
  releases its handle once NIXL reports it terminal). Close joins the thread after the
  endpoint drained its work.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..errors import EndpointClosedError
from .base import ended_event

if TYPE_CHECKING:
    from .nixl_agent import NixlAgent


class Target(Protocol):
    """A connected peer, as the bulk thread sees it (the transport's peer record)."""

    rank: int
    #: set on the loop when the peer is lost (the thread stops polling its copy)
    lost: bool

#: ``NixlTransport(bulk_bytes=None)``: host WRITEs of at least this many bytes go through
#: the bulk agent where the process may run on :data:`BULK_MIN_CPUS` CPUs or more
BULK_BYTES = 1 << 20
BULK_MIN_CPUS = 8
#: the thread's pause between polls of a copy still in flight (a sleep releases the GIL)
POLL_S = 50e-6


def _cpus() -> int:
    """CPUs this process may run on (its affinity), 2 where that cannot be known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 2


def default_bulk_bytes() -> int:
    """``NixlTransport(bulk_bytes=None)``'s value here: :data:`BULK_BYTES` where this
    process may run on :data:`BULK_MIN_CPUS` CPUs or more, else 0 (off)."""
    return BULK_BYTES if _cpus() >= BULK_MIN_CPUS else 0


class _Bulk:
    """A WRITE handed to the bulk thread: its future and, once waited for, the event the
    thread's end sets."""

    __slots__ = ("peer", "handle", "nbytes", "future", "ended")

    def __init__(self, peer: Target, handle: Any, nbytes: int,
                 future: concurrent.futures.Future[str]) -> None:
        self.peer, self.handle, self.nbytes, self.future = peer, handle, nbytes, future
        self.ended: anyio.Event | None = None


class BulkLane:
    """The bulk agent and its thread (started on first use, joined by :meth:`close`)."""

    def __init__(self, min_bytes: int) -> None:
        #: host WRITEs of at least this many bytes come here (0: none)
        self.min_bytes = min_bytes
        self.agent: NixlAgent | None = None
        self.name = ""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        #: WRITEs posted through the bulk agent so far
        self.posts = 0

    def bind(self, agent: NixlAgent, name: str) -> None:
        self.agent, self.name = agent, name

    def wants(self, nbytes: int, mem: str, peer_mem: str) -> bool:
        """Whether a WRITE of ``nbytes`` from ``mem`` to the peer's ``peer_mem`` comes here."""
        return (self.agent is not None and nbytes >= self.min_bytes > 0
                and mem == peer_mem == "DRAM" and not self._closed)

    def submit(self, peer: Target, handle: Any, nbytes: int, notify: bytes,
               deadline: float) -> _Bulk:
        """Hand a WRITE through ``handle`` (a bulk agent's) to the thread: it posts it and
        polls it until it is terminal, its peer is lost, or ``deadline`` (monotonic)."""
        if self._closed or self.agent is None:
            raise EndpointClosedError("the NIXL transport's bulk thread is closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xavier-bulk")
        self.posts += 1
        return _Bulk(peer, handle, nbytes,
                     self._pool.submit(_post_and_poll, self.agent, handle, notify, deadline, peer))

    async def ended(self, w: _Bulk) -> str:
        """Wait until the thread's job for ``w`` has ended; NIXL's state then (``PROC``:
        still posted, given up on). Re-entrant: a caller cancelled meanwhile may wait
        again (the copy goes on). Raises what the post raised."""
        if not w.future.done():
            if w.ended is None:
                w.ended = ended_event(w.future)
            await w.ended.wait()
        return w.future.result()

    def close(self) -> None:
        """Join the thread (after the endpoint drained its work; a job still running ends
        by its deadline or its peer's loss); idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _post_and_poll(agent: NixlAgent, h: Any, notify: bytes, deadline: float, peer: Target) -> str:
    """The bulk thread's job: post, then poll to a terminal state (or give up: ``PROC``)."""
    state = agent.transfer(h, notify)
    while state == "PROC":
        if peer.lost or time.monotonic() > deadline:
            return state
        time.sleep(POLL_S)
        state = agent.check_xfer_state(h)
    return state

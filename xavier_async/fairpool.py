"""The fair pool: things named by an index (slabs, lanes) lent to one borrower at a time.

Borrowers that find none free wait in line (FIFO), through a :class:`Ticket` taken
synchronously, so they are served in the order they asked; a cancelled borrower takes
nothing. *Large* borrowers hold at most :func:`large_cap` of the pool at once, so a small
one never waits behind large ones (the head-of-line rule). The endpoint lends its send
slabs, its receive slabs and its small round-trip lanes through it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import anyio

from .errors import InternalError


def large_cap(slabs: int) -> int:
    """How many slabs of a pool of ``slabs`` large batches may hold at once: all but one,
    so that a small batch never waits behind large ones (one slab: no reservation)."""
    return slabs - 1 if slabs > 1 else 1


class Ticket:
    """One borrower's place in a :class:`FairPool`: granted at once, or queued (FIFO).
    :meth:`take` returns the slab's index; :meth:`cancel` gives back what it got, or
    leaves the queue, so a cancelled borrower takes nothing."""

    __slots__ = ("pool", "large", "want", "index", "error", "_event", "_done")

    def __init__(self, pool: FairPool, large: bool, want: int | None) -> None:
        self.pool, self.large, self.want = pool, large, want
        self.index: int | None = None
        #: why a queued ticket will never be granted (:meth:`FairPool.fail_waiters`)
        self.error: Exception | None = None
        self._event: anyio.Event | None = None
        self._done = False

    @property
    def granted(self) -> bool:
        return self.index is not None

    def _grant(self, index: int) -> None:
        self.index = index
        if self._event is not None:
            self._event.set()

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        if self._event is not None:
            self._event.set()

    async def take(self) -> int:
        """The granted slab's index, once granted (no timeout: back-pressure is a wait);
        from then on the borrower owns it and :meth:`cancel` no longer gives it back. If
        the wait is cancelled (or fails), the ticket is cancelled: it takes nothing. A
        ticket the pool gave up on (:meth:`FairPool.fail_waiters`) raises its error."""
        try:
            if self.index is None and self.error is None:
                self._event = anyio.Event()
                await self._event.wait()
            else:
                await anyio.lowlevel.checkpoint()
            if self._done:  # cancelled by another task while this one was waking up: the
                await anyio.lowlevel.checkpoint()  # slab went back; that cancellation lands here
                raise InternalError("a slab ticket was cancelled while its borrower took it")
        except BaseException:
            self.cancel()
            raise
        if self.index is None:
            self._done = True
            raise self.error or InternalError("a slab ticket woke without a slab or an error")
        self._done = True
        return self.index

    def claim(self) -> int:
        """A ticket granted at once (by :meth:`FairPool.enqueue`) taken without awaiting:
        the borrower owns the slab from now on, as after :meth:`take`."""
        if self.index is None or self._done:
            raise RuntimeError("only a granted ticket that was not taken can be claimed")
        self._done = True
        return self.index

    def cancel(self) -> None:
        """Leave the queue, or give the slab back if it was granted (idempotent; nothing
        once :meth:`take` has returned)."""
        if self._done:
            return
        self._done = True
        if self.index is None:
            self.pool._leave(self)
        else:
            self.pool.release(self.index)


class FairPool:
    """Things named by index (slabs of one direction, small round-trip lanes) lent to one
    borrower at a time.

    Free slabs are lent last-released first (the warm one; sequential traffic keeps using
    one slab, so its mappings are the only ones made). Borrowers that find none free wait
    in FIFO order; a borrower may ask for one slab by index (``want``).

    No head-of-line blocking: *large* borrowers (a batch bigger than the small view) hold
    at most :func:`large_cap` slabs at once, so with two or more slabs one is always left
    for small batches, which then never wait behind a whole large copy. A large waiter
    held back by the cap does not hold back the small waiters behind it. The cap follows
    the slabs actually in the pool (:attr:`cap`): when fences take slabs out, it is
    evaluated again and the waiters are woken (:meth:`remove`).
    """

    def __init__(self, indices: Iterable[int], target: int | None = None) -> None:
        self._free: list[int] = sorted(indices, reverse=True)  # pop() lends the lowest first
        #: held slab -> whether a large borrower holds it
        self._held: dict[int, bool] = {}
        self._large = 0
        #: the pool's nominal size (the cap on large borrowers derives from it)
        self.target = target if target is not None else len(self._free)
        self._waiters: deque[Ticket] = deque()

    @property
    def cap(self) -> int:
        """How many slabs large borrowers may hold now: all but one of the slabs in the
        pool (its nominal size while none is fenced, fewer after fences)."""
        return large_cap(min(self.target, self.usable))

    @property
    def usable(self) -> int:
        """Slabs in the pool: free or lent."""
        return len(self._free) + len(self._held)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def indices(self) -> set[int]:
        """The slabs in the pool, free or lent."""
        return {*self._free, *self._held}

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def large_held(self) -> int:
        return self._large

    def peek(self) -> int | None:
        """The slab the next small borrower would get (``None``: none is free)."""
        return self._free[-1] if self._free else None

    def _pick(self, large: bool, want: int | None) -> int | None:
        if want is not None:
            return want if want in self._free else None
        if not self._free or (large and self._large >= self.cap):
            return None
        return self._free[-1]

    def _take(self, index: int, large: bool) -> None:
        self._free.remove(index)
        self._held[index] = large
        self._large += large

    def try_acquire(self, large: bool, want: int | None = None) -> int | None:
        """A slab now, or ``None`` (never ahead of a waiter that could take it)."""
        index = self._pick(large, want)
        if index is not None:
            self._take(index, large)
        return index

    def enqueue(self, large: bool, want: int | None = None) -> Ticket:
        """A place in line, taken synchronously (so borrowers are served in the order they
        called this): granted at once when a slab is free for it."""
        ticket = Ticket(self, large, want)
        index = self.try_acquire(large, want)
        if index is not None:
            ticket._grant(index)
        else:
            self._waiters.append(ticket)
        return ticket

    async def acquire(self, large: bool, want: int | None = None) -> int:
        """Wait for a slab (FIFO); a cancellation while waiting takes nothing."""
        return await self.enqueue(large, want).take()

    def _leave(self, ticket: Ticket) -> None:
        try:
            self._waiters.remove(ticket)
        except ValueError:
            pass

    def _grant_waiters(self) -> None:
        for ticket in list(self._waiters):
            if not self._free:
                break
            index = self._pick(ticket.large, ticket.want)
            if index is not None:
                self._waiters.remove(ticket)
                self._take(index, ticket.large)
                ticket._grant(index)

    def release(self, index: int) -> None:
        """A lent slab comes back (its copy is terminal and its bytes were used)."""
        self._large -= self._held.pop(index)
        self._free.append(index)
        self._grant_waiters()

    def remove(self, index: int) -> None:
        """A lent slab leaves the pool (fenced) instead of coming back. Fewer large
        borrowers now hold slabs and the cap follows the smaller pool: a waiter that may
        take a free slab now gets it (a large one held back by the cap among them)."""
        if index not in self._held:
            raise InternalError(f"slab {index} left the pool but was not lent")
        self._large -= self._held.pop(index)
        self._grant_waiters()

    def add(self, index: int) -> None:
        """A slab joins the pool (new, or released from a fence)."""
        if index in self._held or index in self._free:
            raise InternalError(f"slab {index} joined a pool it is already in")
        self._free.append(index)
        self._grant_waiters()

    def fail_waiters(self, exc: Exception) -> int:
        """Every queued borrower's :meth:`Ticket.take` raises ``exc`` (no slab can come
        back for them); returns how many there were."""
        waiters, self._waiters = self._waiters, deque()
        for ticket in waiters:
            ticket._fail(exc)
        return len(waiters)

    def check(self) -> None:
        """Raise :class:`InternalError` if the bookkeeping is inconsistent: a slab both
        free and lent, counted twice, or a large count that does not match."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._held.keys():
            raise InternalError(f"slab pool: free {self._free} and lent {sorted(self._held)} overlap")
        if self._large != sum(self._held.values()):
            raise InternalError(f"slab pool: {self._large} large borrowers counted, "
                                f"{sum(self._held.values())} hold slabs")
        if self._free and any(self._pick(t.large, t.want) is not None for t in self._waiters):
            raise InternalError("slab pool: a waiter could take a free slab but was not woken")


__all__ = ["FairPool", "Ticket", "large_cap"]

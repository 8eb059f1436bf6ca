"""Persistent slabs: one allocation per direction, a full view and a small prefix view.

Both views share the allocation and keep their identity for the endpoint's lifetime, so a
transport that keys registrations on buffer identity registers each exactly once.

An endpoint owns a pool of each: ``send_slabs`` send slabs and ``receive_slabs`` receive
slabs (:class:`SlabPool`), all registered once at start; every copy borrows one of each.
:class:`RecvSlabs` *fences* a receive slab that a lost or timed-out source might still
write (a one-sided write cannot be revoked by its target): it leaves the pool, loads carry
on in the others (a replacement is registered only if the fences leave fewer than the
pool's size and a load needs one), and it is released only when its stale writer is
provably done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
import torch

from .errors import InternalError, InvalidRequestError
from .sizes import DEFAULT_FULL_BYTES, DEFAULT_SMALL_BYTES, FULL, SMALL, KiB, MiB, SlabSizes, View

__all__ = ["DEFAULT_FULL_BYTES", "DEFAULT_SMALL_BYTES", "KiB", "MiB", "Slab", "SlabView",
           "allocate_slabs", "allocate_slab", "slab_sizes", "SlabPool", "Ticket", "large_cap",
           "RecvSlabs", "Fenced", "payload_digest"]


@dataclass(eq=False)
class SlabView:
    """A persistent prefix of a :class:`Slab` (``name`` is ``"full"`` or ``"small"``)."""

    slab: Slab
    name: View
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def __repr__(self) -> str:
        return f"SlabView({self.slab.direction}/{self.name}, {self.nbytes} B)"


@dataclass(eq=False)
class Slab:
    """One pre-allocated byte buffer (``direction`` is ``"send"`` or ``"recv"``)."""

    direction: str
    tensor: torch.Tensor
    small_bytes: int
    #: slabs are numbered within their pool (a load names the receive slab it is written
    #: into, a mapping the send slab it reads); 0 is the first
    index: int = 0
    full: SlabView = field(init=False)
    small: SlabView = field(init=False)

    def __post_init__(self) -> None:
        self.full = SlabView(self, FULL, self.tensor)
        # equal sizes: one view (the small view *is* the full one, mapped once)
        self.small = (SlabView(self, SMALL, self.tensor[: self.small_bytes])
                      if self.small_bytes < self.tensor.numel() else self.full)

    def __getitem__(self, view: View) -> SlabView:
        """A view by name (``"full"`` or ``"small"``)."""
        if view == FULL:
            return self.full
        if view == SMALL:
            return self.small
        raise InvalidRequestError(f"unknown view {view!r}: views are 'full' and 'small'")

    @property
    def views(self) -> tuple[SlabView, SlabView]:
        return (self.full, self.small)

    def view(self, nbytes: int) -> SlabView:
        """The view of exactly ``nbytes`` bytes; anything else is an error."""
        for v in self.views:
            if v.nbytes == nbytes:
                return v
        raise InvalidRequestError(
            f"unknown view size {nbytes} B: this slab has views of "
            f"{self.full.nbytes} B (full) and {self.small.nbytes} B (small)")

    @property
    def device(self) -> torch.device:
        return self.tensor.device


def slab_sizes(full_bytes: int | None, small_bytes: int | None) -> tuple[int, int]:
    """Validated ``(full, small)``; small defaults to ``min(full, 256 KiB)`` (see :class:`SlabSizes`)."""
    sizes = SlabSizes.of(full_bytes, small_bytes)
    return sizes.full, sizes.small


def allocate_slabs(full_bytes: int, small_bytes: int, device: torch.device) -> tuple[Slab, Slab]:
    """One send and one receive slab (the pool's first ones)."""
    send, recv = (allocate_slab(direction, full_bytes, small_bytes, device)
                  for direction in ("send", "recv"))
    return send, recv


def allocate_slab(direction: str, full_bytes: int, small_bytes: int, device: torch.device,
                  index: int = 0) -> Slab:
    """One slab of ``direction`` (``"send"`` or ``"recv"``), numbered ``index``."""
    return Slab(direction, torch.zeros(full_bytes, dtype=torch.uint8, device=device), small_bytes, index)


def large_cap(slabs: int) -> int:
    """How many slabs of a pool of ``slabs`` large batches may hold at once: all but one,
    so that a small batch never waits behind large ones (one slab: no reservation)."""
    return slabs - 1 if slabs > 1 else 1


class Ticket:
    """One borrower's place in a :class:`SlabPool`: granted at once, or queued (FIFO).
    :meth:`take` returns the slab's index; :meth:`cancel` gives back what it got, or
    leaves the queue, so a cancelled borrower takes nothing."""

    __slots__ = ("pool", "large", "want", "index", "error", "_event", "_done")

    def __init__(self, pool: SlabPool, large: bool, want: int | None) -> None:
        self.pool, self.large, self.want = pool, large, want
        self.index: int | None = None
        #: why a queued ticket will never be granted (:meth:`SlabPool.fail_waiters`)
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
        ticket the pool gave up on (:meth:`SlabPool.fail_waiters`) raises its error."""
        try:
            if self.index is None and self.error is None:
                self._event = anyio.Event()
                await self._event.wait()
            else:
                await anyio.lowlevel.checkpoint()
        except BaseException:
            self.cancel()
            raise
        if self.index is None:
            self._done = True
            raise self.error or InternalError("a slab ticket woke without a slab or an error")
        self._done = True
        return self.index

    def claim(self) -> int:
        """A ticket granted at once (by :meth:`SlabPool.enqueue`) taken without awaiting:
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


class SlabPool:
    """Slabs of one direction lent to one borrower at a time, by index.

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


@dataclass(frozen=True, slots=True)
class Fenced:
    """A receive slab that ``peer`` (endpoint instance ``incarnation``) may still write,
    for request ``req_id``."""

    slab: int
    peer: int
    incarnation: str
    req_id: int


#: what the receiver keeps beside each receive slab (its unpack table: SlabRows)
R = TypeVar("R")


class RecvSlabs(Generic[R]):
    """The receiver's receive slabs: a :class:`SlabPool` of ``K`` usable ones (each load
    borrows one), *spares* (registered, released from a fence while the pool was full)
    and *fenced* ones, which leave the pool (pure bookkeeping; the endpoint registers new
    slabs with its transport).

    Each slab is named by an index that is never reused: :meth:`new_index` hands the next
    one out synchronously, before the registration that follows awaits anything, so two
    replacements registered at once can never share one. Beside each slab the receiver
    keeps its unpack table (``rows``, made by ``rows_of`` when the slab joins): a slab is
    in :attr:`slabs` exactly when its table is in :attr:`rows`, and the endpoint adds it
    only once the transport has registered it.

    Invariant: a fenced slab is never in the pool and never a spare, so no load reads a
    slab that a stale writer may still target (:meth:`check`)."""

    def __init__(self, slabs: Sequence[Slab], rows_of: Callable[[Slab], R]) -> None:
        self._rows_of = rows_of
        self.slabs: dict[int, Slab] = {}
        self.rows: dict[int, R] = {}
        for slab in slabs:
            self._keep(slab)
        self._next_index = max(self.slabs, default=-1) + 1
        self.pool = SlabPool(self.slabs)
        self.spares: list[int] = []
        self.fenced: dict[int, Fenced] = {}
        #: registrations under way (replacements of fenced slabs)
        self.registering = 0
        #: how many slabs were fenced, released by a late reply, released by a reconnect
        self.fences = self.released_late = self.released_reconnect = 0

    def _keep(self, slab: Slab) -> None:
        if slab.index in self.slabs:
            raise InternalError(f"two receive slabs are numbered {slab.index}")
        self.slabs[slab.index] = slab
        self.rows[slab.index] = self._rows_of(slab)

    @property
    def target(self) -> int:
        return self.pool.target

    @property
    def current(self) -> Slab | None:
        """The slab the next load would be written into (``None``: none is free)."""
        index = self.pool.peek()
        return None if index is None else self.slabs[index]

    def new_index(self) -> int:
        """The index of the next receive slab, taken now (never handed out twice, even
        if the slab it was taken for is never registered)."""
        index = self._next_index
        self._next_index += 1
        return index

    def short(self) -> bool:
        """Fences left fewer than ``K`` usable slabs (counting those being registered)
        and none is free: a replacement should be registered."""
        return (not self.pool.free and not self.spares
                and self.pool.usable + self.registering < self.target)

    def fence(self, index: int, peer: int, incarnation: str, req_id: int) -> None:
        """Fence lent slab ``index`` (``peer`` may still write it for ``req_id``): it
        leaves the pool; a spare takes its place if there is one."""
        self.pool.remove(index)
        self.fenced[index] = Fenced(index, peer, incarnation, req_id)
        self.fences += 1
        self._refill()

    def _refill(self) -> None:
        while self.spares and self.pool.usable < self.target:
            self.pool.add(self.spares.pop())

    def add(self, slab: Slab) -> None:
        """A newly registered slab (numbered by :meth:`new_index`) joins the pool, with
        its unpack table."""
        if slab.index >= self._next_index:
            raise InternalError(f"receive slab {slab.index} was not numbered by new_index()")
        self._keep(slab)
        self._put(slab.index)

    def _put(self, index: int) -> None:
        if self.pool.usable < self.target:
            self.pool.add(index)
        else:
            self.spares.append(index)

    def _release(self, index: int) -> None:
        del self.fenced[index]
        self._put(index)

    def release_reply(self, peer: int, req_id: int) -> bool:
        """The stale writer's reply for ``req_id`` arrived: its write is terminal."""
        for f in list(self.fenced.values()):
            if f.peer == peer and f.req_id == req_id:
                self._release(f.slab)
                self.released_late += 1
                return True
        return False

    def release_peer(self, peer: int, incarnation: str) -> int:
        """The same endpoint instance reconnected and vouches that none of its writes to
        us can still land: every slab fenced for it is released."""
        n = 0
        for f in list(self.fenced.values()):
            if f.peer == peer and f.incarnation == incarnation and incarnation:
                self._release(f.slab)
                n += 1
        self.released_reconnect += n
        return n

    def check(self) -> None:
        """Raise :class:`InternalError` unless the bookkeeping holds: every slab is in
        exactly one of pool, spares and fenced, has its unpack table, and the pool's own
        accounting is consistent (:meth:`SlabPool.check`)."""
        self.pool.check()
        in_pool = self.pool.indices
        places = [in_pool, set(self.spares), set(self.fenced)]
        seen: set[int] = set()
        for place in places:
            if place & seen:
                raise InternalError(f"receive slab(s) {sorted(place & seen)} are in two places "
                                    f"(pool {sorted(in_pool)}, spares {self.spares}, "
                                    f"fenced {sorted(self.fenced)})")
            seen |= place
        if len(self.spares) != len(set(self.spares)):
            raise InternalError(f"a spare receive slab is listed twice: {self.spares}")
        if seen != set(self.slabs) or set(self.rows) != set(self.slabs):
            raise InternalError(f"receive slabs {sorted(self.slabs)}, unpack tables "
                                f"{sorted(self.rows)}, placed {sorted(seen)}: they must agree")
        if self.pool.usable > self.target:
            raise InternalError(f"{self.pool.usable} receive slabs in a pool of {self.target}")

    def stats(self) -> dict[str, int]:
        return {"registered": len(self.slabs), "pool": self.target, "usable": self.pool.usable,
                "in_use": self.pool.held, "waiting": self.pool.waiting,
                "fenced_now": len(self.fenced), "spares": len(self.spares), "fences": self.fences,
                "released_late": self.released_late, "released_reconnect": self.released_reconnect}


def payload_digest(buf: torch.Tensor, nbytes: int) -> str:
    """A cheap digest of the first ``nbytes`` bytes of a uint8 tensor, computed where the
    tensor lives (on the GPU for VRAM: no host copy of the payload; one small result is
    read back). Two wrapping int64 sums over 8-byte words, one plain and one weighted by
    position (through a prefix sum), plus the tail bytes: it catches garbage, zeroed,
    stale, shifted and reordered payloads, not an adversary."""
    words = nbytes // 8
    parts = []
    if words:
        w = buf[: words * 8].view(torch.int64)
        parts += [w.sum(), w.cumsum(0).sum()]
    if nbytes % 8:
        tail = buf[words * 8: nbytes].to(torch.int64)
        parts.append((tail * torch.arange(1, tail.numel() + 1, device=buf.device)).sum())
    values = torch.stack(parts).tolist() if parts else []
    return f"{nbytes}:" + ",".join(format(v & 0xFFFFFFFFFFFFFFFF, "x") for v in values)

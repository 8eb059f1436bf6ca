"""The receiver's receive slabs: the pool each load borrows one from, spares, and fenced
slabs that a stale writer may still target (pure bookkeeping: the receiver registers new
slabs with its transport).

A receive slab is a one-sided WRITE's target, which its receiver cannot revoke: a slab a
lost or timed-out source might still write is *fenced*. It leaves the pool, loads carry
on in the others (a replacement is registered only if the fences leave fewer than the
pool's size and a load needs one), and it is released only when its stale writer is
provably done (its late reply, or its reconnection vouching for it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import InternalError
from .fairpool import FairPool
from .slabs import Slab


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
    """The receiver's receive slabs: a :class:`FairPool` of ``K`` usable ones (each load
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
        self.pool = FairPool(self.slabs)
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

    def lease(self, index: int) -> Lease:
        """The lease of slab ``index``, just taken from the pool (a ticket's grant)."""
        return Lease(self, self.slabs[index])

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
        accounting is consistent (:meth:`FairPool.check`)."""
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


class Lease:
    """One receive slab lent to one round trip, ended exactly once: given back
    (:meth:`release`, the copy is terminal and its bytes were used or dropped) or fenced
    (:meth:`fence`, a stale writer may still target it: it stays out of the pool)."""

    __slots__ = ("_slabs", "slab", "fenced", "_ended")

    def __init__(self, slabs: RecvSlabs[Any], slab: Slab) -> None:
        self._slabs, self.slab = slabs, slab
        #: the slab was fenced instead of given back
        self.fenced = False
        self._ended = False

    @property
    def index(self) -> int:
        return self.slab.index

    def fence(self, peer: int, incarnation: str, req_id: int) -> None:
        """``peer`` may still write the slab for ``req_id``: it leaves the pool."""
        if self._ended:
            raise InternalError(f"receive slab {self.slab.index} fenced after its lease ended")
        self._ended = self.fenced = True
        self._slabs.fence(self.slab.index, peer, incarnation, req_id)

    def release(self) -> None:
        """Give the slab back to the pool (a no-op once fenced or released)."""
        if not self._ended:
            self._ended = True
            self._slabs.pool.release(self.slab.index)


__all__ = ["RecvSlabs", "Fenced", "Lease"]

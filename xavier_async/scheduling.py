"""How the receiver's batches reach a receive slab: directly, merged into a group, or
through a small round-trip lane (:class:`BatchScheduler`).

A batch that finds a receive slab free takes it and makes its own round trip. With
``EndpointConfig.merge_loads``, a batch that would wait for one joins its source's
*forming group* instead (small and large batches form separate groups): one background
task waits for the group's slab and carries every member in one request, one copy and one
unpack (the layout rule is :class:`~xavier_async.merging.LoadGroup`'s). With
``EndpointConfig.small_round_trips`` a small batch also joins the forming group while its
source already has that many small round trips (*lanes*) in flight.

A member cancelled before its group starts leaves it and takes nothing; after, its copy
is waited for (shielded) and it is not unpacked. A merged request the source refuses (an
unpublished key) is asked again batch by batch, so only the loads naming missing keys fail.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import anyio

from .config import EndpointConfig
from .errors import EndpointClosedError, InternalError, RemoteError, XavierError
from .fairpool import FairPool, Ticket
from .merging import LoadGroup, Member, MergedBatch, Moved
from .metrics import EndpointMetrics
from .planning import PlannedBatch
from .recvslabs import Lease, RecvSlabs

log = logging.getLogger("xavier_async")


class RoundTrips(Protocol):
    """What the scheduler asks of the receiver."""

    @property
    def slabs(self) -> RecvSlabs[Any]: ...

    async def take(self, ticket: Ticket) -> Lease:
        """The ticket's receive slab, once granted (registering a replacement first if
        fences left the pool short); a failure or cancellation takes nothing."""

    async def round_trip(self, src: int, batch: PlannedBatch | MergedBatch, lease: Lease) -> Moved:
        """Request ``batch`` from ``src`` into the leased slab, wait, verify, unpack;
        what moved. Fences the lease if a late write may still land."""


class GroupRun(LoadGroup):
    """A forming group and its round trip's state: its place in the receive-slab line
    (``ticket``), in its source's lanes (``lane``), ``done`` once every member has its
    outcome, and the ``scope`` its task waits in."""

    __slots__ = ("ticket", "lane", "done", "scope")

    def __init__(self, src: int, large: bool, limit: int, ticket: Ticket | None,
                 lane: Ticket | None) -> None:
        super().__init__(src, large, limit)
        self.ticket, self.lane = ticket, lane
        self.done = anyio.Event()
        self.scope: anyio.CancelScope | None = None


class BatchScheduler:
    """Direct, grouped and laned scheduling of one receiver's batches."""

    def __init__(self, trips: RoundTrips, config: EndpointConfig, metrics: EndpointMetrics,
                 spawn: Callable[..., None], rank: int) -> None:
        self._trips = trips
        self._config = config
        self._metrics = metrics
        self._spawn = spawn
        self._rank = rank
        #: a batch whose payload exceeds this is "large" (the head-of-line rule)
        self._small = config.sizes.small
        #: the largest group of small batches (``merge_small_bytes`` is an int once the
        #: config is made; ``or`` only narrows its declared ``int | None``)
        self._merge_small = config.merge_small_bytes or self._small
        #: per (source, large): the group of batches waiting for a receive slab that later
        #: batches from that source join
        self.forming: dict[tuple[int, bool], GroupRun] = {}
        #: per source: its small round trips in flight, as lanes lent like slabs
        #: (``small_round_trips``; empty without a cap)
        self.lanes: dict[int, FairPool] = {}

    async def load(self, src: int, batch: PlannedBatch) -> Moved:
        """One batch's way to a receive slab and its round trip; what moved for it (a
        merged member: its share). The head-of-line rule: a batch larger than the small view is "large"."""
        pool = self._trips.slabs.pool
        large = batch.nbytes > self._small
        if not self._config.merge_loads:
            lease = await self._trips.take(pool.enqueue(large))
            try:
                return await self._trips.round_trip(src, batch, lease)
            finally:
                lease.release()
        group = self.forming.get((src, large))
        if group is not None and group.fits(batch):
            return await self._in_group(group, group.add(batch))
        lane = None
        if not large and self._config.small_round_trips is not None:
            lane = self._lanes_of(src).enqueue(False)
        # every small round trip to src is busy, or every slab is: wait as a group
        ticket = pool.enqueue(large) if lane is None or lane.granted else None
        if ticket is None or not ticket.granted:
            group = GroupRun(src, large, self._config.sizes.full if large else self._merge_small,
                             ticket, lane)
            self.forming[(src, large)] = group
            member = group.add(batch)
            self._spawn(self._run_group, group)
            return await self._in_group(group, member)
        try:
            lease = await self._trips.take(ticket)
        except BaseException:
            if lane is not None:
                lane.cancel()  # nothing was requested: the lane is free again
            raise
        try:
            return await self._trips.round_trip(src, batch, lease)
        finally:
            lease.release()  # (a no-op if it was fenced: it stays out of the pool)
            if lane is not None:
                lane.pool.release(lane.claim())  # the round trip is over

    def _lanes_of(self, src: int) -> FairPool:
        """``src``'s small round-trip lanes (``EndpointConfig.small_round_trips``)."""
        lanes = self.lanes.get(src)
        if lanes is None:
            lanes = self.lanes[src] = FairPool(range(self._config.small_round_trips or 1))
        return lanes

    async def _in_group(self, group: GroupRun, member: Member) -> Moved:
        """Wait for ``member``'s group. Cancelled before the group starts, the member
        leaves it and takes nothing; after, its copy is waited for (shielded), it is not
        unpacked, and the cancellation is re-raised."""
        try:
            await group.done.wait()
        except BaseException:
            if not group.started:
                group.remove(member)
                if not group.members:  # nobody left: the group leaves the queues
                    self._close(group)
                    for ticket in (group.ticket, group.lane):
                        if ticket is not None:
                            ticket.cancel()
                    if group.scope is not None:
                        group.scope.cancel()
                raise
            member.cancelled = True
            with anyio.CancelScope(shield=True):
                await group.done.wait()
            raise
        if member.error is not None:
            raise member.error
        return member.moved

    def _close(self, group: GroupRun) -> None:
        """No batch joins ``group`` any more."""
        key = (group.src, group.large)
        if self.forming.get(key) is group:
            del self.forming[key]

    async def _run_group(self, group: GroupRun) -> None:
        """A group's round trip (a background task): wait for its slab, then load every
        member as one batch; each member gets its share or its own copy of the error."""
        lease: Lease | None = None
        lane: int | None = None
        src = group.src
        try:
            if group.members:  # (the last member to leave cancels the tickets and this scope)
                with anyio.CancelScope() as group.scope:
                    if group.lane is not None:  # first a small round trip to src, then a slab
                        lane = await group.lane.take()
                        if group.ticket is None:
                            group.ticket = self._trips.slabs.pool.enqueue(False)
                    if group.ticket is None:
                        raise InternalError("a group without a lane has no slab ticket")
                    try:
                        lease = await self._trips.take(group.ticket)
                    except XavierError as exc:  # a replacement slab could not be registered
                        group.fail(exc)
                        return
            group.started = True
            self._close(group)
            if lease is None or not group.members:
                # every member left before the slab came: the last one cancelled the
                # ticket, which gave back whatever it was granted
                return
            try:
                await self._carry(group, lease)
            finally:
                lease.release()
        except Exception as exc:  # a broken invariant: the members fail with a typed error
            group.fail(InternalError(f"a merged load from rank {src} failed: {exc!r}"))
            raise  # (logged by the task guard)
        finally:
            self._close(group)
            group.started = True
            if lane is not None and group.lane is not None:  # the round trip is over
                group.lane.pool.release(lane)
            elif group.lane is not None:
                group.lane.cancel()
            if group.ticket is not None and lease is None:
                # a shutdown while the group waited for its lane leaves its slab ticket
                # queued: give back a slab granted to nobody (idempotent otherwise)
                group.ticket.cancel()
            # whatever stopped this task (the endpoint's shutdown), no member waits forever
            group.fail(EndpointClosedError("the endpoint closed while this load waited"))
            group.done.set()

    async def _carry(self, group: GroupRun, lease: Lease) -> None:
        """The group's one round trip; a merged request the source refuses is asked again
        batch by batch (nothing moved)."""
        src = group.src
        try:
            try:
                group.share(await self._trips.round_trip(src, group.merged(), lease))
                self._metrics.peer(src).batches_merged += len(group.members) - 1
            except RemoteError as exc:
                if type(exc) is not RemoteError or len(group.members) == 1 or lease.fenced:
                    raise
                await self._load_each(group, lease)
        except XavierError as exc:
            group.fail(exc)
        except Exception as exc:  # a broken invariant: logged, the members fail typed
            log.exception("rank %d: a merged load from rank %d failed", self._rank, src)
            group.fail(InternalError(f"loading from rank {src} failed: {exc!r}"))

    async def _load_each(self, group: GroupRun, lease: Lease) -> None:
        """Load a refused group's members one by one into its slab: only the members
        naming unpublished keys fail."""
        for m in group.members:
            if m.cancelled:
                continue
            m.base = 0
            try:
                m.land(await self._trips.round_trip(
                    group.src, MergedBatch(group.src, [m], m.batch.nbytes), lease))
            except XavierError as exc:
                m.fail(exc)
                if lease.fenced:  # the rest cannot use this slab
                    group.fail(exc)
                    return

    def stats(self) -> dict[str, int]:
        """Groups forming now, and small round trips held and waited for (all sources)."""
        return {"groups_forming": len(self.forming),
                "lanes_held": sum(p.held for p in self.lanes.values()),
                "lanes_waiting": sum(p.waiting for p in self.lanes.values())}

__all__ = ["BatchScheduler", "GroupRun", "RoundTrips"]

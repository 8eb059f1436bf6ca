"""The receiver role: loading blocks from peers into the local caches.

A load is validated and planned into batches (nothing moves before every check passed);
several batches are probed first, so a refusal comes before any byte moves. Each batch
reaches a receive slab through the :class:`~xavier_async.scheduling.BatchScheduler` and
makes one *round trip* (:meth:`Receiver.round_trip`)::

    receiver                                   source
    [lease receive slab r]
    Load(req, keys, r)  --------------------->  pack, WRITE into r
    <-------------------------------- Landed(r)  (the slab its mapping wrote)
    verify (opt in), unpack r into the slots, give r back

From the request on the copy is *started*: it is waited for (shielded) until the source
reports a terminal state, even if the caller is cancelled. A source that does not answer
within ``request_timeout`` is declared lost and the slab is *fenced* (it may still be
written late); a late reply from it releases the fence. A small batch that is the
endpoint's only work polls for its reply itself for up to ``EndpointConfig.reply_spin``
(over a transport that ``polls_inline``), after one pass through the event loop that
holds any cancellation; a later reply is waited for as above. The receiver owns the
request table and the receive slabs (registering replacements of fenced ones).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import anyio
import torch

from .config import LoadResult
from .errors import (EndpointClosedError, IntegrityError, InternalError, InvalidRequestError,
                     PeerLostError, RegistrationError, XavierError)
from .fairpool import Ticket
from .layout import BlockKey, LayerId
from .merging import MergedBatch, Moved
from .packing import RunTable, SlabRows, unpack, unpack_runs
from .peers import PeerTable
from .planning import LoadRequest, PlannedBatch, Planner
from .protocol import Error, Landed, PendingRequest, Probe, RequestTable, load_wire
from .recvslabs import Lease, RecvSlabs
from .runtime import Runtime
from .scheduling import BatchScheduler
from .shielded import Landing, landing, landing_factory
from .slabs import Slab, allocate_slab, payload_digest

log = logging.getLogger("xavier_async")

#: how long a receiver spins on a CUDA unpack's event before polling it from the event loop
_UNPACK_SPIN_NS = 30_000

#: called when a source did not answer in time: (rank, the error), then the connection
#: to it is dropped (awaited)
OnTimeout = Callable[[int, PeerLostError], Any]


class _Tally:
    """What the batches of one load moved so far."""

    __slots__ = ("done", "blocks", "useful", "wire", "dev", "host")

    def __init__(self) -> None:
        self.done = self.blocks = self.useful = self.wire = self.dev = self.host = 0

    def add(self, batch: PlannedBatch, moved: Moved) -> None:
        self.done += 1
        self.blocks += batch.blocks
        self.useful += batch.useful_bytes
        self.wire += moved.wire_bytes
        self.dev += moved.device_blocks
        self.host += moved.host_blocks

    def result(self, batches: int) -> LoadResult:
        return LoadResult(batches, self.blocks, self.useful, self.wire, self.dev, self.host)


async def _sent() -> None:
    """The request step of a round trip whose request already went out."""


class Receiver:
    """One endpoint's loads. ``on_timeout(src, error)`` is awaited when ``src`` did not
    complete a copy within ``request_timeout`` (the endpoint marks it lost and drops it)."""

    def __init__(self, rt: Runtime, peers: PeerTable, on_timeout: OnTimeout) -> None:
        self._rt = rt
        self._peers = peers
        self._on_timeout = on_timeout
        self._config = rt.config
        self._planner = Planner(rt.caches.layout, rt.config.full_bytes)
        self.requests = RequestTable()
        self._recv: RecvSlabs[SlabRows] | None = None
        #: per receive slab, the event of its last unpack (CUDA: reused only once it has run)
        self._unpacked: dict[int, torch.cuda.Event] = {}
        self.scheduler = BatchScheduler(self, rt.config, rt.metrics, rt.spawn, rt.rank)
        #: makes a round trip's Landing (for the running backend, chosen at start)
        self._landing: Callable[[], Landing] = landing
        #: seconds a lone small round trip polls for its reply itself (reply_spin; 0
        #: where the transport cannot poll from our stack), and what counts as small
        self._spin = 0.0
        self._small = rt.config.sizes.small
        #: the last lone small round trip's reply took longer than the spin: the next
        #: one waits through the event loop (and, if its reply comes sooner, spins again)
        self._slow_replies = False

    def start(self, slabs: list[Slab]) -> None:
        """Take the receive slabs (registered by the endpoint's start; on its event loop,
        whose backend picks how a round trip waits for its reply)."""
        self._recv = RecvSlabs(slabs, self._rows_of)
        self._landing = landing_factory()
        self._spin = self._config.reply_spin if self._rt.transport.polls_inline else 0.0

    def _rows_of(self, slab: Slab) -> SlabRows:
        """A receive slab's unpack table (made once, when the slab joins)."""
        return SlabRows(slab.tensor, self._rt.caches.block_sizes)

    @property
    def slabs(self) -> RecvSlabs[SlabRows]:
        """The receive slabs (they exist from the endpoint's start on)."""
        if self._recv is None:
            raise EndpointClosedError("endpoint is not open (use `async with Endpoint(...)`)")
        return self._recv

    @property
    def started(self) -> bool:
        return self._recv is not None

    # -- a load ------------------------------------------------------------------------
    async def load(self, requests: LoadRequest | Iterable[LoadRequest]) -> LoadResult:
        """Validate, plan, probe (several batches), then every batch's round trip."""
        rt = self._rt
        t0 = perf_counter_ns()
        rt.check_open()
        if requests is None or isinstance(requests, (str, bytes)) or not isinstance(
                requests, (Mapping, Iterable)):
            raise InvalidRequestError(
                "a load request must be a mapping {source rank: {layer: {block key: slot}}} "
                f"(or a list of those), got {type(requests).__name__}")
        try:
            planned = self._planner.plan(requests)
        except TypeError as exc:  # something inside the request is not what it should be
            raise InvalidRequestError(f"malformed load request: {exc}") from exc
        return await self._run(planned, t0)

    async def load_blocks(self, src: int, keys: Sequence[BlockKey], slots: Sequence[int],
                          layers: Iterable[LayerId] | None = None) -> LoadResult:
        """``keys[i]`` from ``src`` into ``slots[i]`` of every layer (or of ``layers``):
        :meth:`load` of that request, planned without building it layer by layer."""
        t0 = perf_counter_ns()
        self._rt.check_open()
        try:
            planned = self._planner.plan_blocks(src, keys, slots, layers)
        except TypeError as exc:
            raise InvalidRequestError(f"malformed load request: {exc}") from exc
        return await self._run(planned, t0)

    async def _run(self, planned: list[PlannedBatch], t0: int) -> LoadResult:
        """Check the sources, then probe (several batches) and carry every batch."""
        rt = self._rt
        for src in ((planned[0].src,) if len(planned) == 1 else dict.fromkeys(b.src for b in planned)):
            if src == rt.rank:
                raise InvalidRequestError(f"rank {src} cannot load from itself")
            if self._peers.connected(src) is None:
                raise self._peers.not_connected(src)
        rt.stages.plan.record(perf_counter_ns() - t0)
        rt.enter_work()
        rt.metrics.loads += 1
        got = _Tally()
        try:
            if len(planned) == 1:
                batch = planned[0]
                got.add(batch, await self.scheduler.load(batch.src, batch))
            else:
                # several copies: every source confirms every key first, so that a refusal
                # comes before any byte moves (one round trip, only for multi-batch loads)
                wires: dict[int, list[Any]] = {}
                for batch in planned:
                    wires.setdefault(batch.src, []).extend(batch.wire())
                for src, items in wires.items():
                    await self._probe(src, items)
                await self._pipelined(planned, got)
        except XavierError as exc:
            if got.done:
                exc.add_note(f"{got.done} of {len(planned)} batches ({got.blocks} blocks, "
                             f"{got.useful} B) of this load were already written into their slots")
                exc.partial = got.result(got.done)  # type: ignore[attr-defined]
            raise
        finally:
            rt.leave_work()
        rt.stages.total.record(perf_counter_ns() - t0)
        return got.result(len(planned))

    async def _pipelined(self, planned: list[PlannedBatch], got: _Tally) -> None:
        """Every batch of a load at once, each through the scheduler: they take receive
        slabs in turn, so the copy of one overlaps the unpack of the one before (and, with
        several sources, their copies overlap). The first failure stops the batches not
        yet requested (they take nothing); those already requested finish and are
        unpacked (the error's partial result counts them); it is raised once every batch
        has stopped."""
        load_batch = self.scheduler.load
        failed: list[BaseException] = []
        cancelled = anyio.get_cancelled_exc_class()
        scopes = [anyio.CancelScope() for _ in planned]

        async def one(batch: PlannedBatch, scope: anyio.CancelScope) -> None:
            try:
                with scope:
                    got.add(batch, await load_batch(batch.src, batch))
            except cancelled:
                raise
            except BaseException as exc:  # the first failure is the load's
                if not failed:
                    failed.append(exc)
                for other, its_scope in zip(planned, scopes):  # those not requested yet stop
                    if not other.requested:
                        its_scope.cancel()

        # the load's own task group: its tasks end before the load returns, and each
        # catches everything but a cancellation (tests/test_architecture.py)
        async with anyio.create_task_group() as batches:
            for batch, scope in zip(planned, scopes):
                batches.start_soon(one, batch, scope)
        if failed:
            raise failed[0]

    async def _probe(self, src: int, items: list[Any]) -> None:
        """Ask ``src`` whether every key in ``items`` is published (nothing is written)."""
        replied = anyio.Event()
        req = self.requests.open(src, replied.set)
        timeout = self._config.request_timeout
        try:
            await self._rt.transport.send(src, Probe(req.req_id, items,
                                                     self._peers.epoch(src)).to_wire())
            with anyio.move_on_after(timeout):
                await replied.wait()
            if not req.done:
                raise PeerLostError(f"rank {src} did not answer within {timeout} s")
            if req.error is not None:
                self._rt.metrics.peer(src).load_errors += 1
                raise req.error
        finally:
            self.requests.close(req)

    # -- receive slabs -------------------------------------------------------------------
    async def take(self, ticket: Ticket) -> Lease:
        """Wait for ``ticket``'s slab; first, if fences have left the pool short and the
        ticket must wait, register a replacement (it joins the pool: granted to the first
        waiter). A failure or a cancellation cancels the ticket: it takes nothing."""
        recv = self.slabs
        if ticket.granted:  # the common case: a slab was free, nothing to wait for
            try:
                await anyio.lowlevel.checkpoint_if_cancelled()
            except BaseException:
                ticket.cancel()
                raise
            return recv.lease(ticket.claim())
        try:
            if recv.short():
                await self._add_slab()
        except BaseException:
            ticket.cancel()
            raise
        return recv.lease(await ticket.take())

    async def _add_slab(self) -> None:
        """Allocate and register one more receive slab (replacing a fenced one). Its
        index is taken before anything is awaited (two replacements registered at once
        never share one); it joins the pool, with its unpack table, only once the
        transport has registered it."""
        recv = self.slabs
        self._rt.check_open()
        sizes, device = self._config.sizes, self._rt.caches.layout.device
        slab = allocate_slab("recv", sizes.full, sizes.small, device, recv.new_index())
        recv.registering += 1
        try:
            with anyio.CancelScope(shield=True):  # registered and pooled, or neither
                await self._rt.transport.add_recv_slab(slab)
        except XavierError:
            raise
        except Exception as exc:
            raise RegistrationError(f"registering a replacement receive slab failed: {exc}") from exc
        finally:
            recv.registering -= 1
        recv.add(slab)
        log.info("rank %d: receive slab %d registered (replaces a fenced one)", self._rt.rank,
                 slab.index)

    def _replenish_soon(self) -> None:
        """After a fence (or when close begins): loads already waiting for a slab get a
        replacement registered for them (a load that arrives later does it itself). A
        closing endpoint registers nothing: if no slab is left in the pool to come back,
        the waiters fail with :class:`EndpointClosedError` (close would wait for them)."""
        recv = self._recv
        if recv is None or not recv.pool.waiting or not recv.short():
            return
        if self._rt.running:
            recv.registering += 1  # counted at once: one replacement per shortage
            self._rt.spawn(self._replenish)
        elif not recv.pool.usable and not recv.registering:
            n = recv.pool.fail_waiters(EndpointClosedError(
                "the endpoint is closing and every receive slab is fenced: no slab can come "
                "back for this load"))
            log.info("rank %d: closing with every receive slab fenced: %d waiting load(s) "
                     "failed", self._rt.rank, n)

    async def _replenish(self) -> None:
        """Register a replacement for the loads waiting for a slab, retried with the
        config's backoff. If it cannot be registered and no slab is left in the pool to
        come back to them, the waiters fail with :class:`RegistrationError`."""
        recv = self.slabs
        recv.registering -= 1
        delays = self._config.retry.delays()
        while True:
            try:
                await self._add_slab()
                return
            except Exception as exc:
                delay = next(delays, None)
                if delay is not None and self._rt.running and recv.pool.waiting and recv.short():
                    await anyio.sleep(delay)
                    continue
                if not recv.pool.usable and not recv.registering:
                    n = recv.pool.fail_waiters(RegistrationError(
                        f"every receive slab is fenced and a replacement could not be "
                        f"registered: {exc}"))
                    log.warning("rank %d: registering a replacement receive slab failed; %d "
                                "waiting load(s) failed", self._rt.rank, n, exc_info=True)
                else:
                    log.warning("rank %d: registering a replacement receive slab failed; waiting "
                                "loads wait for a slab to come back", self._rt.rank, exc_info=True)
                return

    def _fence(self, src: int, req: PendingRequest, lease: Lease) -> None:
        """``src`` may still write the leased slab for ``req``: it leaves the pool and is
        never loaded into again until that is impossible (:mod:`xavier_async.recvslabs`)."""
        lease.fence(src, self._peers.incarnation(src), req.req_id)
        log.warning("rank %d: receive slab %d fenced (rank %d may still write it for request %d)",
                    self._rt.rank, lease.index, src, req.req_id)
        self._replenish_soon()

    # -- one round trip ------------------------------------------------------------------
    async def round_trip(self, src: int, batch: PlannedBatch | MergedBatch, lease: Lease) -> Moved:
        """Request ``batch`` from ``src`` into the leased slab, wait (shielded) for its
        terminal state, verify, unpack; returns what moved. A timeout or an unsettled
        failure fences the lease."""
        rt = self._rt
        m = rt.metrics.peer(src)
        if self._peers.connected(src) is None:  # lost (or gone) while this batch waited
            raise self._peers.not_connected(src)
        slab = lease.slab
        self._recv_slab_free(slab)
        if slab.index:
            try:
                await rt.transport.share_recv_slab(src, slab)
            except PeerLostError as exc:  # it did not acknowledge the slab in time: as
                await self._on_timeout(src, exc)  # unresponsive as a request timing out
                raise
        # a small batch, and the endpoint's only work (no other request, no copy being
        # served): it polls for its reply from here (reply_spin), sparing the event
        # loop's passes
        lone = batch.nbytes <= self._small and not len(self.requests) and rt.inflight == 1
        spin = self._spin if lone and not self._slow_replies else 0.0
        polled = False  # the reply came within the spin: nothing was awaited since pass_held
        table = None  # the unpack's runs, made while the source works (spin path)
        landed = self._landing()
        req = self.requests.open(src, landed.set)
        timeout = self._config.request_timeout
        try:
            # from the first byte of the request on, the copy is "started": it is
            # waited for until the source reports a terminal state
            sent = 0  # perf_counter_ns once the request is out
            msg = load_wire(req.req_id, batch, self._peers.epoch(src), slab.index,
                            self._config.verify)

            async def request() -> None:
                nonlocal sent
                if isinstance(batch, PlannedBatch):  # a failure in its load spares it now
                    batch.requested = True
                t_post = sent = perf_counter_ns()
                try:
                    await rt.transport.send(src, msg)
                except XavierError as exc:
                    req.fail(exc, settled=True)  # never sent: nothing can land
                sent = perf_counter_ns()
                rt.stages.post.record(sent - t_post)

            if spin:
                # a transport that polls inline sends without yielding: the request goes
                # out whole or not at all, nothing can cancel it half way
                await request()
                table = self._runs(batch, slab)
                # the load's schedule point, while the source works (a cancellation that
                # comes through it is held: the copy is started)
                held = await landed.pass_held()
                rt.metrics.reply_spins += 1
                polled = rt.transport.poll_until(req.is_done, spin)
                if polled:
                    rt.metrics.replies_polled += 1
                else:
                    held = await landed.wait_terminal(_sent, timeout) or held
            else:
                held = await landed.wait_terminal(request, timeout)
            waited = perf_counter_ns() - sent
            rt.stages.wait.record(waited)
            if lone:  # would a spin have caught this reply? (a slow source: don't spin)
                self._slow_replies = waited > self._spin * 1e9
            if not req.done:
                m.load_errors += 1
                # the source may still write this slab, late: fence it first
                self._fence(src, req, lease)
                lost = PeerLostError(f"rank {src} did not complete a copy within {timeout} s")
                await self._on_timeout(src, lost)
                raise held or lost
            if req.error is not None and not req.settled:
                self._fence(src, req, lease)  # failed, but a write for it may still land
        finally:
            self.requests.close(req)
        if held is not None:
            raise held
        if req.error is not None:
            m.load_errors += 1
            raise req.error
        if req.slab != slab.index:  # unpack only from the slab the source says it wrote
            m.load_errors += 1
            log.error("rank %d: rank %d reports writing receive slab %d for request %d, which "
                      "asked for slab %d", rt.rank, src, req.slab, req.req_id, slab.index)
            raise IntegrityError(
                f"rank {src} reports writing receive slab {req.slab}, but this batch was "
                f"requested into slab {slab.index}: not unpacked, the slots keep their contents")
        # a cancellation that arrived during the copy surfaces here, before unpacking
        # (polled: none could arrive since pass_held, which holds and raises its own)
        if not polled:
            await anyio.lowlevel.checkpoint_if_cancelled()
        if self._config.verify:
            got = payload_digest(slab.tensor, batch.nbytes)
            if got != req.digest:
                m.load_errors += 1
                raise IntegrityError(
                    f"batch from rank {src} failed verification (digest {got}, the source "
                    f"sent {req.digest}): not unpacked, the slots keep their contents")
        t_unpack = perf_counter_ns()
        await self._unpack(batch, slab, table)
        rt.stages.unpack.record(perf_counter_ns() - t_unpack)
        m.batches_received += 1
        m.bytes_received += req.wire_bytes
        return Moved(req.wire_bytes, *req.tiers)

    def _runs(self, batch: PlannedBatch | MergedBatch, slab: Slab) -> RunTable | None:
        """The unpack's run table for ``batch`` out of ``slab``, made while the request is
        out (off the load's critical path); None if it cannot be made now (the unpack then
        makes it, and raises what it raises)."""
        caches = self._rt.caches
        try:
            return unpack_runs(self.slabs.rows[slab.index], batch, caches.table,
                               caches.device_runs)
        except Exception:  # noqa: BLE001 - a started copy must still be waited for
            return None

    async def _unpack(self, batch: PlannedBatch | MergedBatch, slab: Slab,
                      table: RunTable | None = None) -> None:
        # one pass (memmoves on the CPU, one fused launch on CUDA). This receive slab is
        # lent again only after its unpack has run (_recv_slab_free). Stream-ordered: only
        # enqueued, and the caches' current stream waits on its event. Otherwise its event
        # is spun on briefly (a small unpack is done within that), then polled, shielded
        # (the slots are being written whatever happens), so that other loads progress
        # while the device copies a large batch instead of the event loop blocking
        caches = self._rt.caches
        rows = self.slabs.rows[slab.index]
        copies = self._rt.copies
        if copies.wants(batch.nbytes) and caches.device_runs is None:
            # a large host unpack: on a copy thread, so the loop serves small loads meanwhile
            host = table if table is not None else unpack_runs(rows, batch, caches.table)
            if host is not None:
                await copies.run_runs(host)
                return
        event = unpack(rows, batch, caches.table, caches.device_runs,
                       wait=False, table=table)
        if event is None:
            return
        self._unpacked[slab.index] = event
        if self._config.stream_ordered_unpack:
            torch.cuda.current_stream(caches.layout.device).wait_event(event)
            return
        until = perf_counter_ns() + _UNPACK_SPIN_NS  # a small unpack is done by then
        while not event.query():
            if perf_counter_ns() > until:
                with anyio.CancelScope(shield=True):
                    while not event.query():
                        await anyio.lowlevel.checkpoint()
                break
        self._unpacked.pop(slab.index, None)

    def _recv_slab_free(self, slab: Slab) -> None:
        """Wait for the last unpack out of ``slab`` to have read it (CUDA only), before a
        request names it again."""
        event = self._unpacked.pop(slab.index, None)
        if event is not None:
            event.synchronize()

    # -- replies ---------------------------------------------------------------------------
    def on_reply(self, peer: int, message: Landed | Error) -> None:
        """A reply from a connected peer: it resolves a request, or it is a late one."""
        if self.requests.reply(peer, message) is None:
            self.on_late_reply(peer, message)

    def on_late_reply(self, peer: int, message: Landed | Error) -> None:
        """A reply to a request we no longer wait for: if it is the stale writer of a
        fenced slab and its write is terminal, the slab is free again."""
        settled = isinstance(message, Landed) or message.settled
        if settled and self._recv is not None and self._recv.release_reply(peer, message.req_id):
            log.info("rank %d: fenced receive slab released (late reply %d from rank %d)",
                     self._rt.rank, message.req_id, peer)
        else:
            log.debug("rank %d: stray %r from rank %d", self._rt.rank, message, peer)

    def peer_joined(self, peer: int, incarnation: str, vouches: bool) -> None:
        """``peer`` connected; if it ``vouches`` that none of its writes to us can still
        land (the same instance under a new epoch), its fenced slabs are free again."""
        if self._recv is not None and vouches:
            self._recv.release_peer(peer, incarnation)

    def peer_lost(self, peer: int, exc: XavierError) -> None:
        """Fail every request waiting on ``peer`` (a write for them may still land)."""
        self.requests.fail(exc, peer)

    def closing(self) -> None:
        """Close has begun: no replacement will be registered from now on."""
        self._replenish_soon()

    def close(self) -> None:
        """The loads in flight are done: fail whatever still waits for a reply."""
        self.requests.fail(EndpointClosedError("endpoint closed"))

    # -- diagnostics -----------------------------------------------------------------------
    def check(self, idle: bool) -> None:
        """The receive slabs' bookkeeping holds; ``idle``: none is lent or awaited."""
        recv = self.slabs
        recv.check()
        if idle and (recv.pool.held or recv.pool.waiting):
            raise InternalError(f"idle, yet receive slabs are lent or awaited: {self.stats()}")

    def stats(self) -> dict[str, int]:
        if self._recv is None:
            return {}
        return {**self._recv.stats(), **self.scheduler.stats()}


__all__ = ["Receiver"]

"""The source role: serving published blocks to the peers that load them.

A request (``Load``) is parsed once and answered by one routine, :meth:`Source._serve`:
decide (:func:`~xavier_async.protocol.decide`: refuse, map a view first, or ready), then
commit the channel's machine, pack the send slab and post the WRITE whose notification
tells the receiver which receive slab it wrote. Called from the transport's poller
(``inline``) with a send slab free and nothing queued ahead, a request is served right
there without awaiting anything; otherwise it joins the serve queue, where requests take
send slabs in arrival order (the head-of-line rule applies to send slabs too) and are
served concurrently, each by a task of its own. A send slab is held until its copy is
terminal.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from time import perf_counter_ns
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .channel import CopyPlan, PeerChannel
from .config import direct_write_regions_for
from .errors import (EndpointClosedError, InternalError, InvalidRequestError, PeerLostError,
                     TransferError, XavierError)
from .fairpool import FairPool, Ticket
from .layout import BlockKey, LayerId, check_key, check_layers, check_slot
from ._checks import check_int
from .hostcopy import split_runs
from .packing import SlabRows, host_runs, pack, pack_table, run_host
from .peers import PeerTable
from .decision import (BlockShapes, Decision, NeedsMapping, ParsedLoad, Ready, Refuse, check_epoch,
                       check_probe, decide, parse_load)
from .protocol import BlockLoad, Error, Landed, Load, Probe
from .runtime import Runtime
from .slabs import Slab, payload_digest
from .snapshots import PublishResult, SnapshotStore
from .transports.base import Regions

log = logging.getLogger("xavier_async")

#: what waits in the serve queue: (peer, the parsed request, when it arrived)
Queued = tuple[int, ParsedLoad, int]
#: a send slab packed off the loop: the store's tier counts and a direct write's regions
Packed = tuple[tuple[int, int], Regions]


class Source:
    """One endpoint's publish table, send slabs and serve path."""

    def __init__(self, rt: Runtime, peers: PeerTable) -> None:
        self._rt = rt
        self._peers = peers
        self._config = rt.config
        layout = rt.caches.layout
        self._layout = layout
        #: block loads' segment offsets, per (layers, key count)
        self._shapes = BlockShapes(layout)
        #: layer -> block key -> the slot it lives at (with a snapshot store, which keeps
        #: whole blocks, every layer shares one table)
        self.published: dict[LayerId, dict[BlockKey, int]] = {layer: {} for layer in layout.layers}
        #: the send slabs: one is held from packing until its copy is terminal
        self.pool = FairPool(range(rt.config.send_slabs))
        self.slabs: list[Slab] = []
        self._rows: list[SlabRows] = []
        #: a batch whose payload exceeds this is "large" (the head-of-line rule)
        self._small = rt.config.sizes.small
        #: requests handed to the serve queue and not yet committed (the inline path waits)
        self._queued = 0
        self._inbox: MemoryObjectSendStream[Queued] | None = None
        cfg = rt.config
        #: the snapshot store (None: blocks are served from the engine's live slots)
        self.store = (SnapshotStore(layout, rt.caches.rows, cfg.snapshot_gpu_bytes,
                                    cfg.snapshot_cpu_bytes or 0, prefault=cfg.snapshot_prefault)
                      if cfg.snapshot_gpu_bytes or cfg.snapshot_cpu_bytes else None)
        #: per send slab in use: the store slots its copy reads (leased until terminal)
        self._leased: dict[int, tuple[int, ...]] = {}
        #: serves from the store of at most this many regions are written straight from it
        # the default (None): what the figures support for the caches' memory
        regions = direct_write_regions_for(cfg.direct_write_regions, layout.device.type)
        self._direct_max = regions
        self._direct = bool(regions) and rt.transport.direct_writes
        #: serves written straight from the store (no gather)
        self.direct_writes = 0
        #: the store's tiers (allocated now, so that blocks can be published before start;
        #: registered with the transport at start)
        self.pool_tensors = self._allocate_store()
        if self.store is not None:
            shared: dict[BlockKey, int] = {}
            self.published = {layer: shared for layer in layout.layers}

    @property
    def pools(self) -> int:
        """Snapshot tiers registered with the transport (0 without a store)."""
        return len(self.pool_tensors)

    def _allocate_store(self) -> list[torch.Tensor]:
        """Allocate the snapshot store's tiers (none without a store)."""
        if self.store is None:
            return []
        self._rt.caches.start()
        runs = self._rt.caches.device_runs
        if runs is None and self._layout.device.type == "cuda":
            log.warning("rank %d: no fused copy kernel (Triton) on %s: the snapshot store is off, "
                        "blocks are served from the engine's live slots", self._rt.rank,
                        self._layout.device)
            self.store = None
            return []
        return self.store.allocate(runs)

    def start(self, slabs: list[Slab]) -> None:
        """Take the send slabs (registered by the endpoint's start) and start serving."""
        self.slabs = slabs
        self._rows = [SlabRows(s.tensor, self._rt.caches.block_sizes) for s in slabs]
        send, recv = anyio.create_memory_object_stream[Queued](max_buffer_size=1 << 16)
        self._inbox = send
        self._rt.spawn(self._serve_loop, recv)

    def close(self) -> None:
        """Serve nothing more (requests still queued are answered by their tasks)."""
        if self._inbox is not None:
            self._inbox.close()

    # -- publishing ----------------------------------------------------------------------
    def publish(self, key: BlockKey, slot: int,
                layers: Iterable[LayerId] | None = None) -> PublishResult:
        """``key`` lives at ``slot`` of each of ``layers`` (all by default); every argument
        is checked before anything is published. With a snapshot store the block is
        copied into it now (every layer: ``layers`` may only name them all)."""
        check_key(key)
        specs = self._layout.layers
        targets = list(specs) if layers is None else check_layers(layers)
        if not targets:
            check_int("slot", slot, minimum=0)
        for layer in targets:
            if layer not in specs:
                raise InvalidRequestError(f"unknown layer {layer!r}")
            slot = check_slot(slot, specs[layer], layer)
        if self.store is not None:
            self._whole_blocks(targets)
            return self.store.publish_now(key, slot, self._moved)
        for layer in targets:
            self.published[layer][key] = slot
        return PublishResult((key,))

    async def publish_blocks(self, keys: Sequence[BlockKey],
                             slots: Sequence[int]) -> PublishResult:
        """Publish ``keys`` from the engine's ``slots`` (every layer); with a snapshot
        store, one staging pass copies them out (the slots are free to reuse when this
        returns)."""
        keys, slots = list(keys), list(slots)
        if self.store is not None:
            return await self.store.publish(keys, slots, self._moved)
        if len(keys) != len(slots):
            raise InvalidRequestError(f"{len(keys)} keys but {len(slots)} slots")
        for key, slot in zip(keys, slots):  # every argument checked before any is published
            check_key(key)
            for layer, spec in self._layout.layers.items():
                check_slot(slot, spec, layer)
        for key, slot in zip(keys, slots):
            for layer in self._layout.layers:
                self.published[layer][key] = slot
        await anyio.lowlevel.checkpoint()
        return PublishResult(tuple(keys))

    def unpublish(self, key: BlockKey, layers: Iterable[LayerId] | None = None) -> None:
        """Stop serving ``key`` (keys and layers that are not published are ignored)."""
        check_key(key)
        if self.store is not None:
            if layers is not None:
                self._whole_blocks(check_layers(layers))
            if self.store.remove(key):
                self._moved(key, None)
            return
        for layer in (list(self.published) if layers is None else check_layers(layers)):
            self.published.get(layer, {}).pop(key, None)

    def _whole_blocks(self, layers: list[LayerId]) -> None:
        if set(layers) != set(self._layout.layers):
            raise InvalidRequestError(
                "the snapshot store keeps whole blocks: publish or unpublish every layer "
                "(layers=None), or turn the store off (EndpointConfig(snapshot_gpu_bytes=0, "
                "snapshot_cpu_bytes=0)) to publish single layers from the live slots")

    def _moved(self, key: BlockKey, slot: int | None) -> None:
        """The store moved ``key`` to ``slot`` (``None``: it is gone): serve it there (the
        store's layers share one table)."""
        table = next(iter(self.published.values()), None)
        if table is None:
            return
        if slot is None:
            table.pop(key, None)
        else:
            table[key] = slot

    # -- requests ------------------------------------------------------------------------
    def on_probe(self, peer: int, probe: Probe) -> None:
        stale = check_epoch(probe.req_id, probe.epoch, self._peers.min_epoch(peer))
        err = stale.error if stale is not None else check_probe(probe, self._layout, self.published)
        if self._rt.running:
            self._rt.spawn(self._answer_probe, peer, probe.req_id, err)

    async def _answer_probe(self, peer: int, req_id: int, err: XavierError | None) -> None:
        if err is not None:
            await self._reply_error(peer, req_id, err)
            return
        try:
            await self._rt.transport.send(peer, Landed(req_id, 0).to_wire())
        except XavierError:
            pass

    def on_load(self, peer: int, load: Load | BlockLoad, inline: bool) -> None:
        """A request: refused at once (stale or malformed), served right here (``inline``,
        a send slab free, nothing queued ahead, and :meth:`_serve` ready for it), or
        queued."""
        rt = self._rt
        arrived = perf_counter_ns()
        stale = check_epoch(load.req_id, load.epoch, self._peers.min_epoch(peer))
        if stale is not None:  # its receiver moved on (gave up, or reconnected since)
            self._spawn_reply(peer, stale.req_id, stale.error)
            return
        parsed = parse_load(load, self._layout, self._config.full_bytes, self._shapes)
        if isinstance(parsed, Refuse):
            self._spawn_reply(peer, parsed.req_id, parsed.error)
            return
        if (inline and rt.life.open and not self._queued and self._inbox is not None
                and not self._off_loop(parsed)):
            ch = self._peers.connected(peer)
            send = self.pool.try_acquire(parsed.payload > self._small)
            if ch is not None and send is not None:
                d = self._decide(ch, parsed, send)
                if isinstance(d, Ready):
                    rt.inflight += 1
                    rt.stages.queue.record(0)
                    self._serve_inline(ch, peer, d, send)
                    return
                self.pool.release(send)
                if isinstance(d, Refuse):
                    self._spawn_reply(peer, d.req_id, d.error)
                    return
            elif send is not None:
                self.pool.release(send)
        if self._inbox is not None:
            try:
                self._inbox.send_nowait((peer, parsed, arrived))
                self._queued += 1  # until committed: later requests may not overtake it
                return
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
        log.warning("rank %d: cannot serve rank %d now (closing)", rt.rank, peer)

    def _decide(self, ch: PeerChannel, load: ParsedLoad, send: int) -> Decision:
        """The serve decision for send slab ``send`` (timed as the lookup stage)."""
        t = perf_counter_ns()
        d = decide(load, self.published, ch.policy, ch.mapped_for(send), self.store is not None)
        self._rt.stages.lookup.record(perf_counter_ns() - t)
        return d

    def _prepare(self, ready: Ready, send: int, parts: int = 1
                 ) -> tuple[tuple[int, int], Regions, list[Callable[[], Any]]]:
        """Choose how ``ready`` reaches the peer through send slab ``send``: returns the
        store's tier counts, the regions of a direct write (empty: gathered) and the
        copies that gather it into the slab (none for a direct write; at most ``parts``
        of about equal bytes that may run at once on as many copy threads, host memory
        only; with ``parts`` 1, one copy, which returns a CUDA event to wait on, or None).
        With a store, its slots are leased until the copy is terminal (released with the
        send slab)."""
        load = ready.load
        caches, store = self._rt.caches, self.store
        rows = self._rows[send]
        if store is None:
            if parts > 1 and caches.device_runs is None and host_runs(rows):
                table = pack_table(rows.ptr, load.segments, ready.slot_lists, caches.table)
                return (0, 0), (), [functools.partial(run_host, piece)
                                    for piece in split_runs(*table, parts)]
            return (0, 0), (), [functools.partial(pack, rows, load.segments, ready.slot_lists,
                                                  caches.table, caches.device_runs)]
        self._leased[send], tiers, table = store.serve(rows.ptr, load.segment_items(),
                                                       ready.slot_lists, load.block)
        if (self._direct and not load.verify and len(table[2]) <= self._direct_max
                and store.writable_directly(table)):
            # few regions: written straight from the store, nothing gathered
            return tiers, tuple((int(s), int(d) - rows.ptr, int(n)) for d, s, n in zip(*table)), []
        return tiers, (), store.gathers(table, self.slabs[send].tensor, parts)

    def _off_loop(self, load: ParsedLoad) -> bool:
        """Whether serving ``load`` packs on a copy thread (a large host gather)."""
        return self._rt.copies.wants(load.payload)

    async def _pack_off_loop(self, ch: PeerChannel, ready: Ready, send: int) -> Packed:
        """Pack send slab ``send`` on a copy thread (shielded: a started copy is waited
        for), before the machine commits: the loop serves other requests meanwhile."""
        t_pack = perf_counter_ns()
        try:
            copies = self._rt.copies
            tiers, regions, gathers = self._prepare(ready, send, copies.parts(ready.load.payload))
            if gathers:
                await copies.run_all(gathers)
        except XavierError:
            raise
        except Exception as exc:
            ch.metrics.failures += 1
            raise TransferError(f"packing a batch for rank {ch.peer} failed: {exc!r}") from exc
        self._rt.stages.pack.record(perf_counter_ns() - t_pack)
        return tiers, regions

    def _post(self, ch: PeerChannel, ready: Ready, send: int,
              packed: Packed | None = None) -> tuple[CopyPlan, object | None, int]:
        """Commit the machine, pack send slab ``send`` (one pass; on CUDA one launch whose
        event is waited for, not the device; ``packed``: already packed, off the loop),
        post the copy. Returns the plan, the transport's pending token (None: already
        DONE) and when it was posted."""
        load = ready.load
        stages = self._rt.stages
        plan = ch.commit(load.payload, ready.view, load.useful, load.slab, send)
        t_pack = perf_counter_ns()
        try:
            if packed is None:
                tiers, regions, gathers = self._prepare(ready, send)
                event = gathers[0]() if gathers else None
                if event is not None:  # NIXL does not order against CUDA streams
                    event.synchronize()
            else:
                tiers, regions = packed
            if regions:
                plan = replace(plan, wire_bytes=sum(n for _, _, n in regions))
            digest = (payload_digest(self.slabs[send].tensor, load.payload)
                      if load.verify else None)
        except Exception as exc:  # the machine advanced but nothing was posted: start over
            ch.metrics.failures += 1
            ch.reset_now()
            raise TransferError(f"packing a batch for rank {ch.peer} failed: {exc!r}") from exc
        posted = perf_counter_ns()
        if packed is None:
            stages.pack.record(posted - t_pack)
        landed = Landed(load.req_id, plan.wire_bytes, digest, plan.slab, tiers).to_wire()
        if regions:
            self.direct_writes += 1
            pending = ch.post_regions(plan, regions, landed)
        else:
            pending = ch.post(plan, landed)
        if pending is None:
            stages.post_to_done.record(perf_counter_ns() - posted)
        return plan, pending, posted

    def _serve_inline(self, ch: PeerChannel, peer: int, ready: Ready, send: int) -> None:
        """Serve from the poller (send slab ``send`` held, work counted); never raises."""
        rt = self._rt
        try:
            plan, pending, posted = self._post(ch, ready, send)
        except Exception as exc:  # reply with the error; never raise into the poller
            self._release_send(send)
            rt.leave_work()
            err = exc if isinstance(exc, XavierError) else TransferError(f"serving failed: {exc!r}")
            rt.spawn(self._after_failure, ch, peer, ready.load.req_id, err)
            return
        if pending is None:
            self._release_send(send)
            rt.leave_work()
        else:
            rt.spawn(self._finish_inline, ch, peer, ready.load.req_id, plan, pending, posted, send)

    async def _finish(self, ch: PeerChannel, peer: int, req_id: int, plan: CopyPlan,
                      pending: object, posted: int) -> None:
        """Wait (shielded) for a posted copy to be terminal; a failure is replied."""
        try:
            await ch.finish(plan, pending)
            self._rt.stages.post_to_done.record(perf_counter_ns() - posted)
        except XavierError as exc:
            await self._reply_error(peer, req_id, exc)

    async def _finish_inline(self, ch: PeerChannel, peer: int, req_id: int, plan: CopyPlan,
                             pending: object, posted: int, send: int) -> None:
        try:
            await self._finish(ch, peer, req_id, plan, pending, posted)
        finally:
            self._release_send(send)  # the copy is terminal: nothing reads the slab now
            self._rt.leave_work()

    def _release_send(self, send: int) -> None:
        """Send slab ``send`` and the store slots its copy read are free again."""
        leased = self._leased.pop(send, None)
        if leased is not None and self.store is not None:
            self.store.release(leased)
        self.pool.release(send)

    async def _after_failure(self, ch: PeerChannel, peer: int, req_id: int, exc: XavierError) -> None:
        await ch.forget()
        await self._reply_error(peer, req_id, exc)

    def _spawn_reply(self, peer: int, req_id: int, exc: XavierError) -> None:
        if self._rt.running:
            self._rt.spawn(self._reply_error, peer, req_id, exc)

    async def _reply_error(self, peer: int, req_id: int, exc: XavierError) -> None:
        # settled: no write of ours to the peer can still land (a timed-out copy can)
        transport = self._rt.transport
        settled = peer not in transport.unsettled()
        try:
            await transport.send(peer, Error.of(req_id, exc, settled).to_wire())
        except XavierError:
            pass  # the peer is gone; it will notice on its own

    # -- the serve queue -----------------------------------------------------------------
    async def _serve_loop(self, inbox: MemoryObjectReceiveStream[Queued]) -> None:
        """Start one task per queued request, in arrival order. Each takes its place in the
        send-slab pool's line here, synchronously, so requests get send slabs in the order
        they arrived (FIFO; a large one held back by the head-of-line rule does not hold
        back small ones behind it)."""
        rt = self._rt
        async with inbox:
            async for peer, parsed, arrived in inbox:
                ticket = self.pool.enqueue(parsed.payload > self._small)
                rt.inflight += 1
                rt.spawn(self._serve_queued, peer, parsed, arrived, ticket)

    async def _serve_queued(self, peer: int, load: ParsedLoad, arrived: int, ticket: Ticket) -> None:
        """Serve a request that may need awaiting: a send slab to wait for, a view to map.
        Until it commits (or fails), the inline path stays closed (no overtaking)."""
        rt = self._rt
        queued = True
        send: int | None = None
        try:
            try:
                if not rt.life.open:
                    raise EndpointClosedError(f"rank {rt.rank} is closing")
                ch = self._peers.channel(peer)
                first = decide(load, self.published, ch.policy, ch.mapped_for(0), self.store is not None)
                if isinstance(first, Refuse):  # unknown keys: refused before anything else
                    raise first.error
                send = await ticket.take()
                rt.stages.queue.record(perf_counter_ns() - arrived)
                packed: Packed | None = None
                while True:
                    d = await self._ready(ch, peer, load, send)
                    if packed is not None or not self._off_loop(load):
                        break
                    # a large host pack: on a copy thread, before the machine commits
                    # (decided again after it); requests behind it are served meanwhile
                    queued = False
                    self._queued -= 1
                    packed = await self._pack_off_loop(ch, d, send)
                # re-check right before posting (we may have waited): the requester
                # must still be connected on this channel and at this request's epoch
                if self._peers.connected(peer) is not ch or not rt.life.open:
                    raise PeerLostError(f"rank {peer} went away before its copy")
                stale = check_epoch(load.req_id, load.epoch, self._peers.min_epoch(peer))
                if stale is not None:
                    raise stale.error
                if queued:
                    queued = False
                    self._queued -= 1  # committed below, with nothing awaited before
                try:
                    plan, pending, posted = self._post(ch, d, send, packed)
                except TransferError:
                    await ch.forget()
                    raise
                if pending is not None:  # not finished while posting
                    await self._finish(ch, peer, load.req_id, plan, pending, posted)
            except XavierError as exc:
                await self._reply_error(peer, load.req_id, exc)
            except Exception as exc:  # never let one request stop the serving
                log.exception("rank %d: serving rank %d failed", rt.rank, peer)
                await self._reply_error(peer, load.req_id,
                                        TransferError(f"rank {rt.rank} failed serving: {exc!r}"))
        finally:
            if queued:
                self._queued -= 1
            if send is not None:
                self._release_send(send)  # the copy is terminal, or was never posted
            else:
                ticket.cancel()  # leave the line (or give back a slab granted meanwhile)
            rt.leave_work()

    async def _ready(self, ch: PeerChannel, peer: int, load: ParsedLoad, send: int) -> Ready:
        """Decide ``load`` for send slab ``send``, mapping the view it needs first (the
        decision is only valid until something is awaited)."""
        while True:
            d = self._decide(ch, load, send)
            if isinstance(d, Refuse):
                raise d.error
            if not isinstance(d, NeedsMapping):
                return d
            await ch.mapping(d.view, d.slab, send)
            if self._peers.connected(peer) is not ch:  # the peer left (or restarted)
                raise PeerLostError(f"rank {peer} went away before its copy")

    # -- a seam for the benchmark's bare copies ------------------------------------------
    @asynccontextmanager
    async def holding_send_slab(self, index: int = 0) -> AsyncIterator[Slab]:
        """Counted as in-flight work, holding send slab ``index`` (for copies outside the
        serve path: the benchmark's bare copies, through :mod:`xavier_async._internal`)."""
        self._rt.enter_work()
        try:
            got = await self.pool.acquire(False, want=index)
            try:
                yield self.slabs[got]
            finally:
                self.pool.release(got)
        finally:
            self._rt.leave_work()

    def check(self, idle: bool) -> None:
        """Raise :class:`~xavier_async.errors.InternalError` if the send pool's or the
        store's bookkeeping is broken; ``idle``: no send slab is lent or awaited and no
        store slot is leased."""
        self.pool.check()
        if self.store is not None:
            self.store.index.check()
        if idle and (self.pool.held or self.pool.waiting or
                     (self.store is not None and self.store.index.leased)):
            raise InternalError(f"idle, yet {self.pool.held} send slab(s) are lent, "
                                f"{self.pool.waiting} awaited, and store slots leased")


__all__ = ["Source"]

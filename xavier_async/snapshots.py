"""The snapshot store: published blocks copied out of the engine's slots into two tiers
of block slots the library owns (the seed's tiered snapshot store).

Each tier is one tensor ``[slots, block_bytes]`` of raw bytes, allocated and registered
with the transport once, at start: the *device* tier on the caches' device (GPU memory
on CUDA), the *host* tier in DRAM (pinned on CUDA). A block occupies one slot: every
layer of it, one after the other in the layout's order, each in the bytes (and so the
logical dtype) it has in the engine. Which slot holds which block, the LRU order, leases
and admission are :mod:`xavier_async.snapshot_index`'s; this module does the copies:

* :meth:`SnapshotStore.publish` stages a batch of blocks with one copy pass (memmoves on
  the CPU, one fused launch on CUDA, completion by its event) after demoting what must
  make room (one pass too). A block becomes loadable only once every layer is staged, and
  the engine may overwrite its own slots as soon as the call returns.
* The source serves a load by gathering from the tiers instead of the engine's slots
  (:class:`StoreTable`), leasing the slots it reads until its copy is terminal, so that
  neither eviction nor demotion touches them meanwhile.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import anyio
import numpy as np
import torch

from .errors import AllocationError, InvalidRequestError
from .hostcopy import split_runs
from .layout import BlockKey, CacheLayout, LayerId
from .packing import DeviceRuns, RunTable, merged_runs, run_host
from .planning import BlockSpec, Segment, SegmentItem
from .snapshot_index import DEVICE, HOST, Admission, SnapshotIndex

log = logging.getLogger("xavier_async")

@dataclass(frozen=True)
class PublishResult:
    """What :meth:`~xavier_async.Endpoint.publish_blocks` did: ``available`` keys are
    loadable now; ``evicted`` keys were dropped from the store to make room (unregister
    them from your block index); ``skipped`` keys found no room in either tier and are not
    loadable; ``demoted`` keys moved from the device tier to the host tier (still
    loadable); ``failed`` keys could not be copied into the store (a copy error, logged)
    and are not loadable."""

    available: tuple[BlockKey, ...]
    evicted: tuple[BlockKey, ...] = ()
    skipped: tuple[BlockKey, ...] = ()
    demoted: tuple[BlockKey, ...] = ()
    failed: tuple[BlockKey, ...] = ()


#: a serve's gather runs: (destinations, sources, sizes) as lists, or numpy arrays for a
#: large batch served from host memory (:meth:`SnapshotStore.serve`)
GatherRuns = tuple[Any, Any, Any]


def _listed(table: GatherRuns) -> RunTable:
    """A gather table as lists (:meth:`SnapshotStore.serve` may give numpy columns)."""
    if isinstance(table[0], np.ndarray):
        return table[0].tolist(), table[1].tolist(), table[2].tolist()
    return table


class StoreTable:
    """Where each (layer, global slot) of the store lies: ``base[tier][layer] + slot *
    block_bytes`` (the host tier's base is shifted by the device tier's slot count, so
    one formula serves both)."""

    __slots__ = ("split", "stride", "device_base", "host_base")

    def __init__(self, device: torch.Tensor, host: torch.Tensor, offsets: Mapping[LayerId, int],
                 split: int, stride: int) -> None:
        self.split, self.stride = split, stride
        self.device_base = {layer: device.data_ptr() + o for layer, o in offsets.items()}
        self.host_base = {layer: host.data_ptr() + o - split * stride for layer, o in offsets.items()}

    def pack_table(self, slab_ptr: int, segments: Sequence[Segment],
                   slot_lists: Sequence[Sequence[int]]) -> RunTable:
        """The runs copying each segment's blocks (global store slots ``slot_lists``) into
        a slab at ``slab_ptr``; a run that continues the previous one in both places is
        merged with it (one block hash over every layer is one run)."""
        split, stride = self.split, self.stride

        def copies() -> Iterator[tuple[int, int, int]]:
            for seg, slots in zip(segments, slot_lists):
                bn, p = seg.block_nbytes, slab_ptr + seg.offset
                db, hb = self.device_base[seg.layer], self.host_base[seg.layer]
                for row, slot in enumerate(slots):
                    yield p + row * bn, (db if slot < split else hb) + slot * stride, bn
        return merged_runs(copies())


class SnapshotStore:
    """One source's two tiers, their index and the copies between engine, tiers and
    slabs. ``device_bytes``/``host_bytes``: the tiers' budgets (whole blocks fit)."""

    def __init__(self, layout: CacheLayout, rows: Mapping[LayerId, torch.Tensor],
                 device_bytes: int, host_bytes: int, *, prefault: bool = False) -> None:
        self.layout = layout
        self._prefault = prefault
        self._rows = rows
        self.offsets: dict[LayerId, int] = {}
        off = 0
        for layer, spec in layout.layers.items():
            self.offsets[layer] = off
            off += spec.block_nbytes
        #: bytes of one block, every layer
        self.block_bytes = off
        self.index = SnapshotIndex(device_bytes // off, host_bytes // off)
        self.device_pool: torch.Tensor | None = None
        self.host_pool: torch.Tensor | None = None
        self.table: StoreTable | None = None
        self._runs: DeviceRuns | None = None
        self._released: anyio.Event | None = None
        #: per block load's layers: the bytes of one hash as one run, or False (_serve_one)
        self._contiguous: dict[tuple[LayerId, ...], int | bool] = {}
        #: staging and demotion passes, and the nanoseconds they took (the bench reads them)
        self.staged_blocks = self.stage_ns = self.demote_ns = 0

    @property
    def slots(self) -> int:
        return self.index.device_slots + self.index.host_slots

    def allocate(self, device_runs: DeviceRuns | None) -> list[torch.Tensor]:
        """Allocate both tiers (not zeroed: a slot is written before it is ever read;
        host memory is touched once here with ``prefault``); returns them for the
        transport to register."""
        dev = self.layout.device
        n_dev, n_host, b = self.index.device_slots, self.index.host_slots, self.block_bytes
        try:
            self.device_pool = torch.empty((n_dev, b), dtype=torch.uint8, device=dev)
        except (RuntimeError, MemoryError) as exc:
            raise _no_memory("snapshot_gpu_bytes", n_dev * b, dev, exc) from exc
        try:
            self.host_pool = torch.empty((n_host, b), dtype=torch.uint8,
                                         pin_memory=dev.type == "cuda" and n_host > 0)
        except (RuntimeError, MemoryError) as exc:
            raise _no_memory("snapshot_cpu_bytes", n_host * b, "the host", exc) from exc
        if self._prefault:
            for pool in (self.device_pool, self.host_pool):
                if pool.device.type == "cpu" and not pool.is_pinned():
                    pool.zero_()   # first-touch faults here, not in a publish
        self.table = StoreTable(self.device_pool, self.host_pool, self.offsets, n_dev, b)
        self._runs = device_runs
        return [t for t in (self.device_pool, self.host_pool) if t.numel()]

    # -- publishing ---------------------------------------------------------------------
    def _check(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        from .layout import check_key, check_slot
        if len(keys) != len(slots):
            raise InvalidRequestError(f"{len(keys)} keys but {len(slots)} slots")
        for key, slot in zip(keys, slots):
            check_key(key)
            for layer, spec in self.layout.layers.items():
                check_slot(slot, spec, layer)
        if len(set(keys)) != len(keys):
            raise InvalidRequestError("a key is named twice in one publish")

    async def publish(self, keys: Sequence[BlockKey], slots: Sequence[int],
                      on_move: Any) -> PublishResult:
        """Stage ``keys`` from the engine's ``slots`` (all layers). ``on_move(key, slot)``
        is told where each demoted and staged block now lives (``slot`` None: gone), in
        the order that keeps every published block readable."""
        self._check(keys, slots)
        index = self.index
        plan = index.admit(list(keys))
        engine_slot = dict(zip(keys, slots))
        try:
            for key in plan.drop:  # dropped to make room: not served from now on
                on_move(key, None)
            if plan.demote:
                await self._wait_unleased([m.dst for m in plan.demote])
                t0 = perf_counter_ns()
                await self._copy(self._demote_table(plan))
                self.demote_ns += perf_counter_ns() - t0
                for m in plan.demote:
                    on_move(m.key, m.dst)  # served from the host tier from now on
            targets = list(plan.place.values())
            await self._wait_unleased(targets)
            t0 = perf_counter_ns()
            staged, failed = await self._stage(plan, engine_slot)
            self.stage_ns += perf_counter_ns() - t0
            self.staged_blocks += len(staged)
        except BaseException:
            index.abort(plan)
            for m in plan.demote:
                on_move(m.key, None)
            raise
        index.commit(plan, staged)
        for key in staged:
            on_move(key, plan.place[key])
        return PublishResult(tuple(staged), tuple(plan.drop), tuple(plan.skip),
                             tuple(m.key for m in plan.demote), failed)

    async def _stage(self, plan: Admission, engine_slot: Mapping[BlockKey, int],
                     ) -> tuple[list[BlockKey], tuple[BlockKey, ...]]:
        """Copy the placed blocks in one pass; if that fails, block by block, so that a
        failure drops only the blocks it concerns. Returns (staged, failed)."""
        try:
            await self._copy(self._stage_table(plan, engine_slot))
            return list(plan.place), ()
        except Exception:
            log.warning("staging %d block(s) in one pass failed; staging them one by one",
                        len(plan.place), exc_info=True)
        staged, failed = [], []
        for key, slot in plan.place.items():
            one = Admission(place={key: slot})
            try:
                await self._copy(self._stage_table(one, engine_slot))
                staged.append(key)
            except Exception:
                log.warning("staging block %r failed: it is not published", key, exc_info=True)
                failed.append(key)
        return staged, tuple(failed)

    def publish_now(self, key: BlockKey, slot: int, on_move: Any) -> PublishResult:
        """:meth:`publish` of one block, synchronously (``Endpoint.publish``): the copy
        runs before this returns (on CUDA, its event is waited for)."""
        self._check([key], [slot])
        index = self.index
        plan = index.admit([key])
        for victim in plan.drop:
            on_move(victim, None)
        if any(index.is_leased(s) for s in [*plan.place.values(), *(m.dst for m in plan.demote)]):
            # a copy still reads a slot this would overwrite: nothing moves, the key is
            # skipped (publish_blocks waits for the reader instead)
            index.abort(plan)
            for m in plan.demote:
                on_move(m.key, None)
            return PublishResult((), tuple(plan.drop) + tuple(m.key for m in plan.demote), (key,))
        if plan.demote:
            self._copy_now(self._demote_table(plan))
            for m in plan.demote:
                on_move(m.key, m.dst)
        self._copy_now(self._stage_table(plan, {key: slot}))
        self.staged_blocks += len(plan.place)
        index.commit(plan)
        for k, s in plan.place.items():
            on_move(k, s)
        return PublishResult(tuple(plan.place), tuple(plan.drop), tuple(plan.skip),
                             tuple(m.key for m in plan.demote))

    def remove(self, key: BlockKey) -> bool:
        return self.index.remove(key)

    # -- the copies ------------------------------------------------------------------------
    def _addr(self, slot: int) -> int:
        if self.device_pool is None or self.host_pool is None:
            raise InvalidRequestError("the snapshot store is not started")
        split, b = self.index.device_slots, self.block_bytes
        if slot < split:
            return self.device_pool.data_ptr() + slot * b
        return self.host_pool.data_ptr() + (slot - split) * b

    def _demote_table(self, plan: Admission) -> RunTable:
        """One run per demoted block: its whole slot, device tier to host tier."""
        b = self.block_bytes
        moves = plan.demote
        return [self._addr(m.dst) for m in moves], [self._addr(m.src) for m in moves], [b] * len(moves)

    def _stage_table(self, plan: Admission, engine_slot: Mapping[BlockKey, int]) -> RunTable:
        """The runs copying each placed block's layers from the engine's slots into its
        store slot (consecutive engine slots into consecutive store slots, one layer at a
        time, merge)."""
        at = [(self._addr(slot), engine_slot[key]) for key, slot in plan.place.items()]

        def copies() -> Iterator[tuple[int, int, int]]:
            for layer, rows in self._rows.items():
                bn, off, base = rows.shape[1], self.offsets[layer], rows.data_ptr()
                for addr, engine in at:
                    yield addr + off, base + engine * bn, bn
        return merged_runs(copies())

    def _copy_now(self, table: RunTable) -> None:
        if not table[2]:
            return
        if self._runs is None:
            run_host(table)
            return
        event = self._runs.run(table)
        if event is not None:
            event.synchronize()

    async def _copy(self, table: RunTable) -> None:
        """One pass; on CUDA, one launch whose event is polled (shielded: the bytes are
        being written whatever happens) so that other work goes on meanwhile."""
        if not table[2]:
            return
        if self._runs is None:
            run_host(table)
            await anyio.lowlevel.checkpoint()
            return
        event = self._runs.run(table)
        if event is None:
            return
        with anyio.CancelScope(shield=True):
            while not event.query():
                await anyio.lowlevel.checkpoint()

    # -- leases ------------------------------------------------------------------------
    def release(self, slots: tuple[int, ...]) -> None:
        self.index.release(slots)
        ev = self._released
        if ev is not None:
            self._released = None
            ev.set()

    async def _wait_unleased(self, slots: Sequence[int]) -> None:
        """Until no copy reads any of ``slots`` (a slot freed while a copy read it)."""
        while any(self.index.is_leased(s) for s in slots):
            if self._released is None:
                self._released = anyio.Event()
            await self._released.wait()

    #: a segment of this many blocks or more is laid out with numpy, not block by block
    VECTOR_FROM = 16

    def serve(self, slab_ptr: int, segments: Iterable[SegmentItem],
              slot_lists: Sequence[Sequence[int]], block: BlockSpec | None = None,
              ) -> tuple[tuple[int, ...], tuple[int, int], GatherRuns]:
        """What one serve needs, in one pass over its segments (the source's hot path):
        the slots it reads, leased (for :meth:`release`); its keys touched (most recently
        used); its (device-tier, host-tier) block counts; the runs gathering it into a
        slab at ``slab_ptr`` (as :meth:`StoreTable.pack_table`; a segment of
        ``VECTOR_FROM`` blocks or more is laid out by numpy, one run per block, so a large
        batch costs no Python per block). ``segments``: :class:`Segment` tuples or
        anything of their shape; ``block``: a block load's spec
        (:attr:`~xavier_async.decision.ParsedLoad.block`), which serves one block hash
        laid out as the store keeps it with no pass over its layers."""
        t = self.table
        if t is None:
            raise InvalidRequestError("the snapshot store is not started")
        if block is not None and len(block[1]) == 1:
            one = self._serve_one(t, slab_ptr, block, slot_lists)
            if one is not None:
                return one
        split, stride = t.split, t.stride
        dev_base, host_base = t.device_base, t.host_base
        touch = self.index.touch
        dst: list[int] = []
        src: list[int] = []
        ns: list[int] = []
        chunks: list[tuple[Any, Any, Any]] = []  # numpy runs, in slab order with the lists'
        read: set[int] = set()
        host = total = 0
        prev = prev_slots = None
        # the runs merge as merged_runs merges them, inline here: this is the hot path,
        # and tests/test_snapshots.py checks the result against StoreTable.pack_table
        end_d = end_s = -1  # where the last run ends, in the slab and in the store
        for (layer, keys, offset, bn, _), slots in zip(segments, slot_lists):
            if keys is not prev:
                prev = keys
                for key in keys:
                    touch(key)
            if slots != prev_slots:
                prev_slots = slots
                read.update(slots)
            d = slab_ptr + offset
            db, hb = dev_base[layer], host_base[layer]
            m = len(slots)
            total += m
            if m >= self.VECTOR_FROM:
                if ns:  # keep slab order: the runs so far first
                    chunks.append((np.array(dst, np.int64), np.array(src, np.int64),
                                   np.array(ns, np.int64)))
                    dst, src, ns = [], [], []
                sl = np.fromiter(slots, np.int64, m)
                in_host = sl >= split
                host += int(np.count_nonzero(in_host))
                chunks.append((d + bn * np.arange(m, dtype=np.int64),
                               sl * stride + np.where(in_host, hb, db), np.full(m, bn, np.int64)))
                end_d = end_s = -1
                continue
            for slot in slots:
                if slot < split:
                    s = db + slot * stride
                else:
                    s = hb + slot * stride
                    host += 1
                if d == end_d and s == end_s:
                    ns[-1] += bn
                else:
                    dst.append(d)
                    src.append(s)
                    ns.append(bn)
                d += bn
                end_d, end_s = d, s + bn
        leased = tuple(read)
        self.index.lease(leased)
        table: GatherRuns = (dst, src, ns)
        if chunks:
            if ns:
                chunks.append((np.array(dst, np.int64), np.array(src, np.int64),
                               np.array(ns, np.int64)))
            cat = [np.concatenate([c[i] for c in chunks]) for i in range(3)]
            # the host gather takes numpy; the device launcher gets Python ints, as always
            table = (cat[0], cat[1], cat[2]) if self._runs is None else (
                cat[0].tolist(), cat[1].tolist(), cat[2].tolist())
        return leased, (total - host, host), table

    def _serve_one(self, t: StoreTable, slab_ptr: int, block: BlockSpec,
                   slot_lists: Sequence[Sequence[int]],
                   ) -> tuple[tuple[int, ...], tuple[int, int], GatherRuns] | None:
        """:meth:`serve` of one block hash whose layers lie in the slab exactly as in its
        store slot (every layer, in the store's order: one run), or ``None``."""
        layers, keys, offsets, sizes = block
        start = self._contiguous.get(layers)
        if start is None:
            start = self._contiguous[layers] = self._layout_run(layers, offsets, sizes)
            if len(self._contiguous) > 64:
                self._contiguous.pop(next(iter(self._contiguous)))
        first = slot_lists[0]
        if start is False or len(first) != 1 or slot_lists.count(first) != len(slot_lists):
            return None  # (with the store every layer names the same slot: a safety net)
        slot = first[0]
        host = slot >= t.split
        src = (t.host_base if host else t.device_base)[layers[0]] + slot * t.stride
        self.index.touch(keys[0])
        leased = (slot,)
        self.index.lease(leased)
        n = len(layers)
        return leased, ((0, n) if host else (n, 0)), ([slab_ptr + offsets[0]], [src], [start])

    def _layout_run(self, layers: tuple[LayerId, ...], offsets: tuple[int, ...],
                    sizes: tuple[int, ...]) -> int | bool:
        """The bytes of one run copying a block of ``layers`` (at slab ``offsets``) from a
        store slot, if they lie there in the same order with the same gaps, else False."""
        own = self.offsets
        if any(layer not in own for layer in layers):
            return False
        base, at = own[layers[0]], offsets[0]
        for layer, o, bn in zip(layers, offsets, sizes):
            if own[layer] - base != o - at or bn != self.layout.layers[layer].block_nbytes:
                return False
        for (o, bn), o_next in zip(zip(offsets, sizes), offsets[1:]):
            if o + bn != o_next:
                return False
        return offsets[-1] + sizes[-1] - at

    def run(self, table: GatherRuns, slab: torch.Tensor | None = None) -> Any:
        """Execute a gather (a table from :meth:`serve`) into ``slab`` (the byte tensor
        its destinations lie in): on CUDA one fused launch, whose event is returned; on
        the CPU one ``index_select`` when the runs are many equal rows of one tier landing
        one after another, else memmoves."""
        if self._runs is None:
            if slab is None or not self._gather_rows(table, slab):
                run_host(_listed(table))
            return None
        return self._runs.run(table)

    def gathers(self, table: GatherRuns, slab: torch.Tensor, parts: int) -> list[Callable[[], Any]]:
        """:meth:`run` of ``table`` into ``slab`` as at most ``parts`` copies of about equal
        bytes that may run at once on as many threads (host memory; on CUDA, and for
        ``parts`` <= 1, the one copy :meth:`run` makes)."""
        if self._runs is not None or parts <= 1:
            return [functools.partial(self.run, table, slab)]
        rows = self._rows_gather(table, slab)
        if rows is not None:
            pool, index, out = rows
            cut = [len(index) * i // parts for i in range(parts + 1)]
            return [functools.partial(torch.index_select, pool, 0, index[a:b], out=out[a:b])
                    for a, b in zip(cut, cut[1:]) if b > a]
        return [functools.partial(run_host, piece) for piece in split_runs(*_listed(table), parts)]

    #: from this many runs a host gather is worth one ``index_select`` (a Python memmove
    #: per run costs about as much as moving its 8 KiB)
    ROWS_FROM = 32

    def _gather_rows(self, table: GatherRuns, slab: torch.Tensor) -> bool:
        """A block-major gather into the layer-major slab (many hashes over every layer:
        one run per (hash, layer), all the same size, landing one after another) as ONE
        ``index_select`` of pool rows into the slab, instead of a memmove per run.
        False (nothing copied) when the runs do not have that shape."""
        rows = self._rows_gather(table, slab)
        if rows is None:
            return False
        pool, index, out = rows
        torch.index_select(pool, 0, index, out=out)
        return True

    def _rows_gather(self, table: GatherRuns, slab: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(pool rows, row index, slab rows) of :meth:`_gather_rows`'s ``index_select``
        for ``table``; None when the runs do not have that shape."""
        count = len(table[2])
        if count < self.ROWS_FROM:
            return None
        dst, src, ns = (np.asarray(x, dtype=np.int64) for x in table)
        n = int(ns[0])
        d0 = int(dst[0]) - slab.data_ptr()
        if (d0 < 0 or d0 % n or d0 + count * n > slab.numel() or not (ns == n).all()
                or not (np.diff(dst) == n).all()):
            return None
        for pool in (self.device_pool, self.host_pool):
            if pool is None or not pool.numel() or pool.numel() % n:
                continue
            s = src - pool.data_ptr()
            if s.min() < 0 or s.max() + n > pool.numel() or (s % n).any():
                continue
            rows = slab.view(-1)[d0:d0 + count * n].view(count, n)
            return pool.view(-1, n), torch.from_numpy(s // n), rows
        return None

    def writable_directly(self, table: GatherRuns) -> bool:
        """Whether a gather's sources may be written to a peer straight from the store:
        host caches (both tiers are host memory), or every source in the device tier
        (the memory kind of the slabs)."""
        if self.layout.device.type == "cpu":
            return True
        pool = self.device_pool
        if pool is None:
            return False
        lo = pool.data_ptr()
        hi = lo + pool.numel()
        return all(lo <= s and s + n <= hi for s, n in zip(table[1], table[2]))

    def stats(self) -> dict[str, int]:
        """The index's counts, the block size, and the staging and demotion passes of
        :meth:`publish`: blocks staged (by either publish) and the nanoseconds the awaited
        passes took (``stage_ns``, ``demote_ns``; :meth:`publish_now` is not timed)."""
        return {**self.index.stats(), "block_bytes": self.block_bytes,
                "staged_blocks": self.staged_blocks, "stage_ns": self.stage_ns,
                "demote_ns": self.demote_ns}


def _no_memory(setting: str, nbytes: int, where: object, exc: BaseException) -> AllocationError:
    return AllocationError(f"cannot allocate the snapshot store's {nbytes} B on {where}: lower "
                           f"EndpointConfig({setting}=...) ({type(exc).__name__}: {str(exc)[:200]})")


__all__ = ["SnapshotStore", "StoreTable", "PublishResult", "DEVICE", "HOST"]

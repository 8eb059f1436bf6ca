"""Moving blocks between cache tensors and a slab (gather on the source, scatter on the
receiver).

Everything is moved as raw bytes: each cache is viewed once as ``[num_slots, block_nbytes]``
``uint8`` rows, so no copy can ever round values through another dtype (on CUDA,
``torch._foreach_copy_`` of BF16 goes through float and rewrites NaN payloads; byte rows
keep all 65,536 BF16 patterns exact).

Each segment is split into runs of consecutive slots. Few runs (the common case: one block
hash at the same slot in every layer) become slice copies, all issued in one
``torch._foreach_copy_`` call (one multi-tensor kernel on CUDA, one C++ loop on the CPU).
On the CPU the runs are ``memmove`` calls on addresses computed from validated slots and
offsets (no tensor views at all: ~0.3 us a run instead of ~3 us). Scattered slots use
``index_select``/``index_copy_`` with explicit ``torch.long`` indices, so an empty or odd
index list can never turn into floats.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence

from typing import Any

import torch

from .hostcopy import copy_runs
from .layout import LayerId
from .planning import Segment

#: a segment with more runs of consecutive slots than this uses index ops instead of slices
MAX_RUNS = 4

_foreach_copy = getattr(torch, "_foreach_copy_", None)
_memmove = ctypes.memmove
#: use memmove for runs on the CPU (False forces the tensor path; the tests cover both)
HOST_MEMMOVE = True

ByteRows = Mapping[LayerId, torch.Tensor]


def byte_rows(caches: Mapping[Any, torch.Tensor]) -> dict[LayerId, torch.Tensor]:
    """Each cache as ``[num_slots, block_nbytes]`` uint8 rows sharing its storage."""
    return {layer: t.view(t.shape[0], -1).view(torch.uint8) for layer, t in caches.items()}


def runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[(first row, first slot, length)]`` for runs of consecutive ascending slots."""
    out: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if out and slot == out[-1][1] + out[-1][2] and row == out[-1][0] + out[-1][2]:
            r, s, n = out[-1]
            out[-1] = (r, s, n + 1)
        else:
            out.append((row, slot, 1))
    return out


class SlabRows:
    """A slab seen as rows of each block size of the layout, made once: a segment whose
    offset is a whole number of blocks is then one slice, not a slice and two views."""

    def __init__(self, buf: torch.Tensor, block_sizes: Sequence[int]) -> None:
        self.buf = buf
        self.device = buf.device
        self.ptr = buf.data_ptr()
        n = buf.numel()
        self.by_size = {bn: buf[: n - n % bn].view(-1, bn) for bn in set(block_sizes)}

    def run(self, seg: Segment, row: int, n: int) -> torch.Tensor:
        """Rows ``row .. row+n`` of a segment (one slice when the offset is whole blocks)."""
        bn = seg.block_nbytes
        start, rem = divmod(seg.offset, bn)
        if rem == 0:
            return self.by_size[bn][start + row:start + row + n]
        off = seg.offset + row * bn
        return self.buf[off:off + n * bn].view(n, bn)

    def segment(self, seg: Segment, rows: int) -> torch.Tensor:
        bn = seg.block_nbytes
        start, rem = divmod(seg.offset, bn)
        if rem == 0:
            return self.by_size[bn][start:start + rows]
        return self.buf[seg.offset:seg.offset + bn * rows].view(rows, bn)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if not dsts:
        return
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0])
    elif _foreach_copy is not None:
        _foreach_copy(dsts, srcs)
    else:  # pragma: no cover - very old torch
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gather(slab: SlabRows, segments: Sequence[Segment], slot_lists: Sequence[Sequence[int]],
           rows: ByteRows) -> None:
    """Source side: copy each segment's blocks from the caches' byte rows into the slab."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    dev = slab.device
    host = dev.type == "cpu" and HOST_MEMMOVE
    for seg, slots in zip(segments, slot_lists):
        cache = rows[seg.layer]
        rs = runs(slots)
        if host and len(rs) <= MAX_RUNS:
            bn, base, cbase = seg.block_nbytes, slab.ptr + seg.offset, cache.data_ptr()
            for row, slot, n in rs:
                _memmove(base + row * bn, cbase + slot * bn, n * bn)
            continue
        if len(rs) <= MAX_RUNS:
            for row, slot, n in rs:
                dsts.append(slab.run(seg, row, n))
                srcs.append(cache[slot:slot + n])
        else:
            torch.index_select(cache, 0, torch.tensor(slots, dtype=torch.long, device=dev),
                               out=slab.segment(seg, len(slots)))
    _copy_all(dsts, srcs)
    _sync(dev)


def scatter(slab: SlabRows, segments: Sequence[Segment], rows: ByteRows,
            wait: bool = True) -> torch.cuda.Event | None:
    """Receiver side: copy each segment's blocks from the slab into their slots (a key
    listed with several slots is written to each).

    On CUDA with ``wait=False`` the copies are only enqueued on the current stream and an
    event recorded after them is returned: the slab must not be written again before that
    event has completed."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    dev = slab.device
    host = dev.type == "cpu" and HOST_MEMMOVE
    for seg in segments:
        cache = rows[seg.layer]
        if all(len(s) == 1 for s in seg.slots):
            dst_slots = [s[0] for s in seg.slots]
            rs = runs(dst_slots)
            if host and len(rs) <= MAX_RUNS:
                bn, base, cbase = seg.block_nbytes, slab.ptr + seg.offset, cache.data_ptr()
                for row, slot, n in rs:
                    _memmove(cbase + slot * bn, base + row * bn, n * bn)
                continue
            if len(rs) <= MAX_RUNS:
                for row, slot, n in rs:
                    dsts.append(cache[slot:slot + n])
                    srcs.append(slab.run(seg, row, n))
                continue
            cache.index_copy_(0, torch.tensor(dst_slots, dtype=torch.long, device=dev),
                              slab.segment(seg, len(seg.keys)))
            continue
        # one key feeds several slots
        src = slab.segment(seg, len(seg.keys))
        dst = [slot for slots in seg.slots for slot in slots]
        picks = [i for i, slots in enumerate(seg.slots) for _ in slots]
        cache.index_copy_(0, torch.tensor(dst, dtype=torch.long, device=dev),
                          src.index_select(0, torch.tensor(picks, dtype=torch.long, device=dev)))
    _copy_all(dsts, srcs)
    if dev.type == "cuda" and not wait:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(dev))
        return event
    _sync(dev)
    return None


# -- run tables: one pass of memmoves (CPU) or one fused launch (CUDA) ------------------------

class CacheTable:
    """The caches' per-layer base address and block size, made once per endpoint (the
    caches are fixed for its lifetime)."""

    __slots__ = ("rows", "base", "bn", "device")

    def __init__(self, rows: ByteRows) -> None:
        self.rows = rows
        self.base = {layer: t.data_ptr() for layer, t in rows.items()}
        self.bn = {layer: t.shape[1] for layer, t in rows.items()}
        first = next(iter(rows.values()))
        self.device = first.device


#: a run table: three parallel lists, ``dst[i] <- src[i]`` for ``n[i]`` bytes (addresses)
RunTable = tuple[list[int], list[int], list[int]]


def merged_runs(copies: Iterable[tuple[int, int, int]]) -> RunTable:
    """A run table from ``(dst, src, nbytes)`` copies in order, each merged into the one
    before it when it continues that one in both places."""
    dst: list[int] = []
    src: list[int] = []
    ns: list[int] = []
    end_d = end_s = -1  # where the last run ends, in both places
    for d, s, n in copies:
        if d == end_d and s == end_s:
            ns[-1] += n
        else:
            dst.append(d)
            src.append(s)
            ns.append(n)
        end_d, end_s = d + n, s + n
    return dst, src, ns


def _slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``[(first row, first slot, length)]``: consecutive rows to consecutive slots."""
    out: list[tuple[int, int, int]] = []
    row0 = slot0 = -2
    n = 0
    for row, slot in enumerate(slots):
        if slot == slot0 + n and n:
            n += 1
        else:
            if n:
                out.append((row0, slot0, n))
            row0, slot0, n = row, slot, 1
    if n:
        out.append((row0, slot0, n))
    return out


def unpack_table(slab_ptr: int, batch: Any, caches: CacheTable) -> RunTable:
    """Receiver: the runs copying a batch (a :class:`~xavier_async.planning.PlannedBatch`
    or anything with ``segments``) from the slab at ``slab_ptr`` into its slots."""
    dst: list[int] = []
    src: list[int] = []
    ns: list[int] = []
    parts = getattr(batch, "parts", None)
    if parts is not None:  # merged batches (xavier_async.merging): each at its base
        for at, part in parts():
            table = unpack_table(slab_ptr + at, part, caches)
            dst += table[0]
            src += table[1]
            ns += table[2]
        return dst, src, ns
    base = caches.base
    shape = getattr(batch, "shape", None)
    if shape is not None:  # uniform: one slot per key, the same slots in every layer
        slots = batch.slots
        if len(slots) == 1:  # one block hash: one run per layer
            slot = slots[0]
            return ([base[layer] + slot * bn for layer, bn in zip(shape.layers, shape.block_nbytes)],
                    [slab_ptr + o for o in shape.offsets], list(shape.block_nbytes))
        if len(set(shape.starts)) == 1 and len(set(shape.counts)) == 1:
            s0, c0 = shape.starts[0], shape.counts[0]
            same = _slot_runs(slots[s0:s0 + c0])
            if len(same) > _VECTOR_RUNS:  # many runs in every layer: one vectorized pass
                return _uniform_table(same, [base[layer] for layer in shape.layers],
                                      [slab_ptr + o for o in shape.offsets], shape.block_nbytes)
        runs_of: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for layer, s, c, o, bn in zip(shape.layers, shape.starts, shape.counts, shape.offsets,
                                      shape.block_nbytes):
            rs = runs_of.get((s, c))
            if rs is None:
                rs = runs_of[(s, c)] = _slot_runs(slots[s:s + c])
            b, p = base[layer], slab_ptr + o
            for row, slot, n in rs:
                dst.append(b + slot * bn)
                src.append(p + row * bn)
                ns.append(n * bn)
        return dst, src, ns
    for seg in batch.segments:
        b, p, bn = base[seg.layer], slab_ptr + seg.offset, seg.block_nbytes
        primary = [s[0] for s in seg.slots]
        for row, slot, n in _slot_runs(primary):
            dst.append(b + slot * bn)
            src.append(p + row * bn)
            ns.append(n * bn)
        for row, slots in enumerate(seg.slots):  # a key feeding several slots
            for slot in slots[1:]:
                dst.append(b + slot * bn)
                src.append(p + row * bn)
                ns.append(bn)
    return dst, src, ns


#: a uniform batch with more runs per layer than this builds its table with numpy
_VECTOR_RUNS = 16


def _uniform_table(rs: list[tuple[int, int, int]], bases: list[int], slab_at: list[int],
                   block_nbytes: Sequence[int]) -> RunTable:
    """The same runs ``rs`` in every layer (layer ``i``: cache base ``bases[i]``, its
    segment at ``slab_at[i]``, blocks of ``block_nbytes[i]``), as one numpy pass."""
    import numpy as np  # noqa: PLC0415 - only scattered batches get here

    r = np.asarray(rs, dtype=np.int64)
    bn = np.asarray(block_nbytes, dtype=np.int64)[:, None]
    dst = np.asarray(bases, dtype=np.int64)[:, None] + r[:, 1] * bn
    src = np.asarray(slab_at, dtype=np.int64)[:, None] + r[:, 0] * bn
    n = np.broadcast_to(r[:, 2] * bn, dst.shape)
    return dst.ravel().tolist(), src.ravel().tolist(), n.ravel().tolist()


def pack_table(slab_ptr: int, segments: Sequence[Segment], slot_lists: Sequence[Sequence[int]],
               caches: CacheTable) -> RunTable:
    """Source: the runs copying each segment's blocks (source slots ``slot_lists``) from
    the caches into the slab at ``slab_ptr``."""
    dst: list[int] = []
    src: list[int] = []
    ns: list[int] = []
    base = caches.base
    prev: Sequence[int] | None = None
    rs: list[tuple[int, int, int]] = []
    for seg, slots in zip(segments, slot_lists):
        bn = seg.block_nbytes
        if slots != prev:
            rs = _slot_runs(slots)
            prev = slots
        b, p = base[seg.layer], slab_ptr + seg.offset
        if len(rs) == 1:
            row, slot, n = rs[0]
            dst.append(p + row * bn)
            src.append(b + slot * bn)
            ns.append(n * bn)
            continue
        for row, slot, n in rs:
            dst.append(p + row * bn)
            src.append(b + slot * bn)
            ns.append(n * bn)
    return dst, src, ns


def run_host(table: RunTable) -> None:
    """Execute a run table on host memory: many runs in a few system calls with the GIL
    released once each, few runs as ``memmove`` calls (:func:`~xavier_async.hostcopy.copy_runs`)."""
    copy_runs(*table)


class DeviceRuns:
    """Executes run tables on one CUDA device: one fused launch per table (a Triton kernel
    over a ``[runs, 3]`` table of addresses, a program per chunk of each run) on the
    current stream of the device (or ``stream``), and returns an event recorded after it.
    Nothing here synchronizes the device or any stream: callers wait on the event (the
    source, before posting the WRITE) or make a stream wait on it (the receiver,
    stream-ordered).

    The host side is kept to a few microseconds (measured on an H200 host: 147 us a
    launch through the generic route, 25 us this way): the table is written with numpy
    into one of :attr:`RING` pinned host buffers that the kernel reads in place (no
    upload), the compiled kernel is launched directly after its first launch, and each
    buffer's event is reused. A buffer is rewritten only after the launch that read it
    has completed, so the event returned by :meth:`run` may later be recorded again, for
    later work on the same stream: waiting on it then waits for more, never for less."""

    #: bytes per program (a longer run gets several programs); a multiple of 16
    CHUNK = 64 * 1024
    #: pinned table buffers used in turn
    RING = 8
    #: idle programs a ``[runs, chunks]`` grid may have (beyond as many as it has busy
    #: ones) before the long runs are cut into chunks on the host instead
    MAX_IDLE = 1024

    def __init__(self, device: torch.device, stream: Any | None = None) -> None:
        import numpy  # noqa: PLC0415 - only the device path needs it

        from ._triton_runs import Launcher  # fail here, at construction, if unusable
        self._np = numpy
        self.device = device
        self.stream = stream
        self._launch = Launcher()
        self._cuda = device.type == "cuda"
        self._tables: list[torch.Tensor | None] = [None] * self.RING
        self._events: list[Any | None] = [None] * self.RING
        self._turn = 0
        #: the current stream last seen: (raw handle, torch stream)
        self._current: tuple[int, Any] | None = None

    def warm_up(self) -> None:
        """Compile the kernel's variants now (16-byte rows and any rows), each launched
        twice so the direct route is taken too: otherwise the first pack or unpack of
        each kind waits for Triton's compiler (about a second on an H200 host, longer
        than the load it serves), and so does everything else holding the GIL."""
        if not self._cuda:
            return
        with torch.cuda.device(self.device):
            buf = torch.zeros(4096, dtype=torch.uint8, device=self.device)
            p = buf.data_ptr()
            for n in (64, 3, 64, 3):
                ev = self.run(([p + 2048], [p], [n]))
                if ev is not None:
                    ev.synchronize()

    def _table(self, i: int, rows: int) -> torch.Tensor:
        """Buffer ``i`` with room for ``rows`` rows, its last reader done."""
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # nearly always complete already
        t = self._tables[i]
        if t is None or t.shape[0] < rows:
            cap = max(256, 1 << (rows - 1).bit_length())
            t = self._tables[i] = torch.empty((cap, 3), dtype=torch.int64, pin_memory=self._cuda)
        return t

    def _split(self, i: int, table: Any, pieces: Any, rows: int) -> tuple[torch.Tensor, int]:
        """Buffer ``i`` refilled with ``table``'s runs cut into chunks (one row each)."""
        np, chunk = self._np, self.CHUNK
        n = len(table)
        which = np.repeat(np.arange(n), pieces)
        off = (np.arange(rows) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * chunk
        t = self._table(i, rows)
        a = t.numpy()
        a[:rows, 0] = table[which, 0] + off
        a[:rows, 1] = table[which, 1] + off
        a[:rows, 2] = np.minimum(table[which, 2] - off, chunk)
        return t, rows

    def _stream(self) -> tuple[int, Any]:
        """(raw handle, torch stream) of the stream to launch on."""
        if self.stream is not None:
            return self.stream.cuda_stream, self.stream
        raw = _current_raw_stream(self.device)
        cur = self._current
        if cur is None or cur[0] != raw:
            s = torch.cuda.current_stream(self.device)
            cur = self._current = (s.cuda_stream, s)
        return cur

    def run(self, table: RunTable) -> Any:
        """Launch the copy; returns the event recorded after it (None on the CPU)."""
        dst, src, ns = table
        n = len(ns)
        if not n:
            return None
        chunk = self.CHUNK
        chunks = (max(ns) + chunk - 1) // chunk  # programs per row (a long run: several)
        i = self._turn
        self._turn = (i + 1) % self.RING
        t = self._table(i, n)
        a = t.numpy()
        a[:n, 0] = src
        a[:n, 1] = dst
        a[:n, 2] = ns
        rows = n
        if chunks > 1 and n * chunks > self.MAX_IDLE:
            pieces = (a[:n, 2] + (chunk - 1)) // chunk
            needed = int(pieces.sum())
            if n * chunks - needed > max(needed, self.MAX_IDLE):  # few long runs, many short:
                t, rows = self._split(i, a[:n].copy(), pieces, needed)  # split them here
                a, chunks = t.numpy(), 1
        wide = not int(self._np.bitwise_or.reduce(a[:rows], axis=None)) & 15
        if not self._cuda:  # Triton's interpreter (the CPU tests)
            self._launch(t, rows, chunks, wide, chunk, None)
            return None
        handle, stream = self._stream()
        if not self._launch(t, rows, chunks, wide, chunk, handle):
            with torch.cuda.stream(stream):  # the generic launch uses the current stream
                self._launch(t, rows, chunks, wide, chunk, None)
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(stream)
        return ev


def _current_raw_stream(device: torch.device) -> int:
    """The raw handle of the device's current CUDA stream, cheaply where torch allows."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if get is not None:
        return int(get(index))
    return int(torch.cuda.current_stream(device).cuda_stream)


def host_runs(slab: SlabRows) -> bool:
    """Whether :func:`pack` and :func:`unpack` copy ``slab``'s batches as host run tables
    (memmoves) when no ``device_runs`` is given."""
    return slab.device.type == "cpu" and HOST_MEMMOVE


def pack(slab: SlabRows, segments: Sequence[Segment], slot_lists: Sequence[Sequence[int]],
         caches: CacheTable, device_runs: DeviceRuns | None = None) -> Any:
    """Source side, one pass: copy the blocks into the slab. On the CPU, memmoves from a
    run table (any scatter); on CUDA with ``device_runs``, one fused launch whose event is
    returned (wait on it before posting the WRITE); on CUDA without, the tensor path
    (:func:`gather`), synchronized."""
    if host_runs(slab) and device_runs is None:
        run_host(pack_table(slab.ptr, segments, slot_lists, caches))
        return None
    if device_runs is not None:
        return device_runs.run(pack_table(slab.ptr, segments, slot_lists, caches))
    gather(slab, segments, slot_lists, caches.rows)
    return None


def unpack_runs(slab: SlabRows, batch: Any, caches: CacheTable,
                device_runs: DeviceRuns | None = None) -> RunTable | None:
    """The run table :func:`unpack` copies ``batch`` with (None where it scatters with
    index ops instead): pure arithmetic on the slab's address, so a receiver can make it
    while the batch's bytes are still on their way."""
    if device_runs is not None or host_runs(slab):
        return unpack_table(slab.ptr, batch, caches)
    return None


def unpack(slab: SlabRows, batch: Any, caches: CacheTable,
           device_runs: DeviceRuns | None = None, wait: bool = True,
           table: RunTable | None = None) -> Any:
    """Receiver side, one pass: copy a batch from the slab into its slots (see
    :func:`pack`). On CUDA with ``device_runs`` and ``wait=False`` the returned event must
    complete before the slab is written again, and work that reads the slots must wait on
    it (``torch.cuda.current_stream().wait_event(event)``); with ``wait=True`` only that
    event is waited for. ``table``: :func:`unpack_runs` of the same arguments, made
    earlier."""
    if host_runs(slab) and device_runs is None:
        run_host(table if table is not None else unpack_table(slab.ptr, batch, caches))
        return None
    if device_runs is not None:
        event = device_runs.run(table if table is not None else unpack_table(slab.ptr, batch, caches))
        if event is not None and wait:
            event.synchronize()
            return None
        return event
    return scatter(slab, batch.segments, caches.rows, wait=wait)

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
from collections.abc import Mapping, Sequence

from typing import Any

import torch

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

"""Moving blocks between cache tensors and a slab (gather on the source, scatter on the
receiver).

Each segment is split into runs of consecutive slots. Few runs (the common case: one block
hash at the same slot in every layer) become plain slice copies, all issued in one
``torch._foreach_copy_`` call (a single multi-tensor kernel on CUDA, one C++ loop on the
CPU). Scattered slots fall back to ``index_select``/``index_copy_`` with explicit
``torch.long`` indices, so an empty or odd index list can never turn into floats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .layout import CacheLayout, LayerId
from .planning import Segment

#: a segment with more runs of consecutive slots than this uses index ops instead of slices
MAX_RUNS = 4

_foreach_copy = getattr(torch, "_foreach_copy_", None)


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


def _segment_view(buf: torch.Tensor, seg: Segment, layout: CacheLayout, rows: int) -> torch.Tensor:
    spec = layout.layers[seg.layer]
    return buf[seg.offset:seg.offset + seg.block_nbytes * rows].view(spec.dtype).view(
        rows, *spec.block_shape)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if not dsts:
        return
    if _foreach_copy is not None:
        _foreach_copy(dsts, srcs)
    else:  # pragma: no cover - very old torch
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gather(buf: torch.Tensor, segments: Sequence[Segment], slot_lists: Sequence[Sequence[int]],
           caches: Mapping[LayerId, torch.Tensor], layout: CacheLayout) -> None:
    """Source side: copy each segment's blocks from the caches into the slab."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    dev = layout.device
    for seg, slots in zip(segments, slot_lists):
        out = _segment_view(buf, seg, layout, len(slots))
        cache = caches[seg.layer]
        rs = runs(slots)
        if len(rs) <= MAX_RUNS:
            for row, slot, n in rs:
                dsts.append(out[row:row + n])
                srcs.append(cache[slot:slot + n])
        else:
            torch.index_select(cache, 0, torch.tensor(slots, dtype=torch.long, device=dev), out=out)
    _copy_all(dsts, srcs)
    _sync(dev)


def scatter(buf: torch.Tensor, segments: Sequence[Segment], caches: Mapping[LayerId, torch.Tensor],
            layout: CacheLayout) -> None:
    """Receiver side: copy each segment's blocks from the slab into their slots (a key
    listed with several slots is written to each)."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    dev = layout.device
    for seg in segments:
        src = _segment_view(buf, seg, layout, len(seg.keys))
        cache = caches[seg.layer]
        if all(len(s) == 1 for s in seg.slots):
            dst_slots = [s[0] for s in seg.slots]
            rs = runs(dst_slots)
            if len(rs) <= MAX_RUNS:
                for row, slot, n in rs:
                    dsts.append(cache[slot:slot + n])
                    srcs.append(src[row:row + n])
                continue
            cache.index_copy_(0, torch.tensor(dst_slots, dtype=torch.long, device=dev), src)
            continue
        # one key feeds several slots
        dst = [slot for slots in seg.slots for slot in slots]
        rows = [i for i, slots in enumerate(seg.slots) for _ in slots]
        cache.index_copy_(0, torch.tensor(dst, dtype=torch.long, device=dev),
                          src.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev)))
    _copy_all(dsts, srcs)
    _sync(dev)

"""The fused copy kernel behind :class:`xavier_async.packing.DeviceRuns` (Triton; imported
only when a device copier is made, so the engine never needs Triton otherwise).

One program per row of a ``[rows, 3]`` int64 table ``(src address, dst address, nbytes)``:
raw bytes, never values, so every BF16 pattern is kept. Rows whose addresses and length
are multiples of 16 move as 16-byte words (the common case: aligned segments, block sizes
a multiple of 16), others byte by byte. ``TRITON_INTERPRET=1`` runs it on host memory.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


@triton.jit
def _copy_rows(table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0)
    src_addr = tl.load(table_ptr + row * 3)
    dst_addr = tl.load(table_ptr + row * 3 + 1)
    n = tl.load(table_ptr + row * 3 + 2)
    if WIDE:
        src = src_addr.to(tl.pointer_type(tl.int64))
        dst = dst_addr.to(tl.pointer_type(tl.int64))
        words = n // 8
        for start in range(0, CHUNK // 8, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
    else:
        src8 = src_addr.to(tl.pointer_type(tl.uint8))
        dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
        for start in range(0, CHUNK, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst8 + offs, tl.load(src8 + offs, mask=m), mask=m)


def launch(table: Any, rows: int, host_rows: list[tuple[int, int, int]], chunk: int) -> None:
    """Copy every row of ``table`` (device-resident, first ``rows`` rows) in one launch."""
    wide = all(s % 16 == 0 and d % 16 == 0 and n % 16 == 0 for s, d, n in host_rows)
    _copy_rows[(rows,)](table, CHUNK=chunk, BLOCK=1024, WIDE=wide)

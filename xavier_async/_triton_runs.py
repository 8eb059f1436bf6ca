"""The fused copy kernel behind :class:`xavier_async.packing.DeviceRuns` (Triton; imported
only when a device copier is made, so the engine never needs Triton otherwise).

A ``[rows, chunks]`` grid over a ``[rows, 3]`` int64 table ``(src address, dst address,
nbytes)``: program ``(r, c)`` copies bytes ``c * CHUNK`` up to ``(c + 1) * CHUNK`` of row
``r`` (nothing when the row is shorter), so a long run needs no splitting on the host. Raw
bytes, never values, so every BF16 pattern is kept. Rows whose addresses and length are
multiples of 16 move as 8-byte words (the common case: aligned segments, block sizes a
multiple of 16; ``CHUNK`` is a multiple of 16, so every chunk stays aligned), others byte
by byte. ``TRITON_INTERPRET=1`` runs it on host memory.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl


@triton.jit
def _copy_rows(table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * CHUNK
    src_addr = tl.load(table_ptr + row * 3) + start
    dst_addr = tl.load(table_ptr + row * 3 + 1) + start
    n = tl.load(table_ptr + row * 3 + 2) - start  # bytes of this row from this chunk on
    if WIDE:
        src = src_addr.to(tl.pointer_type(tl.int64))
        dst = dst_addr.to(tl.pointer_type(tl.int64))
        words = n // 8
        for first in range(0, CHUNK // 8, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            m = offs < words
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)
    else:
        src8 = src_addr.to(tl.pointer_type(tl.uint8))
        dst8 = dst_addr.to(tl.pointer_type(tl.uint8))
        for first in range(0, CHUNK, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst8 + offs, tl.load(src8 + offs, mask=m), mask=m)


BLOCK = 1024


class Launcher:
    """Launches :func:`_copy_rows` over a ``[rows, 3]`` table as a ``[rows, chunks]`` grid.
    The first launch of each variant goes through Triton's generic route (compiling it);
    later ones call the compiled kernel directly, which skips ~15 us of argument binding
    per launch. Where a Triton version's compiled kernels cannot be called that way, every
    launch takes the generic route."""

    def __init__(self) -> None:
        self._compiled: dict[tuple[bool, int], Any] = {}
        self.direct = True

    def __call__(self, table: Any, rows: int, chunks: int, wide: bool, chunk: int,
                 stream: int | None) -> bool:
        """Launch on raw CUDA stream ``stream``; with ``None`` (or when the direct call is
        not available yet) the generic route launches on the current stream and ``False``
        is returned when a stream was asked for, so the caller can make it current."""
        if stream is not None:
            k = self._compiled.get((wide, chunk))
            if k is None or not self.direct:
                return False
            try:
                k.run(rows, chunks, 1, stream, k.function, k.packed_metadata, None, None, None,
                      table, chunk, BLOCK, wide)
                return True
            except (TypeError, ValueError, AttributeError):  # another Triton: generic route
                self.direct = False
                return False
        compiled = _copy_rows[(rows, chunks)](table, CHUNK=chunk, BLOCK=BLOCK, WIDE=wide)
        if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            self._compiled[(wide, chunk)] = compiled
        return True

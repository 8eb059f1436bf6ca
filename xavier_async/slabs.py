"""Persistent slabs: one allocation per direction, a full view and a small prefix view.

Both views share the allocation and keep their identity for the endpoint's lifetime, so a
transport that keys registrations on buffer identity registers each exactly once.

An endpoint owns a pool of each: ``send_slabs`` send slabs and ``receive_slabs`` receive
slabs, all registered once at start; every copy borrows one of each (lending:
:mod:`xavier_async.fairpool`; the receiver's pooled, spare and fenced receive slabs:
:mod:`xavier_async.recvslabs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import AllocationError, InvalidRequestError
from .sizes import DEFAULT_FULL_BYTES, DEFAULT_SMALL_BYTES, FULL, SMALL, KiB, MiB, SlabSizes, View

__all__ = ["DEFAULT_FULL_BYTES", "DEFAULT_SMALL_BYTES", "KiB", "MiB", "Slab", "SlabView",
           "allocate_slabs", "allocate_slab", "slab_sizes", "payload_digest"]


@dataclass(eq=False)
class SlabView:
    """A persistent prefix of a :class:`Slab` (``name`` is ``"full"`` or ``"small"``)."""

    slab: Slab
    name: View
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def __repr__(self) -> str:
        return f"SlabView({self.slab.direction}/{self.name}, {self.nbytes} B)"


@dataclass(eq=False)
class Slab:
    """One pre-allocated byte buffer (``direction`` is ``"send"`` or ``"recv"``)."""

    direction: str
    tensor: torch.Tensor
    small_bytes: int
    #: slabs are numbered within their pool (a load names the receive slab it is written
    #: into, a mapping the send slab it reads); 0 is the first
    index: int = 0
    full: SlabView = field(init=False)
    small: SlabView = field(init=False)

    def __post_init__(self) -> None:
        self.full = SlabView(self, FULL, self.tensor)
        # equal sizes: one view (the small view *is* the full one, mapped once)
        self.small = (SlabView(self, SMALL, self.tensor[: self.small_bytes])
                      if self.small_bytes < self.tensor.numel() else self.full)

    def __getitem__(self, view: View) -> SlabView:
        """A view by name (``"full"`` or ``"small"``)."""
        if view == FULL:
            return self.full
        if view == SMALL:
            return self.small
        raise InvalidRequestError(f"unknown view {view!r}: views are 'full' and 'small'")

    @property
    def views(self) -> tuple[SlabView, SlabView]:
        return (self.full, self.small)

    def view(self, nbytes: int) -> SlabView:
        """The view of exactly ``nbytes`` bytes; anything else is an error."""
        for v in self.views:
            if v.nbytes == nbytes:
                return v
        raise InvalidRequestError(
            f"unknown view size {nbytes} B: this slab has views of "
            f"{self.full.nbytes} B (full) and {self.small.nbytes} B (small)")

    @property
    def device(self) -> torch.device:
        return self.tensor.device


def slab_sizes(full_bytes: int | None, small_bytes: int | None) -> tuple[int, int]:
    """Validated ``(full, small)``; small defaults to ``min(full, 256 KiB)`` (see :class:`SlabSizes`)."""
    sizes = SlabSizes.of(full_bytes, small_bytes)
    return sizes.full, sizes.small


def allocate_slabs(full_bytes: int, small_bytes: int, device: torch.device) -> tuple[Slab, Slab]:
    """One send and one receive slab (the pool's first ones)."""
    send, recv = (allocate_slab(direction, full_bytes, small_bytes, device)
                  for direction in ("send", "recv"))
    return send, recv


def allocate_slab(direction: str, full_bytes: int, small_bytes: int, device: torch.device,
                  index: int = 0) -> Slab:
    """One slab of ``direction`` (``"send"`` or ``"recv"``), numbered ``index``;
    :class:`AllocationError` where the memory is not there."""
    try:
        memory = torch.zeros(full_bytes, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch's CPU allocator / CUDA OOM
        raise AllocationError(f"cannot allocate a {direction} slab of full_bytes={full_bytes} "
                              f"on {device}: lower EndpointConfig(full_bytes=...) "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    return Slab(direction, memory, small_bytes, index)


def payload_digest(buf: torch.Tensor, nbytes: int) -> str:
    """A cheap digest of the first ``nbytes`` bytes of a uint8 tensor, computed where the
    tensor lives (on the GPU for VRAM: no host copy of the payload; one small result is
    read back). Two wrapping int64 sums over 8-byte words, one plain and one weighted by
    position (through a prefix sum), plus the tail bytes: it catches garbage, zeroed,
    stale, shifted and reordered payloads, not an adversary."""
    words = nbytes // 8
    parts = []
    if words:
        w = buf[: words * 8].view(torch.int64)
        parts += [w.sum(), w.cumsum(0).sum()]
    if nbytes % 8:
        tail = buf[words * 8: nbytes].to(torch.int64)
        parts.append((tail * torch.arange(1, tail.numel() + 1, device=buf.device)).sum())
    values = torch.stack(parts).tolist() if parts else []
    return f"{nbytes}:" + ",".join(format(v & 0xFFFFFFFFFFFFFFFF, "x") for v in values)

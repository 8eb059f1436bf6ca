"""Persistent slabs: one allocation per direction, a full view and a small prefix view.

Both views share the allocation and keep their identity for the endpoint's lifetime, so a
transport that keys registrations on buffer identity registers each exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError
from .sizes import DEFAULT_FULL_BYTES, DEFAULT_SMALL_BYTES, FULL, SMALL, KiB, MiB, SlabSizes, View

__all__ = ["DEFAULT_FULL_BYTES", "DEFAULT_SMALL_BYTES", "KiB", "MiB", "Slab", "SlabView",
           "allocate_slabs", "slab_sizes"]


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
    """The endpoint's two allocations: (send, receive). Nothing else is ever allocated for copies."""
    send, recv = (Slab(direction, torch.zeros(full_bytes, dtype=torch.uint8, device=device), small_bytes)
                  for direction in ("send", "recv"))
    return send, recv

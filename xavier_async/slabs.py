"""Persistent slabs: one allocation per direction, a full view and a small prefix view.

Both views share the allocation and keep their identity for the endpoint's lifetime, so a
transport that keys registrations on buffer identity registers each exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError
from .policy import FULL, SMALL, check_size

KiB = 1024
MiB = 1024 * KiB
DEFAULT_FULL_BYTES = 12 * MiB
DEFAULT_SMALL_BYTES = 256 * KiB


@dataclass(eq=False)
class SlabView:
    """A persistent prefix of a :class:`Slab` (``name`` is ``"full"`` or ``"small"``)."""

    slab: Slab
    name: str
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
        self.small = SlabView(self, SMALL, self.tensor[: self.small_bytes])

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
    """Validate sizes; small defaults to ``min(full, 256 KiB)``."""
    full = check_size("full_bytes", DEFAULT_FULL_BYTES if full_bytes is None else full_bytes)
    small = min(full, DEFAULT_SMALL_BYTES) if small_bytes is None else check_size("small_bytes", small_bytes)
    if small > full:
        raise InvalidRequestError(f"small_bytes ({small}) must not exceed full_bytes ({full})")
    return full, small


def allocate_slabs(full_bytes: int, small_bytes: int, device: torch.device) -> tuple[Slab, Slab]:
    """The endpoint's two allocations: (send, receive). Nothing else is ever allocated for copies."""
    return tuple(  # type: ignore[return-value]
        Slab(direction, torch.zeros(full_bytes, dtype=torch.uint8, device=device), small_bytes)
        for direction in ("send", "recv"))

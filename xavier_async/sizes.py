"""Slab sizes and view names (pure): one validated value shared by the config, the channel
policy, the slabs and the hello.

A slab has two persistent views: ``full`` (the whole slab) and ``small`` (a prefix of it).
Views are addressed by name everywhere; their byte counts come from one :class:`SlabSizes`.
When the small size equals the full size there is only one view: ``small`` *is* ``full``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from ._checks import check_size
from .errors import InvalidRequestError

KiB: Final = 1024
MiB: Final = 1024 * KiB
DEFAULT_FULL_BYTES: Final = 12 * MiB
DEFAULT_SMALL_BYTES: Final = 256 * KiB

View = Literal["full", "small"]
FULL: Final = "full"
SMALL: Final = "small"


@dataclass(frozen=True)
class SlabSizes:
    """The full slab and its small prefix view, in bytes (validated once, here)."""

    full: int = DEFAULT_FULL_BYTES
    small: int = DEFAULT_SMALL_BYTES

    def __post_init__(self) -> None:
        full = check_size("full_bytes", self.full)
        small = check_size("small_bytes", self.small)
        if small > full:
            raise InvalidRequestError(f"small_bytes ({small}) must not exceed full_bytes ({full})")
        object.__setattr__(self, "full", full)
        object.__setattr__(self, "small", small)

    @classmethod
    def of(cls, full_bytes: object = None, small_bytes: object = None) -> SlabSizes:
        """Sizes with defaults: full 12 MiB, small ``min(full, 256 KiB)``."""
        full = check_size("full_bytes", DEFAULT_FULL_BYTES if full_bytes is None else full_bytes)
        small = min(full, DEFAULT_SMALL_BYTES) if small_bytes is None else check_size("small_bytes", small_bytes)
        return cls(full, small)

    @property
    def distinct(self) -> bool:
        """Whether the small view is a real prefix (smaller than the full slab)."""
        return self.small < self.full

    def view_for(self, view: View) -> View:
        """The view actually used for ``view``: ``small`` collapses to ``full`` when the two
        sizes are equal (one view, one mapping)."""
        return view if self.distinct else FULL

    def nbytes(self, view: View) -> int:
        """Bytes of a view."""
        return self.small if view == SMALL else self.full

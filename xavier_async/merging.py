"""Merging batches that wait for a receive slab (pure core, no I/O).

When every receive slab is busy, batches from one source that wait behind each other are
merged into one :class:`LoadGroup`: one request, one copy, one unpack. A group forms only
while it waits for a slab, so an unloaded endpoint never merges (nothing waits) and a
loaded one pays one round trip per group instead of one per batch.

A group holds batches of one source and one head-of-line class: small batches (at most
the small view) merge up to the small view (or ``EndpointConfig.merge_small_bytes``), so a
group of small batches keeps its small place in the slab queue; large ones merge up to
the full slab. Each member's segments sit at an aligned base in the slab; the wire form
is the members' wire forms one after the other, and since every segment offset is
aligned, the source computes exactly the same offsets from it
(:func:`~xavier_async.planning.segments_from_wire`).

A member cancelled before its group starts leaves it (it takes nothing); once the group
has started (its request is about to go out), a cancelled member is still copied but not
unpacked: its slots keep their contents, as for a single batch.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from .layout import SEGMENT_ALIGN, align_up
from .planning import PlannedBatch, Segment


def own_copy(error: BaseException) -> BaseException:
    """A copy of ``error`` with its own notes (its cause and traceback kept)."""
    try:
        c = copy.copy(error)
    except Exception:  # an exception that cannot be rebuilt from its args
        return error
    c.__cause__, c.__context__ = error.__cause__, error.__context__
    c.__traceback__ = error.__traceback__
    notes = getattr(error, "__notes__", None)
    if notes is not None:
        c.__notes__ = list(notes)
    return c


class Moved(NamedTuple):
    """What one round trip moved: bytes on the wire, and the blocks its source served from
    its snapshot store's device and host tiers (the rest came from its live slots)."""

    wire_bytes: int
    device_blocks: int = 0
    host_blocks: int = 0

    def share(self, part: int, whole: int) -> Moved:
        """``part / whole`` of each figure (a merged batch's member, by payload)."""
        whole = whole or 1
        return Moved(self.wire_bytes * part // whole, self.device_blocks * part // whole,
                     self.host_blocks * part // whole)


class Member:
    """One batch of a :class:`LoadGroup`, at ``base`` in the slab."""

    __slots__ = ("batch", "base", "cancelled", "moved", "error", "settled")

    def __init__(self, batch: PlannedBatch, base: int) -> None:
        self.batch = batch
        self.base = base
        #: cancelled after the group started: copied, not unpacked
        self.cancelled = False
        #: the member's share of the group's copy, once it landed
        self.moved = Moved(0)
        self.error: BaseException | None = None
        #: its outcome is known (``moved`` or ``error``)
        self.settled = False

    @property
    def wire_bytes(self) -> int:
        return self.moved.wire_bytes

    def land(self, moved: Moved) -> None:
        self.moved, self.settled = moved, True

    def fail(self, error: BaseException) -> None:
        """Give the member ``error`` (its own copy: each load adds its own notes)."""
        if not self.settled:
            self.error, self.settled = own_copy(error), True


class LoadGroup:
    """Batches of one source merged into one copy; accepts members until it starts.

    ``limit``: the largest merged payload (the small view for small batches, the full slab
    for large ones). The round trip that carries a group is the receiver's
    (:class:`xavier_async.scheduling.GroupRun`)."""

    __slots__ = ("src", "large", "limit", "members", "nbytes", "started")

    def __init__(self, src: int, large: bool, limit: int) -> None:
        self.src, self.large, self.limit = src, large, limit
        self.members: list[Member] = []
        #: the payload end of the members so far
        self.nbytes = 0
        #: set when the group takes its slab: no member joins or leaves after that
        self.started = False

    def fits(self, batch: PlannedBatch) -> bool:
        """Whether ``batch`` can still join (the group has not started and has room)."""
        return not self.started and align_up(self.nbytes, SEGMENT_ALIGN) + batch.nbytes <= self.limit

    def _place(self, m: Member) -> None:
        """Put ``m`` at the next aligned base after the members so far (the one layout rule)."""
        m.base = align_up(self.nbytes, SEGMENT_ALIGN)
        self.nbytes = m.base + m.batch.nbytes

    def add(self, batch: PlannedBatch) -> Member:
        if not self.fits(batch):
            raise ValueError("the batch does not fit this group")
        m = Member(batch, 0)
        self._place(m)
        self.members.append(m)
        return m

    def remove(self, member: Member) -> None:
        """A member cancelled before the group started: it leaves, and later members move
        down (the group's payload is laid out again)."""
        if self.started:
            raise ValueError("a started group keeps its members")
        self.members.remove(member)
        self.nbytes = 0
        for m in self.members:
            self._place(m)

    def merged(self) -> MergedBatch:
        """The group as one batch (what is requested and copied)."""
        return MergedBatch(self.src, self.members, self.nbytes)

    def share(self, moved: Moved) -> None:
        """Charge each member its share of the copy (by payload)."""
        total = sum(m.batch.nbytes for m in self.members)
        for m in self.members:
            m.land(moved.share(m.batch.nbytes, total))

    def fail(self, error: BaseException) -> None:
        """Every member whose outcome is not known yet fails with ``error``."""
        for m in self.members:
            m.fail(error)


class MergedBatch:
    """Members as one batch: what the receiver requests (:meth:`wire`) and copies
    (``nbytes``). :meth:`parts` names what is unpacked: every member not cancelled."""

    __slots__ = ("src", "members", "nbytes")

    def __init__(self, src: int, members: list[Member], nbytes: int) -> None:
        self.src, self.members, self.nbytes = src, members, nbytes

    def wire(self) -> list[Any]:
        """The members' wire forms back to back (each starts with explicit keys)."""
        out: list[Any] = []
        for m in self.members:
            out.extend(m.batch.wire())
        return out

    def parts(self) -> list[tuple[int, PlannedBatch]]:
        """``(base, batch)`` of each member to unpack (those not cancelled)."""
        return [(m.base, m.batch) for m in self.members if not m.cancelled]

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments to unpack, at their offsets in the slab."""
        return tuple(seg._replace(offset=seg.offset + base)
                     for base, batch in self.parts() for seg in batch.segments)

    @property
    def useful_bytes(self) -> int:
        return sum(m.batch.useful_bytes for m in self.members)

    @property
    def blocks(self) -> int:
        return sum(m.batch.blocks for m in self.members)

    def __repr__(self) -> str:
        return f"MergedBatch(src={self.src}, nbytes={self.nbytes}, members={len(self.members)})"


__all__ = ["LoadGroup", "Member", "MergedBatch", "Moved", "own_copy"]

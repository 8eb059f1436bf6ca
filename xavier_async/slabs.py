"""Persistent slabs: one allocation per direction, a full view and a small prefix view.

Both views share the allocation and keep their identity for the endpoint's lifetime, so a
transport that keys registrations on buffer identity registers each exactly once.

A receiver may own more than one receive slab: :class:`RecvSlabs` *fences* a slab that a
lost or timed-out source might still write (a one-sided write cannot be revoked by its
target) and loads carry on in another one, registered once; the fenced slab is released
only when its stale writer is provably done.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import InvalidRequestError
from .sizes import DEFAULT_FULL_BYTES, DEFAULT_SMALL_BYTES, FULL, SMALL, KiB, MiB, SlabSizes, View

__all__ = ["DEFAULT_FULL_BYTES", "DEFAULT_SMALL_BYTES", "KiB", "MiB", "Slab", "SlabView",
           "allocate_slabs", "slab_sizes", "RecvSlabs", "Fenced", "payload_digest"]


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
    #: receive slabs are numbered (a load names the one it is written into); 0 is the first
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
    """The endpoint's two allocations: (send, receive). Nothing else is ever allocated for copies."""
    send, recv = (Slab(direction, torch.zeros(full_bytes, dtype=torch.uint8, device=device), small_bytes)
                  for direction in ("send", "recv"))
    return send, recv


def allocate_recv_slab(full_bytes: int, small_bytes: int, device: torch.device, index: int) -> Slab:
    """One more receive slab (a fenced one's replacement)."""
    return Slab("recv", torch.zeros(full_bytes, dtype=torch.uint8, device=device), small_bytes, index)


@dataclass(frozen=True, slots=True)
class Fenced:
    """A receive slab that ``peer`` (endpoint instance ``incarnation``) may still write,
    for request ``req_id``."""

    slab: int
    peer: int
    incarnation: str
    req_id: int


class RecvSlabs:
    """The receiver's receive slabs: one *active* (loads are written there), *spares*
    (registered, released after a fence) and *fenced* ones (pure bookkeeping; the endpoint
    registers new slabs with its transport).

    Invariant: a fenced slab is never active and never a spare, so no load reads a slab
    that a stale writer may still target."""

    def __init__(self, first: Slab) -> None:
        self.slabs: dict[int, Slab] = {first.index: first}
        self.active: int | None = first.index
        self.spares: list[int] = []
        self.fenced: dict[int, Fenced] = {}
        #: how many slabs were fenced, released by a late reply, released by a reconnect
        self.fences = self.released_late = self.released_reconnect = 0

    @property
    def current(self) -> Slab | None:
        return None if self.active is None else self.slabs[self.active]

    @property
    def next_index(self) -> int:
        return max(self.slabs) + 1

    def fence(self, peer: int, incarnation: str, req_id: int) -> None:
        """Fence the active slab (``peer`` may still write it for ``req_id``) and make a
        spare active, if there is one (else :attr:`active` is ``None``: add a slab)."""
        if self.active is None:
            return
        self.fenced[self.active] = Fenced(self.active, peer, incarnation, req_id)
        self.fences += 1
        self.active = self.spares.pop() if self.spares else None

    def add(self, slab: Slab) -> None:
        """A newly registered slab becomes the active one."""
        assert slab.index not in self.slabs
        self.slabs[slab.index] = slab
        if self.active is None:
            self.active = slab.index
        else:
            self.spares.append(slab.index)

    def _release(self, index: int) -> None:
        del self.fenced[index]
        if self.active is None:
            self.active = index
        else:
            self.spares.append(index)

    def release_reply(self, peer: int, req_id: int) -> bool:
        """The stale writer's reply for ``req_id`` arrived: its write is terminal."""
        for f in list(self.fenced.values()):
            if f.peer == peer and f.req_id == req_id:
                self._release(f.slab)
                self.released_late += 1
                return True
        return False

    def release_peer(self, peer: int, incarnation: str) -> int:
        """The same endpoint instance reconnected and vouches that none of its writes to
        us can still land: every slab fenced for it is released."""
        n = 0
        for f in list(self.fenced.values()):
            if f.peer == peer and f.incarnation == incarnation and incarnation:
                self._release(f.slab)
                n += 1
        self.released_reconnect += n
        return n

    def stats(self) -> dict[str, int]:
        return {"registered": len(self.slabs), "fenced_now": len(self.fenced),
                "spares": len(self.spares), "fences": self.fences,
                "released_late": self.released_late, "released_reconnect": self.released_reconnect}


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

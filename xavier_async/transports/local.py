"""In-process transport: endpoints in one process copy real bytes between their slabs.

The default for unit tests and for trying the library. It keeps the same contract as
NIXL: slabs are "registered" once, a mapping is made per (peer, view), a write copies
equal-length ranges and then delivers its notification.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from .._checks import check_number
from ..errors import (EndpointClosedError, HandshakeError, InternalError, InvalidRequestError,
                      PeerLostError, TransferError, UnknownPeerError)
from ..slabs import SlabView
from .base import TaskSpawner, Transport

if TYPE_CHECKING:
    from ..slabs import Slab
    from .base import TransportHost


@dataclass(frozen=True, slots=True)
class LocalMapping:
    """A send view mapped to one of the peer's receive slabs."""

    view: SlabView
    slab: int


class LocalFabric:
    """The "network" that in-process endpoints share: an address book."""

    def __init__(self) -> None:
        self._endpoints: dict[str, LocalTransport] = {}
        self._names = itertools.count()

    def _join(self, t: LocalTransport) -> str:
        address = f"local://{next(self._names)}"
        self._endpoints[address] = t
        return address

    def _leave(self, address: str) -> None:
        self._endpoints.pop(address, None)

    def lookup(self, address: str) -> LocalTransport:
        t = self._endpoints.get(address)
        if t is None:
            raise HandshakeError(f"no endpoint listens at {address!r}")
        return t

    def transport(self) -> LocalTransport:
        """A new transport on this fabric, for one endpoint."""
        return LocalTransport(self)


class LocalTransport(Transport):
    """Copies with ``torch.Tensor.copy_`` between endpoints of one process."""

    name = "local"

    @property
    def direct_writes(self) -> bool:  # type: ignore[override]
        """Host memory only: a region write is a memmove into the peer's receive slab."""
        layout = getattr(getattr(self, "_owner", None), "layout", None)
        return layout is None or layout.device.type == "cpu"

    def __init__(self, fabric: LocalFabric | None = None) -> None:
        super().__init__()
        self.fabric = fabric if fabric is not None else LocalFabric()
        self._address: str | None = None
        self._peers: dict[int, LocalTransport] = {}
        self._mappings: dict[int, set[tuple[int, str, int]]] = {}
        self.host: TransportHost | None = None
        self.send_slab: Slab | None = None
        #: send slabs by index
        self.send_slabs: dict[int, Slab] = {}
        #: receive slabs by index (a fenced slab's replacement is added later)
        self.recv_slabs: dict[int, Slab] = {}

    @property
    def recv_slab(self) -> Slab | None:
        """The first receive slab."""
        return self.recv_slabs.get(0)

    async def start(self, host: TransportHost, send: Slab, recv: Slab, tg: TaskSpawner) -> None:
        self.host, self.send_slab = host, send
        self.send_slabs = {send.index: send}
        self.recv_slabs = {recv.index: recv}
        self.memory_registrations += 2
        self._address = self.fabric._join(self)

    async def add_send_slab(self, slab: Slab) -> None:
        await anyio.lowlevel.checkpoint()
        self.send_slabs[slab.index] = slab
        self.memory_registrations += 1

    async def add_recv_slab(self, slab: Slab) -> None:
        if slab.index in self.recv_slabs:
            raise InvalidRequestError(f"receive slab {slab.index} is already registered")
        await anyio.lowlevel.checkpoint()
        self.recv_slabs[slab.index] = slab
        self.memory_registrations += 1

    @property
    def address(self) -> str:
        if self._address is None:
            raise EndpointClosedError("the local transport is not started (it starts with its "
                                      "endpoint: `async with Endpoint(...)`)")
        return self._address

    @property
    def _me(self) -> TransportHost:
        """The endpoint this transport serves (from :meth:`start` on)."""
        if self.host is None:
            raise InternalError("the local transport is used before start()")
        return self.host

    def _peer(self, peer: int) -> LocalTransport:
        t = self._peers.get(peer)
        if t is None:
            raise UnknownPeerError(f"rank {peer} is not connected")
        if t._address is None:
            raise PeerLostError(f"rank {peer} has closed")
        return t

    async def connect(self, address: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        if timeout is not None:
            check_number("timeout", timeout, strictly_positive=True)
        await anyio.lowlevel.checkpoint()
        other = self.fabric.lookup(address)
        me, them = self._me, other._me
        mine, theirs = me.hello(), them.hello()
        if self._peers.get(theirs["rank"]) is other and other._peers.get(mine["rank"]) is self:
            return theirs["rank"], theirs  # already connected (either end dialled): idempotent
        me.check_hello(theirs)
        them.check_hello(mine)
        self._peers[theirs["rank"]] = other
        other._peers[mine["rank"]] = self
        them.peer_joined(mine["rank"], mine)
        me.peer_joined(theirs["rank"], theirs)
        return theirs["rank"], theirs

    async def map_view(self, peer: int, view: SlabView, slab: int = 0) -> object:
        await anyio.lowlevel.checkpoint()
        other = self._peer(peer)
        if self.send_slabs.get(view.slab.index) is not view.slab:
            raise InvalidRequestError(f"{view} is not a view of this endpoint's send slabs")
        target = other.recv_slabs.get(slab)
        if target is None:
            raise InvalidRequestError(f"rank {peer} has no receive slab {slab}")
        if target[view.name].nbytes != view.nbytes:  # the peer must have the same view
            raise InvalidRequestError(f"rank {peer} has no receive view like {view}")
        self._mappings.setdefault(peer, set()).add((view.slab.index, view.name, slab))
        return LocalMapping(view, slab)

    def peer_recv_slabs(self, peer: int) -> tuple[int, ...]:
        return tuple(sorted(self._peer(peer).recv_slabs))

    def target(self, peer: int, mapping: object) -> tuple[LocalTransport, torch.Tensor]:
        """The peer and the receive slab tensor a mapping writes into (fault injection
        uses it to land a write after the connection is gone)."""
        other = self._peer(peer)
        if not isinstance(mapping, LocalMapping) or (
                mapping.view.slab.index, mapping.view.name, mapping.slab) not in self._mappings.get(peer, ()):
            raise TransferError(f"{mapping!r} is not mapped for rank {peer}")
        return other, other.recv_slabs[mapping.slab].tensor

    def post(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        other, dst = self.target(peer, mapping)  # (a LocalMapping of ours, or an error)
        dst[:nbytes].copy_(mapping.view.tensor[:nbytes])  # type: ignore[attr-defined]
        if notify is not None:
            other._me.deliver(self._me.rank, notify)
        return None

    def post_regions(self, peer: int, regions: tuple[tuple[int, int, int], ...], slab: int,
                     notify: bytes | None) -> object | None:
        other = self._peer(peer)
        target = other.recv_slabs.get(slab)
        if target is None:
            raise InvalidRequestError(f"rank {peer} has no receive slab {slab}")
        dst = target.tensor
        if dst.device.type != "cpu":
            raise InvalidRequestError("the local transport writes regions into host memory only")
        base, end = dst.data_ptr(), dst.data_ptr() + dst.numel()
        for _, off, n in regions:
            if off < 0 or base + off + n > end:
                raise InvalidRequestError(f"a region of {n} B at {off} does not fit receive slab {slab}")
        for addr, off, n in regions:
            ctypes.memmove(base + off, addr, n)
        if notify is not None:
            other._me.deliver(self._me.rank, notify)
        return None

    async def wait(self, pending: object) -> None:
        raise InternalError("local copies complete in post(): there is nothing to wait for")

    async def send(self, peer: int, msg: bytes) -> None:
        other = self._peer(peer)
        other._me.deliver(self._me.rank, msg)
        await anyio.lowlevel.checkpoint()

    async def forget(self, peer: int) -> None:
        self._mappings.pop(peer, None)

    async def disconnect(self, peer: int) -> None:
        self._mappings.pop(peer, None)
        other = self._peers.pop(peer, None)
        # a connection has two ends: once we drop the peer it can no longer write into our
        # receive slab either (a copy it still has under way fails instead of landing)
        if other is not None and self.host is not None and other._peers.get(self.host.rank) is self:
            del other._peers[self.host.rank]
            other._mappings.pop(self.host.rank, None)
            if other.host is not None and other._address is not None:
                other.host.peer_lost(self.host.rank,
                                     PeerLostError(f"rank {self.host.rank} disconnected"))

    async def aclose(self) -> None:
        if self._address is None:
            return
        address, self._address = self._address, None
        self.fabric._leave(address)
        me = self._me.rank
        for rank, other in list(self._peers.items()):
            if other.host is not None and other._address is not None:
                other.host.peer_lost(me, PeerLostError(f"rank {me} closed"))
            other._peers.pop(me, None)
        self._peers.clear()
        self._mappings.clear()

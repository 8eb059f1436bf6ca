"""Fault injection around any transport, deterministic from a seed.

Wrap the transport of one endpoint to make its registrations fail, its writes fail or
stall, or a peer vanish, either at random (seeded) or on demand::

    plan = FaultPlan(seed=7, registration_failure_rate=0.5)
    transport = FaultyTransport(LocalTransport(fabric), plan)
    transport.fail_next_writes(1)

Used by the failure-model tests, and by users who want to see how their stack reacts.
"""

from __future__ import annotations

import ctypes
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from .._checks import check_bool, check_int, check_number
from ..errors import PeerLostError, TransferError
from ..transports.base import TaskSpawner, Transport

if TYPE_CHECKING:
    import torch

    from ..slabs import Slab, SlabView
    from ..transports.base import TransportHost


@dataclass
class FaultPlan:
    """Random faults, drawn from ``random.Random(seed)`` so a run is reproducible."""

    seed: int = 0
    registration_failure_rate: float = 0.0
    write_failure_rate: float = 0.0
    write_stall_rate: float = 0.0
    stall_seconds: float = 0.05
    #: ``{peer rank: n}``: the peer is lost when our n-th write to it starts
    lose_peer_after_writes: dict[int, int] = field(default_factory=dict)
    #: fraction of writes whose first payload byte is flipped in flight
    corruption_rate: float = 0.0
    #: a stalled write whose connection ended meanwhile still lands, like a one-sided
    #: NIXL WRITE the receiver cannot revoke (needs a LocalTransport inside)
    late_writes_land: bool = False
    #: every slab registered after start (``add_send_slab``, ``add_recv_slab``: a
    #: fenced slab's replacement) takes this many seconds first, like a real memory
    #: registration, so that concurrent registrations overlap
    register_seconds: float = 0.0

    def __post_init__(self) -> None:
        check_int("seed", self.seed)
        for name in ("registration_failure_rate", "write_failure_rate", "write_stall_rate",
                     "corruption_rate"):
            setattr(self, name, check_number(name, getattr(self, name), maximum=1.0))
        self.stall_seconds = check_number("stall_seconds", self.stall_seconds)
        check_bool("late_writes_land", self.late_writes_land)


@dataclass
class FaultCounts:
    """What a :class:`FaultyTransport` has injected so far (``transport.injected``)."""

    registrations_failed: int = 0
    writes_failed: int = 0
    writes_stalled: int = 0
    peers_lost: int = 0
    writes_corrupted: int = 0
    #: stalled writes that landed after their connection had ended
    late_writes_landed: int = 0


@dataclass(eq=False)
class _Stalled:
    peer: int
    mapping: object
    nbytes: int
    notify: bytes | None
    delay: float
    fail: bool
    #: where the bytes go even if the connection ends (``late_writes_land``)
    target: Any = None
    #: a held write waits for this instead of ``delay`` (:meth:`FaultyTransport.hold_next_writes`)
    gate: anyio.Event | None = None
    #: the channel was reset or the peer dropped while it was held: its mapping's handles
    #: are gone, so it fails instead of being posted on them
    orphaned: bool = False
    #: the inner transport's connection it was stalled on (a new one has new handles)
    owner: Any = None


@dataclass(frozen=True)
class _Regions:
    """A write straight from a pool (:meth:`Transport.post_regions`), carried through the
    same fault injection as a write through a mapping."""

    regions: tuple[tuple[int, int, int], ...]
    slab: int


class FaultyTransport(Transport):
    """Delegates to ``inner`` and injects the faults of a :class:`FaultPlan` (a write from
    a pool, :meth:`post_regions`, fails, stalls, is held and lands late like any other;
    only corruption is not injected into it)."""

    def __init__(self, inner: Transport, plan: FaultPlan | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.plan = plan if plan is not None else FaultPlan()
        self.name = f"faulty({inner.name})"
        self.injected = FaultCounts()
        self._rng = random.Random(self.plan.seed)
        self._fail_registrations = 0
        self._fail_writes = 0
        self._stall_writes: list[float] = []
        self._hold_writes = 0
        self._gate = anyio.Event()
        self._lost: set[int] = set()
        self._writes: dict[int, int] = {}
        self._corrupt_writes = 0
        self._stalled: list[_Stalled] = []
        self._host: TransportHost | None = None
        self._stall_waiters: list[tuple[int, anyio.Event]] = []
        self._send: Slab | None = None

    def claim(self, owner: object) -> None:
        super().claim(owner)
        self.inner.claim(owner)

    # -- on-demand faults ---------------------------------------------------------------
    def fail_next_registrations(self, n: int = 1) -> None:
        """The next ``n`` view mappings fail."""
        self._fail_registrations += n

    def fail_next_writes(self, n: int = 1) -> None:
        """The next ``n`` writes fail after reaching the transport (no bytes land)."""
        self._fail_writes += n

    def stall_next_writes(self, n: int = 1, seconds: float = 0.05) -> None:
        """The next ``n`` writes take ``seconds`` longer before they complete."""
        seconds = check_number("seconds", seconds)
        self._stall_writes.extend([seconds] * n)

    def hold_next_writes(self, n: int = 1) -> None:
        """The next ``n`` writes are stalled until :meth:`release_held` (no clock: a test
        orders "while these copies are in flight" without timing)."""
        self._hold_writes += n

    def release_held(self) -> None:
        """Let every write held so far complete (or fail, if its peer is gone)."""
        self._gate.set()
        self._gate = anyio.Event()

    async def wait_stalled(self, n: int = 1) -> None:
        """Return once ``n`` writes in all have been stalled: each such copy has started
        (posted) and is being held. Orders a test's next step after "the copy has
        started" without sleeping."""
        if self.injected.writes_stalled >= n:
            return
        event = anyio.Event()
        self._stall_waiters.append((n, event))
        await event.wait()

    def corrupt_next_writes(self, n: int = 1) -> None:
        """The next ``n`` writes carry a flipped bit in their first payload byte (the
        sender's data is intact: the bytes are damaged on the way)."""
        self._corrupt_writes += n

    def lose_peer(self, peer: int) -> None:
        """From now on ``peer`` is unreachable, as if its process died."""
        if peer in self._lost:
            return
        self._lost.add(peer)
        self.injected.peers_lost += 1
        if self._host is not None:
            self._host.peer_lost(peer, PeerLostError(f"rank {peer} lost (injected)"))
        # a symmetric partition: an in-process peer also loses us
        other = getattr(self.inner, "_peers", {}).get(peer)
        if other is not None and other.host is not None and self._host is not None:
            other.host.peer_lost(self._host.rank, PeerLostError(f"rank {self._host.rank} lost (injected)"))

    def _check(self, peer: int) -> None:
        if peer in self._lost:
            raise PeerLostError(f"rank {peer} is unreachable (injected)")

    # -- Transport ----------------------------------------------------------------------
    async def start(self, host: TransportHost, send: Slab, recv: Slab, tg: TaskSpawner) -> None:
        from ..errors import InvalidRequestError
        from ..transports.local import LocalTransport
        if self.plan.late_writes_land and not isinstance(self.inner, LocalTransport):
            raise InvalidRequestError("late_writes_land needs a LocalTransport inside")
        self._host, self._send = host, send
        await self.inner.start(host, send, recv, tg)

    async def add_send_slab(self, slab: Slab) -> None:
        if self.plan.register_seconds:
            await anyio.sleep(self.plan.register_seconds)
        await self.inner.add_send_slab(slab)

    async def add_pool(self, memory: torch.Tensor) -> None:
        await self.inner.add_pool(memory)

    async def add_recv_slab(self, slab: Slab) -> None:
        if self.plan.register_seconds:
            await anyio.sleep(self.plan.register_seconds)
        await self.inner.add_recv_slab(slab)

    async def share_recv_slab(self, peer: int, slab: Slab) -> None:
        self._check(peer)
        await self.inner.share_recv_slab(peer, slab)

    def peer_recv_slabs(self, peer: int) -> tuple[int, ...]:
        return self.inner.peer_recv_slabs(peer)

    def unsettled(self) -> set[int]:
        return self.inner.unsettled() | {w.peer for w in self._stalled}

    @property
    def memory_registrations(self) -> int:
        return self.inner.memory_registrations

    @memory_registrations.setter
    def memory_registrations(self, value: int) -> None:
        pass  # the inner transport counts

    @property
    def address(self) -> str:
        return self.inner.address

    async def connect(self, address: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        rank, hello = await self.inner.connect(address, timeout)
        self._lost.discard(rank)
        self._writes.pop(rank, None)
        return rank, hello

    async def map_view(self, peer: int, view: SlabView, slab: int = 0) -> object:
        self._check(peer)
        if self._fail_registrations or self._rng.random() < self.plan.registration_failure_rate:
            self._fail_registrations = max(0, self._fail_registrations - 1)
            self.injected.registrations_failed += 1
            await anyio.lowlevel.checkpoint()
            raise TransferError(f"injected registration failure for {view} -> rank {peer}")
        return await self.inner.map_view(peer, view, slab)

    def post(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        self._check(peer)
        n = self._writes[peer] = self._writes.get(peer, 0) + 1
        limit = self.plan.lose_peer_after_writes.get(peer)
        if limit is not None and n >= limit:
            self.lose_peer(peer)
            self._check(peer)
        fail = bool(self._fail_writes) or self._rng.random() < self.plan.write_failure_rate
        if fail:
            self._fail_writes = max(0, self._fail_writes - 1)
        if not isinstance(mapping, _Regions) and (
                self._corrupt_writes or (self.plan.corruption_rate
                                         and self._rng.random() < self.plan.corruption_rate)):
            self._corrupt_writes = max(0, self._corrupt_writes - 1)
            self._corrupt(peer, mapping, nbytes, notify)
            return None
        held = self._hold_writes > 0
        if held or self._stall_writes or self._rng.random() < self.plan.write_stall_rate:
            gate = None
            if held:
                self._hold_writes -= 1
                delay, gate = 0.0, self._gate
            else:
                delay = self._stall_writes.pop(0) if self._stall_writes else self.plan.stall_seconds
            self.injected.writes_stalled += 1
            target = self._target(peer, mapping) if self.plan.late_writes_land else None
            stalled = _Stalled(peer, mapping, nbytes, notify, delay, fail, target, gate,
                               owner=getattr(self.inner, "_peers", {}).get(peer))
            self._stalled.append(stalled)
            for n, event in [w for w in self._stall_waiters if w[0] <= self.injected.writes_stalled]:
                self._stall_waiters.remove((n, event))
                event.set()
            return stalled
        if fail:
            self.injected.writes_failed += 1
            raise TransferError(f"injected write failure to rank {peer}")
        return self._inner_post(peer, mapping, nbytes, notify)

    @property
    def direct_writes(self) -> bool:  # type: ignore[override]
        return self.inner.direct_writes

    def post_regions(self, peer: int, regions: tuple[tuple[int, int, int], ...], slab: int,
                     notify: bytes | None) -> object | None:
        return self.post(peer, _Regions(regions, slab), sum(n for _, _, n in regions), notify)

    def _inner_post(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        if isinstance(mapping, _Regions):
            return self.inner.post_regions(peer, mapping.regions, mapping.slab, notify)
        return self.inner.post(peer, mapping, nbytes, notify)

    def _target(self, peer: int, mapping: object) -> Any:
        if isinstance(mapping, _Regions):
            other = self.inner._peer(peer)  # type: ignore[attr-defined]
            return other, other.recv_slabs[mapping.slab].tensor
        return self.inner.target(peer, mapping)  # type: ignore[attr-defined]

    def _corrupt(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> None:
        """Post the write with one bit of its first byte flipped on the way, then put the
        sender's byte back (the send slab is intact afterwards)."""
        assert self._send is not None
        view = getattr(mapping, "view", None)  # the send slab this write reads
        first = (view.tensor if view is not None else self._send.tensor)[:1]
        saved = first.clone()
        first.bitwise_xor_(1 << self._rng.randrange(8))
        try:
            pending = self.inner.post(peer, mapping, nbytes, notify)
            if pending is not None:
                raise TransferError("corrupting a write needs a transport that copies in post()")
        finally:
            first.copy_(saved)
        self.injected.writes_corrupted += 1

    async def wait(self, pending: object) -> None:
        if not isinstance(pending, _Stalled):
            await self.inner.wait(pending)
            return
        try:
            if pending.gate is not None:
                await pending.gate.wait()
            else:
                await anyio.sleep(pending.delay)
            if pending.target is not None and not pending.fail:
                other, dst = pending.target
                if self._host is not None and getattr(self.inner, "_peers", {}).get(pending.peer) is not other:
                    # the connection ended during the stall: the write lands anyway, as a
                    # one-sided write the target cannot revoke, and its notification
                    # reaches the target as a late message
                    if isinstance(pending.mapping, _Regions):
                        for addr, off, n in pending.mapping.regions:
                            ctypes.memmove(dst.data_ptr() + off, addr, n)
                    else:
                        dst[:pending.nbytes].copy_(pending.mapping.view.tensor[:pending.nbytes])  # type: ignore[attr-defined]
                    self.injected.late_writes_landed += 1
                    if pending.notify is not None and other.host is not None and other._address is not None:
                        other.host.deliver_late(self._host.rank, pending.notify)
                    return
            self._check(pending.peer)
            if pending.orphaned or getattr(self.inner, "_peers", {}).get(pending.peer) is not pending.owner:
                raise TransferError(f"a stalled write to rank {pending.peer} outlived its channel")
            if pending.fail:
                self.injected.writes_failed += 1
                raise TransferError(f"injected write failure to rank {pending.peer} (after a stall)")
            inner = self._inner_post(pending.peer, pending.mapping, pending.nbytes, pending.notify)
            if inner is not None:
                await self.inner.wait(inner)
        finally:
            if pending in self._stalled:
                self._stalled.remove(pending)

    async def send(self, peer: int, msg: bytes) -> None:
        self._check(peer)
        await self.inner.send(peer, msg)

    def _orphan(self, peer: int) -> None:
        """Stalled writes to ``peer`` lose their mappings (a real write would be posted
        already, and its handle released only once it is terminal; a stalled one here is
        not posted yet, so it must never be posted on a released handle)."""
        for w in self._stalled:
            if w.peer == peer:
                w.orphaned = True

    async def forget(self, peer: int) -> None:
        self._orphan(peer)
        await self.inner.forget(peer)

    async def disconnect(self, peer: int) -> None:
        self._orphan(peer)
        await self.inner.disconnect(peer)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "transport": self.name}

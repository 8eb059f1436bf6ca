"""Fault injection around any transport, deterministic from a seed.

Wrap the transport of one endpoint to make its registrations fail, its writes fail or
stall, or a peer vanish, either at random (seeded) or on demand::

    plan = FaultPlan(seed=7, registration_failure_rate=0.5)
    transport = FaultyTransport(LocalTransport(fabric), plan)
    transport.fail_next_writes(1)

Used by the failure-model tests, and by users who want to see how their stack reacts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import PeerLostError, TransferError
from ..transports.base import Transport

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

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


@dataclass
class FaultCounts:
    """What a :class:`FaultyTransport` has injected so far (``transport.injected``)."""

    registrations_failed: int = 0
    writes_failed: int = 0
    writes_stalled: int = 0
    peers_lost: int = 0


@dataclass
class _Stalled:
    peer: int
    mapping: object
    nbytes: int
    notify: bytes | None
    delay: float
    fail: bool


class FaultyTransport(Transport):
    """Delegates to ``inner`` and injects the faults of a :class:`FaultPlan`."""

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
        self._lost: set[int] = set()
        self._writes: dict[int, int] = {}
        self._host: TransportHost | None = None
        self._stall_waiters: list[tuple[int, anyio.Event]] = []

    # -- on-demand faults ---------------------------------------------------------------
    def fail_next_registrations(self, n: int = 1) -> None:
        """The next ``n`` view mappings fail."""
        self._fail_registrations += n

    def fail_next_writes(self, n: int = 1) -> None:
        """The next ``n`` writes fail after reaching the transport (no bytes land)."""
        self._fail_writes += n

    def stall_next_writes(self, n: int = 1, seconds: float = 0.05) -> None:
        """The next ``n`` writes take ``seconds`` longer before they complete."""
        self._stall_writes.extend([seconds] * n)

    async def wait_stalled(self, n: int = 1) -> None:
        """Return once ``n`` writes in all have been stalled: each such copy has started
        (posted) and is being held. Orders a test's next step after "the copy has
        started" without sleeping."""
        if self.injected.writes_stalled >= n:
            return
        event = anyio.Event()
        self._stall_waiters.append((n, event))
        await event.wait()

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
    async def start(self, host: TransportHost, send: Slab, recv: Slab, tg: TaskGroup) -> None:
        self._host = host
        await self.inner.start(host, send, recv, tg)

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

    async def map_view(self, peer: int, view: SlabView) -> object:
        self._check(peer)
        if self._fail_registrations or self._rng.random() < self.plan.registration_failure_rate:
            self._fail_registrations = max(0, self._fail_registrations - 1)
            self.injected.registrations_failed += 1
            await anyio.lowlevel.checkpoint()
            raise TransferError(f"injected registration failure for {view} -> rank {peer}")
        return await self.inner.map_view(peer, view)

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
        if self._stall_writes or self._rng.random() < self.plan.write_stall_rate:
            delay = self._stall_writes.pop(0) if self._stall_writes else self.plan.stall_seconds
            self.injected.writes_stalled += 1
            for n, event in [w for w in self._stall_waiters if w[0] <= self.injected.writes_stalled]:
                self._stall_waiters.remove((n, event))
                event.set()
            return _Stalled(peer, mapping, nbytes, notify, delay, fail)
        if fail:
            self.injected.writes_failed += 1
            raise TransferError(f"injected write failure to rank {peer}")
        return self.inner.post(peer, mapping, nbytes, notify)

    async def wait(self, pending: object) -> None:
        if not isinstance(pending, _Stalled):
            await self.inner.wait(pending)
            return
        await anyio.sleep(pending.delay)
        self._check(pending.peer)
        if pending.fail:
            self.injected.writes_failed += 1
            raise TransferError(f"injected write failure to rank {pending.peer} (after a stall)")
        inner = self.inner.post(pending.peer, pending.mapping, pending.nbytes, pending.notify)
        if inner is not None:
            await self.inner.wait(inner)

    async def send(self, peer: int, msg: bytes) -> None:
        self._check(peer)
        await self.inner.send(peer, msg)

    async def forget(self, peer: int) -> None:
        await self.inner.forget(peer)

    async def disconnect(self, peer: int) -> None:
        await self.inner.disconnect(peer)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "transport": self.name}

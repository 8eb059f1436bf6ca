"""The transport plugin interface.

A transport moves bytes from this endpoint's send slab into a peer's receive slab and
carries small control messages. It is shaped after NIXL: memory is registered once, a
*view mapping* (local send view -> the peer's receive view of the same size) is made once
per (peer, view), a copy is a WRITE of equal-length local and remote ranges that may carry
a notification, and completion is polled.

The endpoint engine owns all policy (which view, when to retry, what to reset); a
transport only does what it is told and reports failures as :class:`TransferError` /
:class:`PeerLostError` / :class:`HandshakeError`.
"""

from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio

#: regions of one direct write: (address in a registered pool, offset in the peer's
#: receive slab, bytes)
Regions = tuple[tuple[int, int, int], ...]

if TYPE_CHECKING:
    import torch

    from ..slabs import Slab, SlabView


def loop_waker() -> Callable[[Callable[[], object]], object]:
    """A thread-safe, non-blocking way to run a function on the current event loop (for a
    thread that must wake the loop when its work ends: copy threads, the bulk thread)."""
    try:
        import asyncio

        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: anyio's other backend
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


def ended_event(fut: concurrent.futures.Future[Any]) -> anyio.Event:
    """An event of the current loop, set once ``fut`` (a thread's job) has ended; the one
    way copy threads and the bulk thread wake the loop."""
    ev = anyio.Event()
    wake = loop_waker()

    def ended(_: concurrent.futures.Future[Any]) -> None:
        try:
            wake(ev.set)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    fut.add_done_callback(ended)
    return ev


class TaskSpawner(Protocol):
    """Where a transport starts its background tasks: the endpoint's task group, whose
    tasks are guarded (one that raises is logged and never takes the endpoint down; see
    :mod:`xavier_async.tasks`). An anyio task group has the same method."""

    def start_soon(self, func: Callable[..., Awaitable[Any]], *args: Any,
                   name: object = None) -> None: ...


class TransportHost(Protocol):
    """What a transport may call back on its endpoint (all non-blocking)."""

    rank: int

    def hello(self) -> dict[str, Any]:
        """Handshake payload: rank, protocol version, layout, slab sizes."""

    def check_hello(self, hello: dict[str, Any]) -> None:
        """Validate a peer's hello; raise :class:`HandshakeError` or a layout error."""

    def peer_joined(self, peer: int, hello: dict[str, Any]) -> None:
        """The handshake with ``peer`` succeeded on both ends."""

    def deliver(self, peer: int, msg: bytes, inline: bool = False) -> None:
        """A control message (or a write's notification) arrived from ``peer``.

        With ``inline=True`` the host may serve a load request right here, synchronously
        (pack and post the copy; a copy that does not finish while posting is waited for
        by a task of the host). A transport that calls it from inside another endpoint's
        call stack (the in-process one) passes ``inline=False``."""

    def peer_lost(self, peer: int, exc: BaseException) -> None:
        """``peer`` is gone; fail what waits on it and reset its channel."""

    def deliver_late(self, peer: int, msg: bytes) -> None:
        """A message from ``peer``'s connection after it ended (a late write's
        notification): only replies are looked at, to release fenced receive slabs."""


class Transport(abc.ABC):
    """One transport instance serves exactly one endpoint."""

    #: short name used in metrics and benchmark output
    name: str = "abstract"
    #: whether :meth:`post_regions` can write straight from a registered pool
    direct_writes: bool = False

    def __init__(self) -> None:
        self.memory_registrations = 0

    def claim(self, owner: object) -> None:
        """Bind this transport to its endpoint: a transport serves exactly one, and a
        second :class:`Endpoint` handed the same instance is refused at construction."""
        from ..errors import InvalidRequestError
        current = getattr(self, "_owner", None)
        if current is not None and current is not owner:
            raise InvalidRequestError(
                f"this {self.name} transport already serves another endpoint (rank "
                f"{getattr(current, 'rank', '?')}); give every Endpoint its own transport")
        self._owner = owner

    @abc.abstractmethod
    async def start(self, host: TransportHost, send: Slab, recv: Slab, tg: TaskSpawner) -> None:
        """Register both slabs (once, for the endpoint's lifetime) and start background work in ``tg``."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where peers reach this endpoint (give it to :meth:`Endpoint.connect`)."""

    @abc.abstractmethod
    async def connect(self, address: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """Handshake with the endpoint at ``address``; return (peer rank, peer hello).

        Idempotent: a peer that is already connected (or that connects to us at the same
        time: exactly one connection survives) returns its rank. ``timeout``: seconds for
        the whole handshake (``None``: the transport's default)."""

    @abc.abstractmethod
    async def map_view(self, peer: int, view: SlabView, slab: int = 0) -> object:
        """Map our send ``view`` (of any of our send slabs) to the view of the same size of
        the peer's receive slab number ``slab`` (may fail; a slab the peer has not shared
        is an error). Each (send slab, view, receive slab) has its own mapping: the engine
        never has two copies in flight through one."""

    async def add_send_slab(self, slab: Slab) -> None:
        """Register one more send slab (the endpoint's send-slab pool: slabs 1.. are added
        right after :meth:`start`). Counts one memory registration."""
        raise NotImplementedError(f"the {self.name} transport cannot add send slabs")

    async def add_recv_slab(self, slab: Slab) -> None:
        """Register one more receive slab (the pool's slabs 1.. right after :meth:`start`,
        later the replacement of a fenced one). Peers learn of it in the handshake or
        through :meth:`share_recv_slab`. Counts one memory registration. A slab whose
        index is already registered is refused (:class:`InvalidRequestError`) before
        anything is registered: an index names one slab for the endpoint's lifetime."""
        raise NotImplementedError(f"the {self.name} transport cannot add receive slabs")

    async def add_pool(self, memory: torch.Tensor) -> None:
        """Register memory the endpoint serves blocks from (a snapshot tier: one tensor
        of block slots, registered once at start, on the caches' device or in host DRAM).
        Counts one memory registration. A transport whose copies never read it directly
        may only count it (the default)."""
        await anyio.lowlevel.checkpoint()
        self.memory_registrations += 1

    async def share_recv_slab(self, peer: int, slab: Slab) -> None:
        """Make sure ``peer`` can write into our receive slab ``slab`` (idempotent; a
        no-op when it already can). Raises :class:`PeerLostError` if it cannot be told."""
        await anyio.lowlevel.checkpoint()

    def peer_recv_slabs(self, peer: int) -> tuple[int, ...]:
        """The receive slabs of ``peer`` that we may write (their indices)."""
        return (0,)

    def unsettled(self) -> set[int]:
        """Ranks to which a write of ours may still land: posted and not terminal, or
        given up on (timed out) without a terminal state."""
        return set()

    @abc.abstractmethod
    def post(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        """Start copying the first ``nbytes`` of the mapped view into the peer's receive
        view. Synchronous and short: it may spin briefly so that small copies finish
        here. Returns ``None`` when the copy already reached its terminal state, else a
        token for :meth:`wait`. ``notify`` reaches the peer's :meth:`TransportHost.deliver`
        after the bytes have landed. Raises :class:`TransferError` on failure."""

    def post_regions(self, peer: int, regions: Regions, slab: int,
                     notify: bytes | None) -> object | None:
        """Start one WRITE of several regions straight from memory registered with
        :meth:`add_pool`: each ``(local address, offset in the peer's receive slab
        number slab, bytes)``; otherwise as :meth:`post` (``None``: already terminal,
        else a token for :meth:`wait`; ``notify`` reaches the peer after the bytes).
        Only where :attr:`direct_writes` is true."""
        raise NotImplementedError(f"the {self.name} transport cannot write from a pool")

    @abc.abstractmethod
    async def wait(self, pending: object) -> None:
        """Wait until a copy started by :meth:`post` is terminal. The engine calls this
        inside a shielded scope: it must itself end (done, failed, or timed out)."""

    @abc.abstractmethod
    async def send(self, peer: int, msg: bytes) -> None:
        """Send a control message to ``peer``."""

    #: whether :meth:`send` never yields to the event loop and :meth:`poll_until`
    #: delivers arrived messages synchronously, from the caller's stack (a receiver then
    #: polls for a small batch's reply itself: ``EndpointConfig.reply_spin``)
    polls_inline: bool = False

    def poll_until(self, done: Callable[[], bool], seconds: float) -> bool:
        """Deliver arrived messages to the host, as the transport's own poller would,
        until ``done()`` or for at most ``seconds``; returns ``done()``. Only where
        :attr:`polls_inline` (elsewhere nothing is polled)."""
        return done()

    @abc.abstractmethod
    async def forget(self, peer: int) -> None:
        """Drop every mapping for ``peer`` (its channel is being reset)."""

    @abc.abstractmethod
    async def disconnect(self, peer: int) -> None:
        """Forget ``peer`` entirely (idempotent)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release everything: mappings, connections, memory registrations (idempotent)."""

    def describe(self) -> dict[str, Any]:
        """Environment facts for benchmark reports."""
        return {"transport": self.name}

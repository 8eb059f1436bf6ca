"""The endpoint: one per serving replica, a facade over the roles that do the work.

An :class:`Endpoint` wires a :class:`~xavier_async.runtime.Runtime` (what the roles
share), a :class:`~xavier_async.peers.PeerTable`, a :class:`~xavier_async.receiver.Receiver`
(loads) and a :class:`~xavier_async.source.Source` (publishing, the snapshot store,
serving). The facade itself does the lifecycle (``async with``, :meth:`Endpoint.aclose`),
connects and disconnects peers, routes each control message to its role, and reports
metrics. The transport calls back through a private adapter (:class:`_Host`), never the
public API. docs/architecture.md draws the roles and which file to open for which change.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Protocol

import anyio
import torch

from . import lifecycle, protocol
from ._checks import check_int, check_number
from .channel import PeerChannel
from .config import EndpointConfig, LoadResult
from .errors import (EndpointClosedError, HandshakeError, InternalError, InvalidRequestError,
                     PeerLostError, XavierError)
from .layout import BlockKey, CacheLayout, LayerId
from .metrics import EndpointMetrics
from .peers import PeerTable
from .planning import LoadRequest
from .policy import ChannelPolicy
from .protocol import (Announce, BlockLoad, Error, Hello, Landed, Load, Probe, ProtocolError,
                       announce_wires, check_hello, decode, peer_facts)
from .receiver import Receiver
from .runtime import Caches, Runtime
from .shielded import wait_terminal
from .slabs import Slab, allocate_slab
from .snapshots import PublishResult
from .source import Source
from .tasks import Tasks
from .transports.base import Transport
from .transports.local import LocalTransport

log = logging.getLogger("xavier_async")


class PeerWatcher(Protocol):
    """What :meth:`Endpoint.watch` calls, on the endpoint's event-loop thread: it must
    not block (hand the facts to your own thread or queue). A watcher that raises is
    logged and kept."""

    def joined(self, peer: int) -> None:
        """``peer`` connected (or reconnected: what it announced before is void)."""

    def lost(self, peer: int) -> None:
        """``peer`` is gone (lost, or disconnected)."""

    def announced(self, peer: int, message: Announce) -> None:
        """``peer`` announced which keys it holds now (:meth:`Endpoint.announce`)."""


class Endpoint:
    """One serving replica's end of the KV transfer fabric.

    ``caches`` maps layer ids to contiguous tensors ``[num_slots, *block_shape]`` (any
    dtype, all on one device); the slabs are allocated on that device. Use as an async
    context manager::

        async with Endpoint(0, caches, LocalTransport(fabric)) as ep:
            peer = await ep.connect(address_of_other)
            ep.publish(key, slot)
            await ep.load({peer: {layer: {key: slot}}})
    """

    def __init__(self, rank: int, caches: Mapping[Any, torch.Tensor],
                 transport: Transport | None = None, config: EndpointConfig | None = None) -> None:
        self.rank = check_int("rank", rank, minimum=0)
        self.config = config if config is not None else EndpointConfig()
        if not isinstance(self.config, EndpointConfig):
            raise InvalidRequestError("config must be an EndpointConfig")
        local = Caches(caches)
        self.layout: CacheLayout = local.layout
        self.caches: dict[LayerId, torch.Tensor] = local.tensors
        self.transport: Transport = transport if transport is not None else LocalTransport()
        if not isinstance(self.transport, Transport):
            raise InvalidRequestError(f"transport must be a Transport, got {type(self.transport).__name__}")
        self.transport.claim(self)
        self._rt = rt = Runtime(self.rank, self.config, self.transport, local)
        self.metrics: EndpointMetrics = rt.metrics
        #: names this endpoint instance in handshakes (a restarted process has a new one)
        self.incarnation = uuid.uuid4().hex
        self._peers = PeerTable(self.rank)
        self._receiver = Receiver(rt, self._peers, self._on_timeout)
        self._source = Source(rt, self._peers)
        #: optional hello fields, uninterpreted by the engine (:mod:`xavier_async._internal`)
        self._hello_extras: dict[str, Any] = {}
        self._watchers: list[PeerWatcher] = []
        self._host = _Host(self)
        self._closed = anyio.Event()
        self._stack: AsyncExitStack | None = None
        self._registered_at_start = 0

    # -- slabs ---------------------------------------------------------------------------
    @property
    def send_slabs(self) -> tuple[Slab, ...]:
        """The send-slab pool (:attr:`send_slab` is its first slab)."""
        return tuple(self._source.slabs)

    @property
    def send_slab(self) -> Slab | None:
        """The first send slab (``None`` before start)."""
        return self._source.slabs[0] if self._source.slabs else None

    @property
    def direct_writes(self) -> int:
        """Serves written straight from the snapshot store into a peer's receive slab,
        with no gather (``EndpointConfig.direct_write_regions``); also in
        :meth:`snapshot_metrics`. A plain count: safe to read from another thread."""
        return self._source.direct_writes

    @property
    def recv_slab(self) -> Slab | None:
        """The receive slab the next load would be written into (``None`` while every one
        is in use; a fenced one leaves the pool: see :attr:`recv_slab_stats`)."""
        return self._receiver.slabs.current if self._receiver.started else None

    @property
    def recv_slabs(self) -> tuple[Slab, ...]:
        """Every receive slab registered (the pool, spares and fenced ones)."""
        return tuple(self._receiver.slabs.slabs.values()) if self._receiver.started else ()

    @property
    def recv_slab_stats(self) -> dict[str, int]:
        """Receive slabs: ``registered``, ``pool`` (K), ``usable`` (in the pool, free or
        lent), ``in_use``, ``waiting`` (loads waiting for one; a group of merged batches
        counts once), ``fenced_now`` (a lost source may still write them), ``spares``,
        and how many were ever ``fences``, ``released_late`` (the stale writer's late reply
        arrived) and ``released_reconnect``; merged groups forming now
        (``groups_forming``), small round trips held and waited for (``lanes_held``,
        ``lanes_waiting``); ``send_slabs`` (S), ``sends_in_use``, ``snapshot_tiers`` (the
        snapshot store's tiers, each registered once), and ``registered_at_start`` (S + K
        + tiers memory registrations) against
        ``registered_since_start`` (0 unless a fence needed a replacement)."""
        stats = self._receiver.stats()
        if not stats:
            return {}
        return {**stats, "send_slabs": len(self._source.slabs),
                "sends_in_use": self._source.pool.held, "snapshot_tiers": self._source.pools,
                "registered_at_start": self._registered_at_start,
                "registered_since_start":
                    self.transport.memory_registrations - self._registered_at_start}

    # -- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> Endpoint:
        """Allocate the slabs, start the background tasks and the transport. A failure
        raises the real error and leaves nothing registered, listening or running."""
        rt = self._rt
        if rt.life.phase is not lifecycle.Phase.NEW:
            raise EndpointClosedError("an Endpoint can be entered once")
        rt.life.fire(lifecycle.START)
        stack = AsyncExitStack()
        outer = None
        try:
            sizes, cfg, dev = self.config.sizes, self.config, self.layout.device
            send_slabs = [allocate_slab("send", sizes.full, sizes.small, dev, i)
                          for i in range(cfg.send_slabs)]
            recv_slabs = [allocate_slab("recv", sizes.full, sizes.small, dev, i)
                          for i in range(cfg.receive_slabs)]
            rt.caches.start()
            self._receiver.start(recv_slabs)
            await stack.__aenter__()
            outer = await stack.enter_async_context(anyio.create_task_group())
            # Background work runs in a task group hosted by a task of its own, so that
            # stopping it (aclose) never cancels the caller's code inside `async with`.
            rt.tasks = Tasks(await outer.start(_host_background), f"rank {self.rank}")
            stack.push_async_callback(self._shutdown_tasks)
            self._source.start(send_slabs)
            await self.transport.start(self._host, send_slabs[0], recv_slabs[0], rt.tasks)
            for slab in send_slabs[1:]:
                await self.transport.add_send_slab(slab)
            for slab in recv_slabs[1:]:
                await self.transport.add_recv_slab(slab)
            for pool in self._source.pool_tensors:
                await self.transport.add_pool(pool)
            self._registered_at_start = self.transport.memory_registrations
        except BaseException:
            # Release what the transport registered or bound (shielded), then stop our
            # tasks and leave the task group: outside the shield, in the order entered,
            # so no cancel scope is exited out of turn and the caller's task is intact.
            with anyio.CancelScope(shield=True):
                try:
                    await self.transport.aclose()
                except Exception:
                    log.debug("transport close after a failed start failed", exc_info=True)
            if outer is not None:
                outer.cancel_scope.cancel()
            try:
                await stack.aclose()
            except Exception:
                log.debug("stopping the tasks of a failed start failed", exc_info=True)
            rt.tasks = None
            rt.copies.close()
            rt.life.fire(lifecycle.START_FAILED)
            self._closed.set()
            raise
        self._stack = stack
        rt.life.fire(lifecycle.STARTED)
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        try:
            await self.aclose()
        finally:
            # The body's exception is not fed to our task group: it would come out wrapped
            # in an ExceptionGroup. aclose() has already stopped the background tasks.
            if self._stack is not None:
                await self._stack.__aexit__(None, None, None)
        return None

    async def _shutdown_tasks(self) -> None:
        if self._rt.tasks is not None:
            self._rt.tasks.cancel()

    async def aclose(self) -> None:
        """Drain in-flight work, reject new work, release the transport. Idempotent; a
        cancelled close still finishes its cleanup before the cancellation propagates."""
        rt = self._rt
        phase = rt.life.phase
        if phase is lifecycle.Phase.NEW:
            rt.life.fire(lifecycle.CLOSE)
            self._closed.set()
            return
        if phase is not lifecycle.Phase.OPEN:  # closing, closed (or a start under way)
            held = await wait_terminal(self._closed.wait)
            if held is not None:
                raise held
            return
        rt.life.fire(lifecycle.CLOSE)
        self._receiver.closing()
        held = None
        with anyio.CancelScope(shield=True):
            try:
                held = await rt.drained()
                self._receiver.close()
                await self.transport.aclose()
                self.metrics.memory_registrations = self.transport.memory_registrations
                self._source.close()
            finally:
                rt.copies.close()  # drained: no copy is running; joins the threads
                rt.life.fire(lifecycle.CLOSED)
                self._closed.set()
                if rt.tasks is not None:
                    rt.tasks.cancel()
        if held is not None:
            raise held

    @property
    def closed(self) -> bool:
        """Closing or closed: no new work is taken."""
        return self._rt.life.closed

    # -- peers --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Give this to a peer's :meth:`connect`."""
        return self.transport.address

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks connected now."""
        return self._peers.ranks

    async def connect(self, address: str, *, timeout: float | None = None) -> int:
        """Handshake with the endpoint at ``address`` (both ends learn each other). Returns
        the peer's rank. Idempotent: connecting to a connected peer, or both ends
        connecting at once, leaves exactly one connection and returns the peer's rank.
        ``timeout``: seconds for this handshake (default: the transport's). Raises
        :class:`HandshakeError` or :class:`LayoutMismatchError`."""
        self._rt.check_open()
        if not isinstance(address, str) or not address:
            raise HandshakeError(f"peer address must be a non-empty string, got {address!r}")
        if timeout is not None:
            timeout = check_number("timeout", timeout, strictly_positive=True)
        rank, _ = await self.transport.connect(address, timeout)
        return rank

    async def disconnect(self, peer: int) -> None:
        """Drop the connection to ``peer`` (idempotent; an unknown peer is ignored). Loads
        from it that are waiting fail with :class:`PeerLostError`; the peer sees us go."""
        self._rt.check_open()
        peer = check_int("peer", peer, minimum=0)
        if self._peers.connected(peer) is not None:
            self._peer_lost(peer, PeerLostError(f"rank {self.rank} disconnected from rank {peer}"),
                            disconnect=False)
        self._peers.forget(peer)  # an explicit disconnect: the peer is unknown from now on
        await self._disconnect(peer)

    def channel(self, peer: int) -> PeerChannel:
        """The channel this endpoint uses to write to ``peer``."""
        return self._peers.channel(peer)

    def policy(self, peer: int) -> ChannelPolicy:
        """The state machine of the channel to ``peer``."""
        return self.channel(peer).policy

    def peer_hello(self, peer: int) -> dict[str, Any]:
        """What ``peer`` said about itself when it connected (``{}`` if not connected)."""
        rec = self._peers.get(peer)
        return rec.hello if rec is not None else {}

    def watch(self, watcher: PeerWatcher) -> None:
        """Call ``watcher`` when a peer joins, is lost, or announces what it holds
        (:class:`PeerWatcher`); for a directory of which peer holds which block."""
        for name in ("joined", "lost", "announced"):
            if not callable(getattr(watcher, name, None)):
                raise InvalidRequestError(f"a watcher needs a callable {name}(), "
                                          f"{type(watcher).__name__} has none")
        self._watchers.append(watcher)

    async def announce(self, published: Sequence[BlockKey], evicted: Sequence[BlockKey] = (), *,
                       replace: bool = False, peers: Iterable[int] | None = None) -> int:
        """Tell peers (every connected one, or ``peers``) that this endpoint now holds
        ``published`` and no longer holds ``evicted``; with ``replace``, that it holds
        exactly ``published``. Nothing is written; a peer hands it to its watchers
        (:meth:`watch`). Keys are ints (0 <= key < 2**64), strings or bytes. Returns how
        many peers it reached (a peer lost meanwhile is skipped: its loss is reported
        as such)."""
        self._rt.check_open()
        for key in (*published, *evicted):
            if type(key) not in (int, str, bytes) or (type(key) is int and not 0 <= key < 1 << 64):
                raise InvalidRequestError(f"an announced key must be an int in [0, 2**64), "
                                          f"a str or bytes, got {key!r}")
        wires = announce_wires(list(published), list(evicted), replace)
        targets = self._peers.ranks if peers is None else tuple(peers)
        reached = 0
        for peer in targets:
            if self._peers.connected(peer) is None:
                continue
            try:
                for wire in wires:
                    await self.transport.send(peer, wire)
            except XavierError as exc:
                log.debug("rank %d: announce to rank %d failed: %s", self.rank, peer, exc)
                continue
            reached += 1
        return reached

    def _tell_watchers(self, event: str, *args: Any) -> None:
        for watcher in self._watchers:
            try:
                getattr(watcher, event)(*args)
            except Exception:
                log.exception("rank %d: peer watcher %r failed on %s", self.rank, watcher, event)

    def _hello(self) -> Hello:
        # ranks we may still write: a copy not yet terminal, or a connection we have not
        # seen end (a peer that reconnects to us meanwhile must not trust it is over)
        unsettled = self.transport.unsettled() | set(self._peers.ranks)
        return Hello(self.rank, self.layout.wire(), self.config.sizes, self.layout.device.type,
                     version=protocol.PROTOCOL_VERSION, extras=self._hello_extras,
                     incarnation=self.incarnation, epochs=self._peers.epochs(),
                     unsettled=tuple(sorted(unsettled)))

    def _peer_joined(self, peer: int, hello: dict[str, Any]) -> None:
        cfg = self.config
        facts = peer_facts(self.rank, hello, self._peers.epochs())
        # the same endpoint instance, under a new epoch, may vouch that none of its
        # writes to us can still land: its fenced slabs are free again
        self._receiver.peer_joined(peer, facts.incarnation, not facts.writes_unsettled)
        ch = PeerChannel(peer, self.transport, self._source.slabs,
                         ChannelPolicy.of(cfg.sizes, cfg.streak), cfg.retry, self.metrics.peer(peer),
                         trimmed=cfg.trimmed, trim_align=cfg.trim_align)
        old = self._peers.join(peer, hello, facts, ch)
        if old is not None:  # a restarted peer: start from a clean channel
            old.policy.reset()
        if cfg.map_eagerly and self._rt.running:
            self._rt.spawn(self._map_all, peer, ch)
        self._tell_watchers("joined", peer)

    async def _map_all(self, peer: int, ch: PeerChannel) -> None:
        """``map_eagerly``: map every (send slab, view, receive slab) pair for ``peer``."""
        try:
            slabs = self.transport.peer_recv_slabs(peer)
            for send, slab in enumerate(self._source.slabs):
                for view in dict.fromkeys(v.name for v in slab.views):
                    for recv in slabs:
                        if self._peers.connected(peer) is not ch:
                            return  # lost or restarted meanwhile
                        await ch.mapping(view, recv, send)
        except XavierError as exc:  # mapping on first use will try again
            log.debug("rank %d: eager mapping for rank %d stopped: %s", self.rank, peer, exc)

    def _peer_lost(self, peer: int, exc: BaseException, *, disconnect: bool = True) -> None:
        """Fail what waits on ``peer`` and reset its channel; with ``disconnect``, drop the
        transport's connection too (in a task: this is called from transport callbacks)."""
        self._receiver.peer_lost(peer, exc if isinstance(exc, XavierError) else PeerLostError(str(exc)))
        ch = self._peers.lose(peer, str(exc))
        if ch is not None:
            ch.reset_now()
        self._tell_watchers("lost", peer)
        if disconnect and self._rt.running:
            self._rt.spawn(self._disconnect_lost, peer)

    async def _on_timeout(self, src: int, lost: PeerLostError) -> None:
        """``src`` did not complete a copy in time: it is lost, and its connection dropped
        here (not in a task that could outlive a reconnect)."""
        self._peer_lost(src, lost, disconnect=False)
        await self._disconnect(src)

    async def _disconnect_lost(self, peer: int) -> None:
        """Release a lost peer's connection, unless it has connected again meanwhile (a
        disconnect by rank would then drop the new connection)."""
        if self._peers.connected(peer) is None:
            await self._disconnect(peer)

    async def _disconnect(self, peer: int) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.transport.disconnect(peer)
            except Exception:
                log.debug("rank %d: disconnect of rank %d failed", self.rank, peer, exc_info=True)

    # -- publishing and loading ------------------------------------------------------------
    def publish(self, key: BlockKey, slot: int, *,
                layers: Iterable[LayerId] | None = None) -> PublishResult:
        """Make ``key`` loadable by peers: it lives at ``slot`` of each layer's cache
        (all layers by default). Every argument is checked before anything is published:
        a malformed one raises :class:`InvalidRequestError`, and publishes nothing.

        With the snapshot store (the default) the block is copied into it before this
        returns, every layer (``layers`` may only name them all), and the engine may reuse
        ``slot`` at once; the result says whether it found room (``skipped``) and which
        blocks it evicted. Without (``snapshot_gpu_bytes=0, snapshot_cpu_bytes=0``) the
        block is served from ``slot`` itself, which the engine must keep until it
        unpublishes it. For many blocks at a time, :meth:`publish_blocks`."""
        if self.closed:
            raise EndpointClosedError("endpoint is closed: it publishes nothing any more")
        return self._source.publish(key, slot, layers)

    async def publish_blocks(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> PublishResult:
        """Make blocks ``keys`` (every layer) loadable by peers: ``keys[i]`` lives at
        ``slots[i]`` of every layer's cache. Every argument is checked before anything is
        published.

        With the snapshot store (the default) the blocks are copied into it in one pass
        (one fused launch on CUDA, completion by its event), after demoting what must make
        room; when this returns they are loadable and the engine may overwrite the slots.
        The result lists the keys now ``available``, those ``evicted`` to make room
        (unregister them from your block index), those ``skipped`` for want of room in
        either tier, and those ``demoted`` to the host tier (still loadable)."""
        self._rt.check_open()
        return await self._source.publish_blocks(keys, slots)

    def unpublish(self, key: BlockKey, *, layers: Iterable[LayerId] | None = None) -> None:
        """Stop serving ``key`` (keys and layers that are not published are ignored). A
        malformed key or ``layers`` raises :class:`InvalidRequestError`."""
        self._source.unpublish(key, layers)

    async def load(self, requests: LoadRequest | Iterable[LoadRequest]) -> LoadResult:
        """Load blocks ``{source rank: {layer: {block key: slot or [slots]}}}`` into the
        local caches. Several requests may be passed as a list; they are merged. Every
        check runs before any byte moves.

        On CUDA caches ``load`` returns once the blocks are in their slots (the unpack is
        synchronized). With ``EndpointConfig(stream_ordered_unpack=True)`` it returns as
        soon as the unpack is enqueued on the current stream of the caches' device: work
        on that stream sees the blocks, another stream must wait on it first, as with any
        asynchronous CUDA copy."""
        return await self._receiver.load(requests)

    async def load_blocks(self, peer: int, keys: Sequence[BlockKey], slots: Sequence[int], *,
                          layers: Iterable[LayerId] | None = None) -> LoadResult:
        """Load blocks ``keys`` from ``peer``: ``keys[i]`` into slot ``slots[i]`` of every
        layer's cache (or of each of ``layers``). The common case of :meth:`load` ("these
        prefix blocks, all layers") without building a request per layer: the same checks,
        batches, result and errors as ``load({peer: {ALL_LAYERS: dict(zip(keys, slots))}})``,
        and a key named twice is refused. Integer keys (0 <= key < 2**64) and integer
        layer ids travel as a binary request."""
        return await self._receiver.load_blocks(peer, keys, slots, layers)

    # -- messages -----------------------------------------------------------------------
    def _on_message(self, peer: int, msg: bytes, inline: bool) -> None:
        """A control message from a connected peer, to the role it is for."""
        try:
            message = decode(msg)
        except ProtocolError:
            log.warning("rank %d: dropped malformed message from rank %d", self.rank, peer)
            return
        if isinstance(message, (BlockLoad, Load)):
            self._source.on_load(peer, message, inline)
        elif isinstance(message, Probe):
            self._source.on_probe(peer, message)
        elif isinstance(message, Announce):
            self._tell_watchers("announced", peer, message)
        else:
            self._receiver.on_reply(peer, message)

    def _on_late(self, peer: int, msg: bytes) -> None:
        """A message from a connection that has ended: only replies count (they release
        fenced receive slabs); requests are never served."""
        try:
            message = decode(msg)
        except ProtocolError:
            return
        if isinstance(message, (Landed, Error)):
            self._receiver.on_late_reply(peer, message)

    # -- diagnostics --------------------------------------------------------------------
    def snapshot_metrics(self) -> dict[str, Any]:
        """Metrics as a plain dict (registrations include the transport's memory ones), with
        the slab pools' state under ``"slabs"`` (:attr:`recv_slab_stats`)."""
        self.metrics.memory_registrations = self.transport.memory_registrations
        out = {**self.metrics.as_dict(), "slabs": self.recv_slab_stats}
        if self._source.store is not None:
            out["snapshot"] = {**self._source.store.stats(),
                               "direct_writes": self._source.direct_writes}
        return out

    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise :class:`InternalError` if the slab bookkeeping is broken (a test aid for
        stacks that inject faults, as the chaos test does; cheap, no I/O): every receive
        slab is in exactly one of pool, spares and fenced, with its unpack table; no slab
        is lent twice; no waiter is left behind a free slab; the transport has registered
        exactly the send slabs and the receive slabs there are. With ``idle`` (nothing in
        flight), also: no slab is lent and no load waits for one."""
        if not self._receiver.started:
            return
        self._receiver.check(idle)
        self._source.check(idle)
        recv = self._receiver.slabs
        sends = len(self._source.slabs) + self._source.pools
        registered = self.transport.memory_registrations
        if not sends + len(recv.slabs) <= registered <= sends + len(recv.slabs) + recv.registering:
            raise InternalError(f"the transport holds {registered} memory registrations, the "
                                f"endpoint {sends} send slabs and snapshot tiers and "
                                f"{len(recv.slabs)} receive slabs ({recv.registering} being "
                                "registered)")


async def _host_background(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    async with anyio.create_task_group() as tg:
        task_status.started(tg)
        await anyio.sleep_forever()


class _Host:
    """The endpoint as its transport sees it (:class:`TransportHost`): kept off the
    endpoint's public API."""

    __slots__ = ("_ep", "rank")

    def __init__(self, ep: Endpoint) -> None:
        self._ep = ep
        self.rank = ep.rank

    def hello(self) -> dict[str, Any]:
        return self._ep._hello().to_wire()

    def check_hello(self, hello: dict[str, Any]) -> None:
        check_hello(self._ep._hello(), hello, self._ep.layout)

    def peer_joined(self, peer: int, hello: dict[str, Any]) -> None:
        self._ep._peer_joined(peer, hello)

    def deliver(self, peer: int, msg: bytes, inline: bool = False) -> None:
        self._ep._on_message(peer, msg, inline)

    def deliver_late(self, peer: int, msg: bytes) -> None:
        self._ep._on_late(peer, msg)

    def peer_lost(self, peer: int, exc: BaseException) -> None:
        self._ep._peer_lost(peer, exc)


__all__ = ["Endpoint", "EndpointConfig", "LoadResult", "PeerWatcher"]

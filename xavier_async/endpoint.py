"""The endpoint engine: one per serving replica (the I/O shell around the pure core).

An :class:`Endpoint` owns a pool of receive slabs and a pool of send slabs
(``EndpointConfig.receive_slabs`` / ``send_slabs``, all registered once at start), one
anyio task group (every background task lives there) and a :class:`PeerChannel` per
connected peer. The protocol (messages, request ids, the hello check, the serve decision)
is :mod:`xavier_async.protocol`; this module does the slab lending, the awaiting and the
transport calls. Loading from a peer (many such loads may be in flight at once)::

    receiver                                   source
    load() validates + plans (no I/O yet)
    [borrow a receive slab r]
    Load(req, keys, r)  --------------------->  [borrow a send slab s] decide(): refuse /
                                                map (s, view, r) / ready: pack slab s,
                                                commit the machine, WRITE + notify
    <-------------------------------- Landed  (bytes are in receive slab r)
    unpack into cache slots, give r back        (s is given back once the WRITE is terminal)

Batches from one source that would wait for a receive slab are merged into one request
(``EndpointConfig.merge_loads``, :mod:`xavier_async.merging`): a background task waits for
the slab and carries the whole group's round trip; each load waits for its member. With
``EndpointConfig.small_round_trips`` a small batch also waits (in the same group) while
its source already has that many small round trips in flight.

A copy that has started is waited for (shielded) until it reaches a terminal state, even
if the caller is cancelled; the cancellation is re-raised afterwards and the batch is not
unpacked, so the cache keeps its previous contents.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from time import perf_counter_ns
from types import TracebackType
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._checks import check_bool, check_int, check_number, check_size
from .channel import CopyPlan, PeerChannel
from .errors import (EndpointClosedError, HandshakeError, IntegrityError, InternalError,
                     InvalidRequestError, PeerLostError, RegistrationError, RemoteError,
                     TransferError, UnknownPeerError, XavierError)
from .layout import BlockKey, CacheLayout, LayerId, check_key, check_layers, check_slot
from .merging import LoadGroup, Member, MergedBatch
from .metrics import EndpointMetrics
from .packing import CacheTable, DeviceRuns, SlabRows, byte_rows, pack, unpack
from .planning import LoadRequest, PlannedBatch, Planner
from .policy import DEFAULT_STREAK, ChannelPolicy
from . import protocol
from .protocol import (Error, Hello, Landed, Load, NeedsMapping, ParsedLoad, PendingRequest, Probe,
                       ProtocolError, Ready, Refuse, RequestTable, check_epoch, check_hello,
                       check_probe, decide, decode, parse_load, peer_facts)
from .retry import RetryPolicy
from .shielded import wait_terminal
from .sizes import DEFAULT_FULL_BYTES, SlabSizes
from .slabs import RecvSlabs, Slab, SlabPool, Ticket, allocate_slab, payload_digest
from .tasks import Tasks
from .transports.base import Transport
from .transports.local import LocalTransport

log = logging.getLogger("xavier_async")

#: how long a receiver spins on a CUDA unpack's event before polling it from the event loop
_UNPACK_SPIN_NS = 30_000

#: how many forks this process descends from (a forked child sees a new value without a
#: getpid() system call on every load)
_forks = 0


def _after_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@dataclass(frozen=True)
class EndpointConfig:
    """Tuning knobs, all validated at construction.

    ``full_bytes``/``small_bytes``: the slab and its small prefix view (small defaults to
    ``min(full, 256 KiB)``); both are also available as one validated value, ``sizes``.
    ``streak``: consecutive small batches before the small view is used (1 = size-only
    selection). ``trimmed``: copy only the payload rounded up to ``trim_align`` instead of
    the whole chosen view. ``request_timeout``: how long a receiver waits for a batch it
    requested (queueing at the source, packing and the copy) before declaring the source
    lost; keep it above the transport's own copy timeout (NIXL: 30 s), so a source whose
    copy stalls reports the failure itself first. ``stream_ordered_unpack``: on CUDA, let
    :meth:`Endpoint.load` return once the unpack is enqueued on the caches' current stream
    instead of waiting for it (saves a device synchronization per batch). ``verify``:
    every batch this endpoint loads carries a digest of its payload, computed by the
    source after packing (on the device for VRAM); the batch is checked before it is
    unpacked, and a mismatch raises :class:`IntegrityError` instead of writing it (costs a
    reduction over the payload on both ends).

    ``receive_slabs`` (K) and ``send_slabs`` (S): the slab pools. Each slab is allocated
    and registered once at start (S + K memory registrations, none after); each batch
    borrows one receive slab for its round trip, each copy a source serves one send slab
    until the copy is terminal, so up to K batches load and up to S copies are served at
    once. Head-of-line rule: a batch whose payload exceeds the small view may hold at most
    K - 1 receive slabs (and S - 1 send slabs) at once, so one of each is always left for
    small batches, which never wait behind a whole large copy. With a pool of one slab
    there is no reservation (K = S = 1 is the one-batch-at-a-time design). When every
    slab is busy, a load waits (back-pressure, never an error).

    ``map_eagerly``: when a peer joins, map every (send slab, view, peer's receive slab)
    pair for it in the background (2 x S x K mappings per peer, made at once), so that no
    copy ever waits for a mapping and registrations are flat from the first load on. Off
    (the default), mappings are made on first use, at most 2 x S x K per peer, and only
    those that traffic needs (one-at-a-time traffic needs two).

    ``merge_loads``: batches from one source that wait for a receive slab are merged into
    one request, one copy and one unpack (:mod:`xavier_async.merging`): small batches up
    to the small view (the group stays small under the head-of-line rule), large ones up
    to the full slab. Nothing merges while a slab is free, so an unloaded endpoint's loads
    are unchanged; under load, a round trip serves every batch that waited for it. A
    member cancelled before its group's request goes out takes nothing; after that it is
    copied but not unpacked. A source that refuses a merged request (an unpublished key)
    is asked again batch by batch, so only the loads naming the missing keys fail.

    ``merge_small_bytes``: how large a group of waiting small batches may grow (default,
    and minimum: the small view; at most the full slab). Above the small view a group
    makes fewer, larger round trips, but it is a large batch everywhere after it forms:
    the channel machine copies it through the full view (the whole slab unless
    ``trimmed``, and a following small batch starts a new streak) and the source serves
    it under the large batches' share of send slabs. It keeps its small place in the
    receive-slab queue. Measured with the serving bench (``--serving-merge-small 1MiB
    --serving-rounds 3``, medians) on the H200 pair: one loader with two sources got
    1.27x the default's concurrent small loads/s and 1.23x its mixed-trace loads/s; two
    endpoints loading from each other 1.07x and 0.89x. On DRAM each group's copy moves
    the whole 12 MiB slab unless ``trimmed`` (0.4x; 1.2x with ``trimmed``).

    ``small_round_trips`` (opt in, needs ``merge_loads``): at most this many round trips
    of small batches in flight to one source. A small batch that finds them all busy
    waits in its source's forming group, which goes out when one of them ends (and a
    receive slab is free), so loaded traffic makes fewer, fuller round trips while the
    other slabs stay free for large batches. ``None`` (the default): no cap, a small batch
    takes any free slab. Why: on a loaded endpoint the cost is host work per round trip;
    on the H200 pair one slab each way with 1 MiB groups (every small batch that arrives
    during a round trip joins the next) gave the best small-load throughput and tail
    with two endpoints loading from each other, but one slab leaves no room for large
    batches. A cancelled batch waiting for a round trip takes nothing.
    """

    full_bytes: int = DEFAULT_FULL_BYTES
    small_bytes: int | None = None
    streak: int = DEFAULT_STREAK
    trimmed: bool = False
    trim_align: int = 256
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_timeout: float = 60.0
    stream_ordered_unpack: bool = False
    verify: bool = False
    receive_slabs: int = 4
    send_slabs: int = 4
    map_eagerly: bool = False
    merge_loads: bool = True
    merge_small_bytes: int | None = None
    small_round_trips: int | None = None
    sizes: SlabSizes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = SlabSizes.of(self.full_bytes, self.small_bytes)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "full_bytes", sizes.full)
        object.__setattr__(self, "small_bytes", sizes.small)
        object.__setattr__(self, "streak", check_int("streak", self.streak, minimum=1))
        object.__setattr__(self, "receive_slabs",
                           check_int("receive_slabs", self.receive_slabs, minimum=1, maximum=1024))
        object.__setattr__(self, "send_slabs",
                           check_int("send_slabs", self.send_slabs, minimum=1, maximum=1024))
        check_bool("trimmed", self.trimmed)
        check_bool("stream_ordered_unpack", self.stream_ordered_unpack)
        check_bool("verify", self.verify)
        check_bool("map_eagerly", self.map_eagerly)
        check_bool("merge_loads", self.merge_loads)
        merge_small = sizes.small if self.merge_small_bytes is None else self.merge_small_bytes
        object.__setattr__(self, "merge_small_bytes", check_int(
            "merge_small_bytes", merge_small, minimum=sizes.small, maximum=sizes.full))
        if self.small_round_trips is not None:
            object.__setattr__(self, "small_round_trips", check_int(
                "small_round_trips", self.small_round_trips, minimum=1, maximum=1024))
            if not self.merge_loads:
                raise InvalidRequestError("small_round_trips needs merge_loads (the batches that "
                                          "wait for a round trip merge into the next one)")
        check_size("trim_align", self.trim_align)
        check_number("request_timeout", self.request_timeout, strictly_positive=True)
        if not isinstance(self.retry, RetryPolicy):
            raise InvalidRequestError("retry must be a RetryPolicy")


@dataclass(frozen=True)
class LoadResult:
    """What one :meth:`Endpoint.load` moved: ``batches`` planned, ``blocks`` and
    ``useful_bytes`` loaded, and ``wire_bytes`` copied for them (a batch merged with others
    into one copy, ``merge_loads``, is charged its share of that copy, by payload)."""

    batches: int
    blocks: int
    useful_bytes: int
    wire_bytes: int


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
        self.layout = CacheLayout.of(caches)
        self.caches: dict[LayerId, torch.Tensor] = dict(caches)
        self._rows = byte_rows(self.caches)  # the caches as uint8 rows: copies are bit-exact
        self._cache_table = CacheTable(self._rows)  # their base addresses, for run tables
        self._planner = Planner(self.layout, self.config.full_bytes)
        #: on CUDA, the fused pack/unpack launcher (None: the tensor path)
        self._device_runs: DeviceRuns | None = None
        self.transport: Transport = transport if transport is not None else LocalTransport()
        if not isinstance(self.transport, Transport):
            raise InvalidRequestError(f"transport must be a Transport, got {type(self.transport).__name__}")
        self.transport.claim(self)
        self.metrics = EndpointMetrics()
        self._stages = self.metrics.stages
        #: names this endpoint instance in handshakes (a restarted process has a new one)
        self.incarnation = uuid.uuid4().hex
        self._pid = os.getpid()
        self._forks = _forks
        #: as a receiver: the epoch our requests to each peer carry (one per connection)
        self._epoch: dict[int, int] = {}
        #: as a source: the oldest epoch we serve for each peer
        self._min_epoch: dict[int, int] = {}
        #: each connected peer's incarnation (kept after it is lost: fences name it)
        self._peer_inc: dict[int, str] = {}
        #: peers lost (not disconnected by us): their loads fail with PeerLostError
        self._lost: dict[int, str] = {}
        self._recv: RecvSlabs[SlabRows] | None = None
        self._published: dict[LayerId, dict[BlockKey, int]] = {layer: {} for layer in self.caches}
        self._channels: dict[int, PeerChannel] = {}
        self._peer_hello: dict[int, dict[str, Any]] = {}
        self._requests = RequestTable()
        #: optional hello fields (uninterpreted by the engine; the benchmark uses one)
        self._hello_extras: dict[str, Any] = {}
        self._host = _Host(self)
        #: the send slabs: one is held from packing until its copy is terminal (released
        #: by whichever task finishes the copy)
        self._send: SlabPool = SlabPool(range(self.config.send_slabs))
        #: a batch whose payload exceeds this is "large" (the head-of-line rule)
        self._small = self.config.sizes.small
        #: the largest group of small batches (EndpointConfig.merge_small_bytes: an int
        #: once the config is made; ``or`` only narrows its declared ``int | None``)
        self._merge_small = self.config.merge_small_bytes or self._small
        self._send_slabs: list[Slab] = []
        self._send_rows: list[SlabRows] = []
        self._inflight = 0
        #: requests handed to the serve queue and not yet committed (the inline path waits)
        self._queued = 0
        #: per (source, large): the group of batches waiting for a receive slab that
        #: later batches from that source join (EndpointConfig.merge_loads)
        self._forming: dict[tuple[int, bool], LoadGroup] = {}
        #: per source: its small round trips in flight, as lanes lent like slabs
        #: (EndpointConfig.small_round_trips; empty without a cap)
        self._lanes: dict[int, SlabPool] = {}
        #: per receive slab, the event of its last unpack (CUDA: reused only once it has run)
        self._unpacked: dict[int, torch.cuda.Event] = {}
        self._idle: anyio.Event | None = None
        self._state = "new"   # new -> open -> closing -> closed
        self._closed = anyio.Event()
        self._stack: AsyncExitStack | None = None
        #: every background task (guarded: a crash is logged and fails what it concerns)
        self._tg: Tasks | None = None
        self._inbox: MemoryObjectSendStream[tuple[int, ParsedLoad, int]] | None = None
        self.send_slab: Slab | None = None
        self._registered_at_start = 0

    def _rows_of(self, slab: Slab) -> SlabRows:
        """A receive slab's unpack table (made once, when the slab joins)."""
        return SlabRows(slab.tensor, self._block_sizes)

    @property
    def _slabs(self) -> RecvSlabs[SlabRows]:
        """The receive slabs (they exist from ``__aenter__`` on)."""
        if self._recv is None:
            raise EndpointClosedError("endpoint is not open (use `async with Endpoint(...)`)")
        return self._recv

    @property
    def recv_slab(self) -> Slab | None:
        """The receive slab the next load would be written into (``None`` while every one
        is in use; a fenced one leaves the pool: see :attr:`recv_slab_stats`)."""
        return self._recv.current if self._recv is not None else None

    @property
    def send_slabs(self) -> tuple[Slab, ...]:
        """The send-slab pool (:attr:`send_slab` is its first slab)."""
        return tuple(self._send_slabs)

    @property
    def recv_slabs(self) -> tuple[Slab, ...]:
        """Every receive slab registered (the pool, spares and fenced ones)."""
        return tuple(self._recv.slabs.values()) if self._recv is not None else ()

    @property
    def recv_slab_stats(self) -> dict[str, int]:
        """Receive slabs: ``registered``, ``pool`` (K), ``usable`` (in the pool, free or
        lent), ``in_use``, ``waiting`` (loads waiting for one; a group of merged batches
        counts once), ``fenced_now`` (a lost source may still write them), ``spares``,
        and how many were ever ``fences``,
        ``released_late`` (the stale writer's late reply arrived) and
        ``released_reconnect``; ``send_slabs`` (S), ``sends_in_use``, and
        ``registered_at_start`` (S + K memory registrations) against
        ``registered_since_start`` (0 unless a fence needed a replacement)."""
        if self._recv is None:
            return {}
        return {**self._recv.stats(), "send_slabs": len(self._send_slabs),
                "sends_in_use": self._send.held, "registered_at_start": self._registered_at_start,
                "registered_since_start":
                    self.transport.memory_registrations - self._registered_at_start}

    # -- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> Endpoint:
        """Allocate the slabs, start the background tasks and the transport. A failure
        raises the real error and leaves nothing registered, listening or running."""
        if self._state != "new":
            raise EndpointClosedError("an Endpoint can be entered once")
        self._state = "starting"
        stack = AsyncExitStack()
        outer: TaskGroup | None = None
        try:
            sizes, cfg, dev = self.config.sizes, self.config, self.layout.device
            self._send_slabs = [allocate_slab("send", sizes.full, sizes.small, dev, i)
                                for i in range(cfg.send_slabs)]
            recv_slabs = [allocate_slab("recv", sizes.full, sizes.small, dev, i)
                          for i in range(cfg.receive_slabs)]
            self.send_slab = self._send_slabs[0]
            self._block_sizes = [spec.block_nbytes for spec in self.layout.layers.values()]
            if self.layout.device.type == "cuda":
                try:
                    self._device_runs = DeviceRuns(self.layout.device)
                except Exception:  # no Triton here: the tensor path
                    log.info("fused pack/unpack unavailable; using tensor copies", exc_info=True)
            self._send_rows = [SlabRows(slab.tensor, self._block_sizes) for slab in self._send_slabs]
            self._recv = RecvSlabs(recv_slabs, self._rows_of)
            await stack.__aenter__()
            outer = await stack.enter_async_context(anyio.create_task_group())
            # Background work runs in a task group hosted by a task of its own, so that
            # stopping it (aclose) never cancels the caller's code inside `async with`.
            self._tg = Tasks(await outer.start(self._host_background), f"rank {self.rank}")
            send, recv = anyio.create_memory_object_stream[tuple[int, ParsedLoad, int]](
                max_buffer_size=1 << 16)
            self._inbox = send
            stack.push_async_callback(self._shutdown_tasks)
            self._tg.start_soon(self._serve_loop, recv, name=f"xavier-serve-{self.rank}")
            await self.transport.start(self._host, self.send_slab, recv_slabs[0], self._tg)
            for slab in self._send_slabs[1:]:
                await self.transport.add_send_slab(slab)
            for slab in recv_slabs[1:]:
                await self.transport.add_recv_slab(slab)
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
            self._tg = None
            self._state = "closed"
            self._closed.set()
            raise
        self._stack = stack
        self._state = "open"
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

    @staticmethod
    async def _host_background(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            task_status.started(tg)
            await anyio.sleep_forever()

    async def _shutdown_tasks(self) -> None:
        if self._tg is not None:
            self._tg.cancel()

    @property
    def _running(self) -> bool:
        """Open, with its task group: new background work may start."""
        return self._tg is not None and self._state == "open"

    def _spawn(self, func: Any, *args: Any, on_crash: Any = None) -> None:
        """Start a guarded background task (a crash is logged and fails what it concerns
        through ``on_crash``; it never escapes ``async with``)."""
        if self._tg is None:
            raise EndpointClosedError("endpoint is not open")
        self._tg.start_soon(func, *args, on_crash=on_crash)

    async def aclose(self) -> None:
        """Drain in-flight work, reject new work, release the transport. Idempotent; a
        cancelled close still finishes its cleanup before the cancellation propagates."""
        if self._state == "new":
            self._state = "closed"
            self._closed.set()
            return
        if self._state in ("closing", "closed"):
            held = await wait_terminal(self._closed.wait)
            if held is not None:
                raise held
            return
        self._state = "closing"
        held = None
        with anyio.CancelScope(shield=True):
            try:
                if self._inflight:
                    self._idle = anyio.Event()
                    held = await wait_terminal(self._idle.wait)
                self._requests.fail(EndpointClosedError("endpoint closed"))
                await self.transport.aclose()
                self.metrics.memory_registrations = self.transport.memory_registrations
                if self._inbox is not None:
                    self._inbox.close()
            finally:
                self._state = "closed"
                self._closed.set()
                if self._tg is not None:
                    self._tg.cancel()
        if held is not None:
            raise held

    @property
    def closed(self) -> bool:
        return self._state in ("closing", "closed")

    def _check_open(self) -> None:
        if self._state != "open":
            raise EndpointClosedError(
                "endpoint is not open (use `async with Endpoint(...)`)" if self._state == "new"
                else "endpoint is closed")
        if self._forks != _forks:
            raise EndpointClosedError(
                f"this Endpoint was created in process {self._pid}; a forked child cannot use "
                "it (its event loop, transport and registrations belong to the parent): create "
                "endpoints in the child, and start children with the 'spawn' method")

    def _enter_work(self) -> None:
        self._check_open()
        self._inflight += 1

    def _leave_work(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    @asynccontextmanager
    async def _send_work(self) -> AsyncIterator[None]:
        """Counted as in-flight work, holding the first send slab (for callers outside the
        serve path, such as the benchmark's bare copies through :attr:`send_slab`)."""
        self._enter_work()
        try:
            index = await self._send.acquire(False, want=0)
            try:
                yield
            finally:
                self._send.release(index)
        finally:
            self._leave_work()

    # -- peers --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Give this to a peer's :meth:`connect`."""
        return self.transport.address

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._channels))

    async def connect(self, address: str, *, timeout: float | None = None) -> int:
        """Handshake with the endpoint at ``address`` (both ends learn each other). Returns
        the peer's rank. Idempotent: connecting to a connected peer, or both ends
        connecting at once, leaves exactly one connection and returns the peer's rank.
        ``timeout``: seconds for this handshake (default: the transport's). Raises
        :class:`HandshakeError` or :class:`LayoutMismatchError`."""
        self._check_open()
        if not isinstance(address, str) or not address:
            raise HandshakeError(f"peer address must be a non-empty string, got {address!r}")
        if timeout is not None:
            timeout = check_number("timeout", timeout, strictly_positive=True)
        rank, _ = await self.transport.connect(address, timeout)
        return rank

    async def disconnect(self, peer: int) -> None:
        """Drop the connection to ``peer`` (idempotent; an unknown peer is ignored). Loads
        from it that are waiting fail with :class:`PeerLostError`; the peer sees us go."""
        self._check_open()
        peer = check_int("peer", peer, minimum=0)
        if peer in self._channels:
            self._peer_lost(peer, PeerLostError(f"rank {self.rank} disconnected from rank {peer}"),
                            disconnect=False)
        self._lost.pop(peer, None)  # an explicit disconnect: the peer is unknown from now on
        await self._disconnect(peer)

    def channel(self, peer: int) -> PeerChannel:
        """The channel this endpoint uses to write to ``peer``."""
        ch = self._channels.get(peer)
        if ch is None:
            raise UnknownPeerError(f"rank {peer} is not connected to rank {self.rank}")
        return ch

    def policy(self, peer: int) -> ChannelPolicy:
        """The state machine of the channel to ``peer``."""
        return self.channel(peer).policy

    def peer_hello(self, peer: int) -> dict[str, Any]:
        """What ``peer`` said about itself when it connected (``{}`` if not connected)."""
        return self._peer_hello.get(peer, {})

    def _hello(self) -> Hello:
        # ranks we may still write: a copy not yet terminal, or a connection we have not
        # seen end (a peer that reconnects to us meanwhile must not trust it is over)
        unsettled = self.transport.unsettled() | set(self._channels)
        return Hello(self.rank, self.layout.wire(), self.config.sizes, self.layout.device.type,
                     version=protocol.PROTOCOL_VERSION, extras=self._hello_extras,
                     incarnation=self.incarnation, epochs=dict(self._epoch),
                     unsettled=tuple(sorted(unsettled)))

    def _peer_joined(self, peer: int, hello: dict[str, Any]) -> None:
        cfg = self.config
        facts = peer_facts(self.rank, hello, self._epoch)
        self._epoch[peer] = facts.epoch_as_receiver
        self._min_epoch[peer] = facts.min_epoch
        self._peer_inc[peer] = facts.incarnation
        self._lost.pop(peer, None)
        if self._recv is not None and not facts.writes_unsettled:
            # the same endpoint instance, under a new epoch, vouches that none of its
            # writes to us can still land: its fenced slabs are free again
            self._recv.release_peer(peer, facts.incarnation)
        old = self._channels.get(peer)
        if old is not None:  # a restarted peer: start from a clean channel
            old.policy.reset()
        self._channels[peer] = PeerChannel(
            peer, self.transport, self._send_slabs, ChannelPolicy.of(cfg.sizes, cfg.streak),
            cfg.retry, self.metrics.peer(peer), trimmed=cfg.trimmed, trim_align=cfg.trim_align)
        self._peer_hello[peer] = hello
        if cfg.map_eagerly and self._running:
            self._spawn(self._map_all, peer, self._channels[peer])

    async def _map_all(self, peer: int, ch: PeerChannel) -> None:
        """``map_eagerly``: map every (send slab, view, receive slab) pair for ``peer``."""
        try:
            slabs = self.transport.peer_recv_slabs(peer)
            for send, slab in enumerate(self._send_slabs):
                for view in dict.fromkeys(v.name for v in slab.views):
                    for recv in slabs:
                        if self._channels.get(peer) is not ch:
                            return  # lost or restarted meanwhile
                        await ch.mapping(view, recv, send)
        except XavierError as exc:  # mapping on first use will try again
            log.debug("rank %d: eager mapping for rank %d stopped: %s", self.rank, peer, exc)

    def _peer_lost(self, peer: int, exc: BaseException, *, disconnect: bool = True) -> None:
        """Fail what waits on ``peer`` and reset its channel; with ``disconnect``, drop the
        transport's connection too (in a task: this is called from transport callbacks)."""
        self._requests.fail(exc if isinstance(exc, XavierError) else PeerLostError(str(exc)), peer)
        if peer in self._channels:
            self._lost[peer] = str(exc)
        ch = self._channels.pop(peer, None)
        self._peer_hello.pop(peer, None)
        if ch is not None:
            ch.reset_now()
        if disconnect and self._running:
            self._spawn(self._disconnect_lost, peer)

    async def _disconnect_lost(self, peer: int) -> None:
        """Release a lost peer's connection, unless it has connected again meanwhile (a
        disconnect by rank would then drop the new connection)."""
        if peer not in self._channels:
            await self._disconnect(peer)

    async def _disconnect(self, peer: int) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.transport.disconnect(peer)
            except Exception:
                log.debug("rank %d: disconnect of rank %d failed", self.rank, peer, exc_info=True)

    # -- publishing ---------------------------------------------------------------------
    def publish(self, key: BlockKey, slot: int, *, layers: Iterable[LayerId] | None = None) -> None:
        """Make ``key`` loadable by peers: it lives at ``slot`` of each layer's cache
        (all layers by default). Every argument is checked before anything is published:
        a malformed one raises :class:`InvalidRequestError`, and publishes nothing."""
        if self.closed:
            raise EndpointClosedError("endpoint is closed: it publishes nothing any more")
        check_key(key)
        targets = list(self.caches) if layers is None else check_layers(layers)
        if not targets:
            check_int("slot", slot, minimum=0)
        for layer in targets:
            if layer not in self.caches:
                raise InvalidRequestError(f"unknown layer {layer!r}")
            slot = check_slot(slot, self.layout.layers[layer], layer)
        for layer in targets:
            self._published[layer][key] = slot

    def unpublish(self, key: BlockKey, *, layers: Iterable[LayerId] | None = None) -> None:
        """Stop serving ``key`` (keys and layers that are not published are ignored). A
        malformed key or ``layers`` raises :class:`InvalidRequestError`."""
        check_key(key)
        for layer in (self.caches if layers is None else check_layers(layers)):
            self._published.get(layer, {}).pop(key, None)

    # -- loading (receiver side) ----------------------------------------------------------
    async def load(self, requests: LoadRequest | Iterable[LoadRequest]) -> LoadResult:
        """Load blocks ``{source rank: {layer: {block key: slot or [slots]}}}`` into the
        local caches. Several requests may be passed as a list; they are merged. Every
        check runs before any byte moves.

        On CUDA caches ``load`` returns once the blocks are in their slots (the unpack is
        synchronized). With ``EndpointConfig(stream_ordered_unpack=True)`` it returns as
        soon as the unpack is enqueued on the current stream of the caches' device: work
        on that stream sees the blocks, another stream must wait on it first, as with any
        asynchronous CUDA copy."""
        t0 = perf_counter_ns()
        self._check_open()
        if requests is None or isinstance(requests, (str, bytes)) or not isinstance(
                requests, (Mapping, Iterable)):
            raise InvalidRequestError(
                "a load request must be a mapping {source rank: {layer: {block key: slot}}} "
                f"(or a list of those), got {type(requests).__name__}")
        try:
            planned = self._planner.plan(requests)
        except TypeError as exc:  # something inside the request is not what it should be
            raise InvalidRequestError(f"malformed load request: {exc}") from exc
        batches = [(b.src, b) for b in planned]
        for src in dict.fromkeys(b.src for b in planned):
            if src == self.rank:
                raise InvalidRequestError(f"rank {src} cannot load from itself")
            if src not in self._channels:
                raise self._not_connected(src)
        self._stages.plan.record(perf_counter_ns() - t0)
        self._enter_work()
        self.metrics.loads += 1
        useful = wire = blocks = done = 0
        try:
            if len(batches) > 1:
                # several copies: every source confirms every key first, so that a refusal
                # comes before any byte moves (one round trip, only for multi-batch loads)
                wires: dict[int, list[Any]] = {}
                for src, batch in batches:
                    wires.setdefault(src, []).extend(batch.wire())
                for src, items in wires.items():
                    await self._probe(src, items)
            for src, batch in batches:
                wire += await self._load_batch(src, batch)
                useful += batch.useful_bytes
                blocks += batch.blocks
                done += 1
        except XavierError as exc:
            if done:
                exc.add_note(f"{done} of {len(batches)} batches ({blocks} blocks, {useful} B) of "
                             "this load were already written into their slots")
                exc.partial = LoadResult(done, blocks, useful, wire)  # type: ignore[attr-defined]
            raise
        finally:
            self._leave_work()
        self._stages.total.record(perf_counter_ns() - t0)
        return LoadResult(len(batches), blocks, useful, wire)

    def _not_connected(self, src: int) -> XavierError:
        """Why ``src`` cannot be loaded from: lost (its loads fail until it reconnects) or
        unknown."""
        if src in self._lost:
            return PeerLostError(f"rank {src} was lost ({self._lost[src]}); reconnect it, "
                                 "or disconnect() it to forget it")
        return UnknownPeerError(f"rank {src} is not connected to rank {self.rank}")

    async def _probe(self, src: int, items: list[Any]) -> None:
        """Ask ``src`` whether every key in ``items`` is published (nothing is written)."""
        replied = anyio.Event()
        req = self._requests.open(src, replied.set)
        try:
            await self.transport.send(src, Probe(req.req_id, items, self._epoch.get(src, 0)).to_wire())
            with anyio.move_on_after(self.config.request_timeout):
                await replied.wait()
            if not req.done:
                raise PeerLostError(f"rank {src} did not answer within {self.config.request_timeout} s")
            if req.error is not None:
                self.metrics.peer(src).load_errors += 1
                raise req.error
        finally:
            self._requests.close(req)

    async def _borrow_recv_slab(self, large: bool) -> Slab:
        """A receive slab from the pool, waiting for one when all are busy (a cancellation
        while waiting takes nothing). When fences have left fewer than K usable slabs and
        none is free, a replacement is allocated and registered (a registration caused by
        a failure, never in steady state)."""
        recv = self._slabs
        return recv.slabs[await self._take(recv.pool.enqueue(large))]

    async def _take(self, ticket: Ticket) -> int:
        """Wait for ``ticket``'s slab; first, if fences have left the pool short and the
        ticket must wait, register a replacement (it joins the pool: granted to the first
        waiter). A failure or a cancellation cancels the ticket: it takes nothing."""
        recv = self._slabs
        try:
            if not ticket.granted and recv.short():
                await self._add_recv_slab()
        except BaseException:
            ticket.cancel()
            raise
        return await ticket.take()

    async def _add_recv_slab(self) -> None:
        """Allocate and register one more receive slab (replacing a fenced one). Its
        index is taken before anything is awaited (two replacements registered at once
        never share one); it joins the pool, with its unpack table, only once the
        transport has registered it."""
        recv = self._slabs
        self._check_open()
        sizes = self.config.sizes
        slab = allocate_slab("recv", sizes.full, sizes.small, self.layout.device, recv.new_index())
        recv.registering += 1
        try:
            with anyio.CancelScope(shield=True):  # registered and pooled, or neither
                await self.transport.add_recv_slab(slab)
        except XavierError:
            raise
        except Exception as exc:
            raise RegistrationError(f"registering a replacement receive slab failed: {exc}") from exc
        finally:
            recv.registering -= 1
        recv.add(slab)
        log.info("rank %d: receive slab %d registered (replaces a fenced one)", self.rank, slab.index)

    def _replenish_soon(self) -> None:
        """After a fence: loads already waiting for a slab get a replacement registered
        for them (a load that arrives later does it itself)."""
        recv = self._recv
        if recv is not None and recv.pool.waiting and recv.short() and self._running:
            recv.registering += 1  # counted at once: one replacement per shortage
            self._spawn(self._replenish)

    async def _replenish(self) -> None:
        """Register a replacement for the loads waiting for a slab, retried with the
        config's backoff. If it cannot be registered and no slab is left in the pool to
        come back to them, the waiters fail with :class:`RegistrationError`."""
        recv = self._slabs
        recv.registering -= 1
        delays = self.config.retry.delays()
        while True:
            try:
                await self._add_recv_slab()
                return
            except Exception as exc:
                delay = next(delays, None)
                if delay is not None and self._running and recv.pool.waiting and recv.short():
                    await anyio.sleep(delay)
                    continue
                if not recv.pool.usable and not recv.registering:
                    n = recv.pool.fail_waiters(RegistrationError(
                        f"every receive slab is fenced and a replacement could not be "
                        f"registered: {exc}"))
                    log.warning("rank %d: registering a replacement receive slab failed; %d "
                                "waiting load(s) failed", self.rank, n, exc_info=True)
                else:
                    log.warning("rank %d: registering a replacement receive slab failed; waiting "
                                "loads wait for a slab to come back", self.rank, exc_info=True)
                return

    def _fence(self, src: int, req: PendingRequest, slab: Slab) -> None:
        """``src`` may still write ``slab`` for ``req``: it leaves the pool and is never
        loaded into again until that is impossible (see :class:`RecvSlabs`)."""
        self._slabs.fence(slab.index, src, self._peer_inc.get(src, ""), req.req_id)
        log.warning("rank %d: receive slab %d fenced (rank %d may still write it for request %d)",
                    self.rank, slab.index, src, req.req_id)
        self._replenish_soon()

    async def _load_batch(self, src: int, batch: PlannedBatch) -> int:
        """One batch's round trip: borrow a receive slab (the head-of-line rule: a batch
        larger than the small view is "large"), request, wait, unpack, give it back. With
        ``merge_loads``, a batch that would wait for a slab joins its source's forming
        group (or starts one) instead, and is carried by the group's round trip."""
        recv = self._slabs
        large = batch.nbytes > self._small
        lane = None
        if not self.config.merge_loads:
            slab = await self._borrow_recv_slab(large)
        else:
            group = self._forming.get((src, large))
            if group is not None and group.fits(batch):
                return await self._in_group(group, group.add(batch))
            if not large and self.config.small_round_trips is not None:
                lane = self._lanes_of(src).enqueue(False)
            # every small round trip to src is busy, or every slab is: wait as a group
            ticket = recv.pool.enqueue(large) if lane is None or lane.granted else None
            if ticket is None or not ticket.granted:
                group = LoadGroup(src, large, self.config.sizes.full if large
                                  else self._merge_small, ticket)
                group.lane = lane
                group.done = anyio.Event()
                self._forming[(src, large)] = group
                member = group.add(batch)
                self._spawn(self._run_group, group)
                return await self._in_group(group, member)
            try:
                slab = recv.slabs[await ticket.take()]
            except BaseException:
                if lane is not None:
                    lane.cancel()  # nothing was requested: the lane is free again
                raise
        lent = [True]  # cleared when the slab is fenced: it then stays out of the pool
        try:
            return await self._load_into(src, batch, slab, lent)
        finally:
            if lent[0]:  # the copy is terminal (or was never requested): the slab is free
                recv.pool.release(slab.index)
            if lane is not None:
                lane.pool.release(lane.claim())  # the round trip is over

    def _lanes_of(self, src: int) -> SlabPool:
        """``src``'s small round-trip lanes (``EndpointConfig.small_round_trips``)."""
        lanes = self._lanes.get(src)
        if lanes is None:
            lanes = self._lanes[src] = SlabPool(range(self.config.small_round_trips or 1))
        return lanes

    async def _in_group(self, group: LoadGroup, member: Member) -> int:
        """Wait for ``member``'s group. Cancelled before the group starts, the member
        leaves it and takes nothing; after, its copy is waited for (shielded), it is not
        unpacked, and the cancellation is re-raised."""
        try:
            await group.done.wait()
        except BaseException:
            if not group.started:
                group.remove(member)
                if not group.members:  # nobody left: the group leaves the queues
                    self._close_group(group)
                    for ticket in (group.ticket, group.lane):
                        if ticket is not None:
                            ticket.cancel()
                    if group.scope is not None:
                        group.scope.cancel()
                raise
            member.cancelled = True
            with anyio.CancelScope(shield=True):
                await group.done.wait()
            raise
        if member.error is not None:
            raise member.error
        return member.wire_bytes

    def _close_group(self, group: LoadGroup) -> None:
        """No batch joins ``group`` any more."""
        key = (group.src, group.large)
        if self._forming.get(key) is group:
            del self._forming[key]

    async def _run_group(self, group: LoadGroup) -> None:
        """A group's round trip (a background task): wait for its slab, then load every
        member as one batch; each member gets its share or its own copy of the error. A
        merged request the source refuses is asked again batch by batch."""
        recv = self._slabs
        index: int | None = None
        lane: int | None = None
        src = group.src
        try:
            if group.members:  # (the last member to leave cancels the tickets and this scope)
                with anyio.CancelScope() as group.scope:
                    if group.lane is not None:  # first a small round trip to src, then a slab
                        lane = await group.lane.take()
                        if group.ticket is None:
                            group.ticket = recv.pool.enqueue(False)
                    try:
                        index = await self._take(group.ticket)
                    except XavierError as exc:  # a replacement slab could not be registered
                        group.fail(exc)
                        return
            group.started = True
            self._close_group(group)
            if index is None or not group.members:  # every member left before the slab came
                return
            slab = recv.slabs[index]
            lent = [True]
            try:
                try:
                    group.share(await self._load_into(src, group.merged(), slab, lent))
                    self.metrics.peer(src).batches_merged += len(group.members) - 1
                except RemoteError as exc:
                    if type(exc) is not RemoteError or len(group.members) == 1 or not lent[0]:
                        raise
                    await self._load_each(group, slab, lent)  # a refusal: nothing moved
            except XavierError as exc:
                group.fail(exc)
            except Exception as exc:  # a broken invariant: logged, the members fail typed
                log.exception("rank %d: a merged load from rank %d failed", self.rank, src)
                group.fail(InternalError(f"loading from rank {src} failed: {exc!r}"))
            finally:
                if lent[0]:
                    recv.pool.release(index)
        except Exception as exc:  # a broken invariant: the members fail with a typed error
            group.fail(InternalError(f"a merged load from rank {src} failed: {exc!r}"))
            raise  # (logged by the task guard)
        finally:
            self._close_group(group)
            group.started = True
            if lane is not None:  # the round trip is over (or never started)
                group.lane.pool.release(lane)
            elif group.lane is not None:
                group.lane.cancel()
            if group.ticket is not None and index is None:
                # a shutdown while the group waited for its lane leaves its slab ticket
                # queued: give back a slab granted to nobody (idempotent otherwise)
                group.ticket.cancel()
            # whatever stopped this task (the endpoint's shutdown), no member waits forever
            group.fail(EndpointClosedError("the endpoint closed while this load waited"))
            group.done.set()

    async def _load_each(self, group: LoadGroup, slab: Slab, lent: list[bool]) -> None:
        """Load a refused group's members one by one into its slab: only the members
        naming unpublished keys fail."""
        for m in group.members:
            if m.cancelled:
                continue
            m.base = 0
            try:
                m.land(await self._load_into(group.src, MergedBatch(group.src, [m], m.batch.nbytes),
                                             slab, lent))
            except XavierError as exc:
                m.fail(exc)
                if not lent[0]:  # fenced: the rest cannot use this slab
                    group.fail(exc)
                    return

    async def _load_into(self, src: int, batch: PlannedBatch | MergedBatch, slab: Slab,
                         lent: list[bool]) -> int:
        m = self.metrics.peer(src)
        if src not in self._channels:  # lost (or gone) while this batch waited for a slab
            raise self._not_connected(src)
        self._recv_slab_free(slab)
        if slab.index:
            await self.transport.share_recv_slab(src, slab)
        landed = anyio.Event()
        req = self._requests.open(src, landed.set)
        try:
            # from the first byte of the request on, the copy is "started": it is
            # waited for until the source reports a terminal state
            deadline = anyio.current_time() + self.config.request_timeout
            sent = 0  # perf_counter_ns once the request is out
            msg = Load.of(req.req_id, batch, self._epoch.get(src, 0), slab.index,
                          self.config.verify).to_wire()

            async def request_and_wait() -> None:
                nonlocal sent
                if not sent:
                    # marked before awaiting: a native cancellation that gets through
                    # the shield during the send must not send the request twice
                    t_post = sent = perf_counter_ns()
                    try:
                        await self.transport.send(src, msg)
                    except XavierError as exc:
                        req.fail(exc, settled=True)  # never sent: nothing can land
                    sent = perf_counter_ns()
                    self._stages.post.record(sent - t_post)
                await landed.wait()

            held = await wait_terminal(request_and_wait, deadline)
            self._stages.wait.record(perf_counter_ns() - sent)
            if not req.done:
                m.load_errors += 1
                # the source may still write this slab, late: fence it first
                self._fence(src, req, slab)
                lent[0] = False
                lost = PeerLostError(
                    f"rank {src} did not complete a copy within {self.config.request_timeout} s")
                self._peer_lost(src, lost, disconnect=False)
                await self._disconnect(src)  # here, not in a task that could outlive a reconnect
                raise held or lost
            if req.error is not None and not req.settled:
                self._fence(src, req, slab)  # failed, but a write for it may still land
                lent[0] = False
        finally:
            self._requests.close(req)
        if held is not None:
            raise held
        if req.error is not None:
            m.load_errors += 1
            raise req.error
        if req.slab != slab.index:  # unpack only from the slab the source says it wrote
            m.load_errors += 1
            log.error("rank %d: rank %d reports writing receive slab %d for request %d, which "
                      "asked for slab %d", self.rank, src, req.slab, req.req_id, slab.index)
            raise IntegrityError(
                f"rank {src} reports writing receive slab {req.slab}, but this batch was "
                f"requested into slab {slab.index}: not unpacked, the slots keep their contents")
        # a cancellation that arrived during the copy surfaces here, before unpacking
        await anyio.lowlevel.checkpoint()
        if self.config.verify:
            got = payload_digest(slab.tensor, batch.nbytes)
            if got != req.digest:
                m.load_errors += 1
                raise IntegrityError(
                    f"batch from rank {src} failed verification (digest {got}, the source "
                    f"sent {req.digest}): not unpacked, the slots keep their contents")
        t_unpack = perf_counter_ns()
        await self._unpack(batch, slab)
        self._stages.unpack.record(perf_counter_ns() - t_unpack)
        m.batches_received += 1
        m.bytes_received += req.wire_bytes
        return req.wire_bytes

    async def _unpack(self, batch: PlannedBatch | MergedBatch, slab: Slab) -> None:
        # one pass (memmoves on the CPU, one fused launch on CUDA). This receive slab is
        # lent again only after its unpack has run (_recv_slab_free). Stream-ordered: only
        # enqueued, and the caches' current stream waits on its event. Otherwise its event
        # is spun on briefly (a small unpack is done within that), then polled, shielded
        # (the slots are being written whatever happens), so that other loads progress
        # while the device copies a large batch instead of the event loop blocking
        event = unpack(self._slabs.rows[slab.index], batch, self._cache_table, self._device_runs,
                       wait=False)
        if event is None:
            return
        self._unpacked[slab.index] = event
        if self.config.stream_ordered_unpack:
            torch.cuda.current_stream(self.layout.device).wait_event(event)
            return
        until = perf_counter_ns() + _UNPACK_SPIN_NS  # a small unpack is done by then
        while not event.query():
            if perf_counter_ns() > until:
                with anyio.CancelScope(shield=True):
                    while not event.query():
                        await anyio.lowlevel.checkpoint()
                break
        self._unpacked.pop(slab.index, None)

    def _recv_slab_free(self, slab: Slab) -> None:
        """Wait for the last unpack out of ``slab`` to have read it (CUDA only), before a
        request names it again."""
        event = self._unpacked.pop(slab.index, None)
        if event is not None:
            event.synchronize()

    # -- serving (source side) ------------------------------------------------------------
    def _on_message(self, peer: int, msg: bytes, inline: bool) -> None:
        try:
            message = decode(msg)
        except ProtocolError:
            log.warning("rank %d: dropped malformed message from rank %d", self.rank, peer)
            return
        if isinstance(message, Load):
            self._on_load(peer, message, inline)
        elif isinstance(message, Probe):
            self._on_probe(peer, message)
        elif self._requests.reply(peer, message) is None:
            self._late_reply(peer, message)

    def _on_late(self, peer: int, msg: bytes) -> None:
        """A message from a connection that has ended: only replies count (they release
        fenced receive slabs); requests are never served."""
        try:
            message = decode(msg)
        except ProtocolError:
            return
        if isinstance(message, (Landed, Error)):
            self._late_reply(peer, message)

    def _late_reply(self, peer: int, message: Landed | Error) -> None:
        """A reply to a request we no longer wait for: if it is the stale writer of a
        fenced slab and its write is terminal, the slab is free again."""
        settled = isinstance(message, Landed) or message.settled
        if settled and self._recv is not None and self._recv.release_reply(peer, message.req_id):
            log.info("rank %d: fenced receive slab released (late reply %d from rank %d)",
                     self.rank, message.req_id, peer)
        else:
            log.debug("rank %d: stray %r from rank %d", self.rank, message, peer)

    def _on_probe(self, peer: int, probe: Probe) -> None:
        stale = check_epoch(probe.req_id, probe.epoch, self._min_epoch.get(peer, 0))
        err = stale.error if stale is not None else check_probe(probe, self.layout, self._published)
        if self._running:
            self._spawn(self._reply, peer, probe.req_id, err)

    async def _reply(self, peer: int, req_id: int, err: XavierError | None) -> None:
        if err is not None:
            await self._reply_error(peer, req_id, err)
            return
        try:
            await self.transport.send(peer, Landed(req_id, 0).to_wire())
        except XavierError:
            pass

    def _on_load(self, peer: int, load: Load, inline: bool) -> None:
        """The one serve path. A request is parsed once; then, with ``inline`` (called from
        the transport's poller) and when no queued request is still waiting to commit, it
        is served right here if a send slab is free for it and :func:`decide` says
        ``Ready`` for that slab: packed and posted without awaiting anything (a copy still
        running after the post is finished by a task). Everything else goes to the serve
        queue, in arrival order; queued requests are served concurrently, each in a task
        of its own holding a send slab (:meth:`_serve_loop`)."""
        arrived = perf_counter_ns()
        stale = check_epoch(load.req_id, load.epoch, self._min_epoch.get(peer, 0))
        if stale is not None:  # its receiver moved on (gave up, or reconnected since)
            self._spawn_reply(peer, stale.req_id, stale.error)
            return
        parsed = parse_load(load, self.layout, self.config.full_bytes)
        if isinstance(parsed, Refuse):
            self._spawn_reply(peer, parsed.req_id, parsed.error)
            return
        if inline and self._state == "open" and not self._queued and self._inbox is not None:
            ch = self._channels.get(peer)
            send = self._send.try_acquire(parsed.payload > self._small)
            if ch is not None and send is not None:
                t_lookup = perf_counter_ns()
                d = decide(parsed, self._published, ch.policy, ch.mapped_for(send))
                self._stages.lookup.record(perf_counter_ns() - t_lookup)
                if isinstance(d, Ready):
                    self._inflight += 1
                    self._stages.queue.record(0)
                    self._post_inline(ch, peer, d, send)
                    return
                self._send.release(send)
                if isinstance(d, Refuse):
                    self._spawn_reply(peer, d.req_id, d.error)
                    return
            elif send is not None:
                self._send.release(send)
        if self._inbox is not None:
            try:
                self._inbox.send_nowait((peer, parsed, arrived))
                self._queued += 1  # until committed: later requests may not overtake it
                return
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
        log.warning("rank %d: cannot serve rank %d now (closing)", self.rank, peer)

    def _post(self, ch: PeerChannel, ready: Ready, send: int) -> tuple[CopyPlan, object | None, int]:
        """Commit the machine, pack send slab ``send`` (one pass; on CUDA one launch whose
        event is waited for, not the device), post the copy. Returns the plan, the
        transport's pending token (None: already DONE) and when it was posted
        (perf_counter_ns)."""
        load = ready.load
        plan = ch.commit(load.payload, ready.view, load.useful, load.slab, send)
        t_pack = perf_counter_ns()
        try:
            event = pack(self._send_rows[send], load.segments, ready.slot_lists, self._cache_table,
                         self._device_runs)
            if event is not None:  # NIXL does not order against CUDA streams
                event.synchronize()
            digest = (payload_digest(self._send_slabs[send].tensor, load.payload)
                      if load.verify else None)
        except Exception as exc:  # the machine advanced but nothing was posted: start over
            ch.metrics.failures += 1
            ch.reset_now()
            raise TransferError(f"packing a batch for rank {ch.peer} failed: {exc!r}") from exc
        posted = perf_counter_ns()
        self._stages.pack.record(posted - t_pack)
        pending = ch.post(plan, Landed(load.req_id, plan.wire_bytes, digest, plan.slab).to_wire())
        if pending is None:
            self._stages.post_to_done.record(perf_counter_ns() - posted)
        return plan, pending, posted

    def _post_inline(self, ch: PeerChannel, peer: int, ready: Ready, send: int) -> None:
        """Serve from the poller (send slab ``send`` held, work counted); never raises."""
        try:
            plan, pending, posted = self._post(ch, ready, send)
        except Exception as exc:  # reply with the error; never raise into the poller
            self._send.release(send)
            self._leave_work()
            err = exc if isinstance(exc, XavierError) else TransferError(f"serving failed: {exc!r}")
            self._spawn(self._after_failure, ch, peer, ready.load.req_id, err)
            return
        if pending is None:
            self._send.release(send)
            self._leave_work()
        else:
            self._spawn(self._finish_inline, ch, peer, ready.load.req_id, plan, pending, posted,
                        send)

    async def _finish_inline(self, ch: PeerChannel, peer: int, req_id: int, plan: CopyPlan,
                             pending: object, posted: int, send: int) -> None:
        try:
            await ch.finish(plan, pending)
            self._stages.post_to_done.record(perf_counter_ns() - posted)
        except XavierError as exc:
            await self._reply_error(peer, req_id, exc)
        finally:
            self._send.release(send)  # the copy is terminal: nothing reads the slab now
            self._leave_work()

    async def _after_failure(self, ch: PeerChannel, peer: int, req_id: int, exc: XavierError) -> None:
        await ch.forget()
        await self._reply_error(peer, req_id, exc)

    def _spawn_reply(self, peer: int, req_id: int, exc: XavierError) -> None:
        if self._running:
            self._spawn(self._reply_error, peer, req_id, exc)

    async def _reply_error(self, peer: int, req_id: int, exc: XavierError) -> None:
        # settled: no write of ours to the peer can still land (a timed-out copy can)
        settled = peer not in self.transport.unsettled()
        try:
            await self.transport.send(peer, Error.of(req_id, exc, settled).to_wire())
        except XavierError:
            pass  # the peer is gone; it will notice on its own

    async def _serve_loop(self, inbox: MemoryObjectReceiveStream[tuple[int, ParsedLoad, int]]) -> None:
        """Start one task per queued request, in arrival order. Each takes its place in the
        send-slab pool's line here, synchronously, so requests get send slabs in the order
        they arrived (FIFO; a large one held back by the head-of-line rule does not hold
        back small ones behind it)."""
        async with inbox:
            async for peer, parsed, arrived in inbox:
                ticket = self._send.enqueue(parsed.payload > self._small)
                self._inflight += 1
                self._spawn(self._serve_queued, peer, parsed, arrived, ticket)

    async def _serve_queued(self, peer: int, load: ParsedLoad, arrived: int, ticket: Ticket) -> None:
        """Serve a request that may need awaiting: a send slab to wait for, a view to map.
        Until it commits (or fails), the inline path stays closed (no overtaking)."""
        queued = True
        send: int | None = None
        try:
            try:
                if self._state != "open":
                    raise EndpointClosedError(f"rank {self.rank} is closing")
                ch = self.channel(peer)
                first = decide(load, self._published, ch.policy, ch.mapped_for(0))
                if isinstance(first, Refuse):  # unknown keys: refused before anything else
                    raise first.error
                send = await ticket.take()
                self._stages.queue.record(perf_counter_ns() - arrived)
                while True:
                    t_lookup = perf_counter_ns()
                    d = decide(load, self._published, ch.policy, ch.mapped_for(send))
                    self._stages.lookup.record(perf_counter_ns() - t_lookup)
                    if isinstance(d, Refuse):
                        raise d.error
                    if isinstance(d, NeedsMapping):
                        await ch.mapping(d.view, d.slab, send)
                        if self._channels.get(peer) is not ch:  # the peer left (or restarted)
                            raise PeerLostError(f"rank {peer} went away before its copy")
                        continue
                    break
                # re-check right before posting (we may have waited): the requester
                # must still be connected on this channel and at this request's epoch
                if self._channels.get(peer) is not ch or self._state != "open":
                    raise PeerLostError(f"rank {peer} went away before its copy")
                stale = check_epoch(load.req_id, load.epoch, self._min_epoch.get(peer, 0))
                if stale is not None:
                    raise stale.error
                queued = False
                self._queued -= 1  # committed below, with nothing awaited before
                try:
                    plan, pending, posted = self._post(ch, d, send)
                except TransferError:
                    await ch.forget()
                    raise
                if pending is not None:  # not finished while posting
                    await ch.finish(plan, pending)
                    self._stages.post_to_done.record(perf_counter_ns() - posted)
            except XavierError as exc:
                await self._reply_error(peer, load.req_id, exc)
            except Exception as exc:  # never let one request stop the serving
                log.exception("rank %d: serving rank %d failed", self.rank, peer)
                await self._reply_error(peer, load.req_id,
                                        TransferError(f"rank {self.rank} failed serving: {exc!r}"))
        finally:
            if queued:
                self._queued -= 1
            if send is not None:
                self._send.release(send)  # the copy is terminal, or was never posted
            else:
                ticket.cancel()  # leave the line (or give back a slab granted meanwhile)
            self._leave_work()

    # -- diagnostics --------------------------------------------------------------------
    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise :class:`InternalError` if the slab bookkeeping is broken (a test aid for
        stacks that inject faults, as the chaos test does; cheap, no I/O): every receive
        slab is in exactly one of pool, spares and fenced, with its unpack table; no slab
        is lent twice; no waiter is left behind a free slab; the transport has registered
        exactly the send slabs and the receive slabs there are. With ``idle`` (nothing in
        flight), also: no slab is lent and no load waits for one."""
        recv = self._recv
        if recv is None:
            return
        recv.check()
        self._send.check()
        registered = self.transport.memory_registrations
        want = len(self._send_slabs) + len(recv.slabs) + recv.registering
        if registered != want and not (recv.registering and
                                       len(self._send_slabs) + len(recv.slabs) <= registered <= want):
            raise InternalError(f"the transport holds {registered} memory registrations, the "
                                f"endpoint {len(self._send_slabs)} send and {len(recv.slabs)} "
                                f"receive slabs ({recv.registering} being registered)")
        if idle and (recv.pool.held or recv.pool.waiting or self._send.held or self._send.waiting):
            raise InternalError(f"idle, yet slabs are lent or awaited: {self.recv_slab_stats}")

    def snapshot_metrics(self) -> dict[str, Any]:
        """Metrics as a plain dict (registrations include the transport's memory ones), with
        the slab pools' state under ``"slabs"`` (:attr:`recv_slab_stats`)."""
        self.metrics.memory_registrations = self.transport.memory_registrations
        return {**self.metrics.as_dict(), "slabs": self.recv_slab_stats}


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

"""The endpoint engine: one per serving replica (the I/O shell around the pure core).

An :class:`Endpoint` owns its caches' two slabs, one anyio task group (every background
task lives there), a :class:`PeerChannel` per connected peer, a send lock and a receive
lock. Loading from a peer::

    receiver                                   source
    load() validates + plans (no I/O yet)
    [recv lock] LOAD(req, keys)  ------------>  [send lock] pack into send slab
                                                channel: view by state machine,
                                                mapping on first use, WRITE + notify
    <-------------------------------- LANDED  (bytes are in the receive slab)
    unpack into cache slots, release recv lock

A copy that has started is waited for (shielded) until it reaches a terminal state, even
if the caller is cancelled; the cancellation is re-raised afterwards and the batch is not
unpacked, so the cache keeps its previous contents.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import codec
from .channel import CopyPlan, PeerChannel
from .errors import (EndpointClosedError, HandshakeError, InvalidRequestError, PeerLostError,
                     RegistrationError, RemoteError, TransferError, UnknownPeerError,
                     XavierError)
from .layout import BlockKey, CacheLayout, LayerId, check_key, check_layer_id, check_slot
from .metrics import EndpointMetrics
from .packing import SlabRows, byte_rows, gather, scatter
from .planning import Batch, LoadRequest, Segment, normalize, plan_batches, segments_from_wire
from .policy import DEFAULT_STREAK, ChannelPolicy, check_size
from .retry import RetryPolicy
from .slabs import Slab, allocate_slabs, slab_sizes
from .transports.base import Transport
from .transports.local import LocalTransport

log = logging.getLogger("xavier_async")

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class EndpointConfig:
    """Tuning knobs, all validated at construction.

    ``full_bytes``/``small_bytes``: the slab and its small prefix view (small defaults to
    ``min(full, 256 KiB)``). ``streak``: consecutive small batches before the small view is
    used (1 = size-only selection). ``trimmed``: copy only the payload rounded up to
    ``trim_align`` instead of the whole chosen view. ``request_timeout``: how long a
    receiver waits for a batch it requested (queueing at the source, packing and the copy)
    before declaring the source lost; keep it above the transport's own copy timeout
    (NIXL: 30 s), so a source whose copy stalls reports the failure itself first.
    ``accept_raw_copies``: let peers call :meth:`Endpoint.copy_raw` into our receive slab
    (benchmarks only: a raw copy overwrites the receive slab without coordination, so an
    endpoint that accepts them must not load anything meanwhile). ``stream_ordered_unpack``: on CUDA, let
    :meth:`Endpoint.load` return once the unpack is enqueued on the caches' current
    stream instead of waiting for it (saves a device synchronization per batch).
    """

    full_bytes: int = 12 * 1024 * 1024
    small_bytes: int | None = None
    streak: int = DEFAULT_STREAK
    trimmed: bool = False
    trim_align: int = 256
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_timeout: float = 60.0
    accept_raw_copies: bool = False
    stream_ordered_unpack: bool = False

    def __post_init__(self) -> None:
        full, small = slab_sizes(self.full_bytes, self.small_bytes)
        object.__setattr__(self, "full_bytes", full)
        object.__setattr__(self, "small_bytes", small)
        ChannelPolicy(full, small, self.streak)  # validates streak
        check_size("trim_align", self.trim_align)
        if not isinstance(self.request_timeout, (int, float)) or isinstance(self.request_timeout, bool) \
                or self.request_timeout <= 0:
            raise InvalidRequestError(f"request_timeout must be > 0 seconds, got {self.request_timeout!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise InvalidRequestError("retry must be a RetryPolicy")


@dataclass(frozen=True)
class LoadResult:
    """What one :meth:`Endpoint.load` moved."""

    batches: int
    blocks: int
    useful_bytes: int
    wire_bytes: int


async def _wait_held(event: anyio.Event, timeout: float | None = None) -> BaseException | None:
    """Wait for ``event`` (at most ``timeout`` s); call it inside a shielded scope.

    anyio's shield holds back anyio cancellation but not a native ``asyncio`` ``Task.cancel()``.
    Such a cancellation is caught here and the wait goes on; it is returned so the caller
    re-raises it once the copy is terminal."""
    held: BaseException | None = None
    deadline = None if timeout is None else anyio.current_time() + timeout
    while not event.is_set():
        try:
            if deadline is None:
                await event.wait()
            else:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    break
                with anyio.move_on_after(remaining):
                    await event.wait()
        except anyio.get_cancelled_exc_class() as exc:  # only a native one gets through the shield
            held = exc
    return held


class _Waiter:
    __slots__ = ("peer", "event", "wire_bytes", "error")

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.event = anyio.Event()
        self.wire_bytes = 0
        self.error: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        if not self.event.is_set():
            self.error = exc
            self.event.set()


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
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise InvalidRequestError(f"rank must be an int >= 0, got {rank!r}")
        self.rank = rank
        self.config = config if config is not None else EndpointConfig()
        self.layout = CacheLayout.of(caches)
        self.caches: dict[LayerId, torch.Tensor] = dict(caches)
        self._rows = byte_rows(self.caches)  # the caches as uint8 rows: copies are bit-exact
        self.transport: Transport = transport if transport is not None else LocalTransport()
        self.metrics = EndpointMetrics()
        self._published: dict[LayerId, dict[BlockKey, int]] = {layer: {} for layer in self.caches}
        self._channels: dict[int, PeerChannel] = {}
        self._peer_hello: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, _Waiter] = {}
        self._ids = itertools.count(1)
        # the send slab: held from packing until the copy is terminal (a semaphore, so the
        # task that finishes a copy started by the poller can release it)
        self._send_free = anyio.Semaphore(1, fast_acquire=True)
        self._recv_lock = anyio.Lock(fast_acquire=True)
        self._inflight = 0
        self._serving = False
        self._unpacked: torch.cuda.Event | None = None
        self._idle: anyio.Event | None = None
        self._state = "new"   # new -> open -> closing -> closed
        self._closed = anyio.Event()
        self._stack: AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._inbox: MemoryObjectSendStream[tuple[int, Any]] | None = None
        self.send_slab: Slab | None = None
        self.recv_slab: Slab | None = None

    # -- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> Endpoint:
        if self._state != "new":
            raise EndpointClosedError("an Endpoint can be entered once")
        cfg = self.config
        assert cfg.small_bytes is not None
        self.send_slab, self.recv_slab = allocate_slabs(cfg.full_bytes, cfg.small_bytes,
                                                        self.layout.device)
        sizes = [spec.block_nbytes for spec in self.layout.layers.values()]
        self._send_rows = SlabRows(self.send_slab.tensor, sizes)
        self._recv_rows = SlabRows(self.recv_slab.tensor, sizes)
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            outer = await stack.enter_async_context(anyio.create_task_group())
            # Background work runs in a task group hosted by a task of its own, so that
            # stopping it (aclose) never cancels the caller's code inside `async with`.
            self._tg = await outer.start(self._host_background)
            send, recv = anyio.create_memory_object_stream[tuple[int, Any]](max_buffer_size=1 << 16)
            self._inbox = send
            stack.push_async_callback(self._shutdown_tasks)
            self._tg.start_soon(self._serve_loop, recv, name=f"xavier-serve-{self.rank}")
            await self.transport.start(self, self.send_slab, self.recv_slab, self._tg)
        except BaseException:
            with anyio.CancelScope(shield=True):
                try:  # release whatever the transport registered before it failed
                    await self.transport.aclose()
                except Exception:
                    log.debug("transport close after a failed start failed", exc_info=True)
                await stack.aclose()
            raise
        self._stack = stack
        self._state = "open"
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        try:
            await self.aclose()
        finally:
            assert self._stack is not None
            # The body's exception is not fed to our task group: it would come out wrapped
            # in an ExceptionGroup. aclose() has already stopped the background tasks.
            await self._stack.__aexit__(None, None, None)
        return None

    @staticmethod
    async def _host_background(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            task_status.started(tg)
            await anyio.sleep_forever()

    async def _shutdown_tasks(self) -> None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    async def aclose(self) -> None:
        """Drain in-flight work, reject new work, release the transport. Idempotent; a
        cancelled close still finishes its cleanup before the cancellation propagates."""
        if self._state == "new":
            self._state = "closed"
            self._closed.set()
            return
        if self._state in ("closing", "closed"):
            with anyio.CancelScope(shield=True):
                held = await _wait_held(self._closed)
            if held is not None:
                raise held
            return
        self._state = "closing"
        held = None
        with anyio.CancelScope(shield=True):
            try:
                if self._inflight:
                    self._idle = anyio.Event()
                    held = await _wait_held(self._idle)
                for w in list(self._pending.values()):
                    w.fail(EndpointClosedError("endpoint closed"))
                await self.transport.aclose()
                self.metrics.memory_registrations = self.transport.memory_registrations
                if self._inbox is not None:
                    self._inbox.close()
            finally:
                self._state = "closed"
                self._closed.set()
                if self._tg is not None:
                    self._tg.cancel_scope.cancel()
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

    def _enter_work(self) -> None:
        self._check_open()
        self._inflight += 1

    def _leave_work(self) -> None:
        self._inflight -= 1
        if self._inflight == 0 and self._idle is not None:
            self._idle.set()

    # -- peers --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """Give this to a peer's :meth:`connect`."""
        return self.transport.address

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._channels))

    async def connect(self, address: str) -> int:
        """Handshake with the endpoint at ``address`` (both ends learn each other). Returns
        the peer's rank. Raises :class:`HandshakeError` or :class:`LayoutMismatchError`."""
        self._check_open()
        if not isinstance(address, str) or not address:
            raise HandshakeError(f"peer address must be a non-empty string, got {address!r}")
        rank, _ = await self.transport.connect(address)
        return rank

    def channel(self, peer: int) -> PeerChannel:
        """The channel this endpoint uses to write to ``peer``."""
        ch = self._channels.get(peer)
        if ch is None:
            raise UnknownPeerError(f"rank {peer} is not connected to rank {self.rank}")
        return ch

    def tune_channel(self, peer: int, *, streak: int | None = None,
                     trimmed: bool | None = None) -> PeerChannel:
        """Change one peer's streak length and/or trimmed mode (the machine restarts in
        ``full``; mappings are kept). Other peers keep the endpoint's config."""
        ch = self.channel(peer)
        if streak is not None:
            p = ch.policy
            ch.policy = ChannelPolicy(p.full_bytes, p.small_bytes, streak)
        if trimmed is not None:
            if not isinstance(trimmed, bool):
                raise InvalidRequestError(f"trimmed must be a bool, got {trimmed!r}")
            ch.trimmed = trimmed
        ch.policy.reset()
        return ch

    def policy(self, peer: int) -> ChannelPolicy:
        """The state machine of the channel to ``peer``."""
        return self.channel(peer).policy

    # TransportHost ----------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        cfg = self.config
        return {"version": PROTOCOL_VERSION, "rank": self.rank, "layout": self.layout.wire(),
                "full_bytes": cfg.full_bytes, "small_bytes": cfg.small_bytes,
                "accept_raw_copies": cfg.accept_raw_copies, "device": self.layout.device.type}

    def check_hello(self, hello: dict[str, Any]) -> None:
        try:
            self._check_hello(hello)
        except XavierError:
            raise
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise HandshakeError(f"malformed handshake from peer: {exc!r}") from None

    def _check_hello(self, hello: dict[str, Any]) -> None:
        if hello.get("version") != PROTOCOL_VERSION:
            raise HandshakeError(
                f"protocol version mismatch: local {PROTOCOL_VERSION}, peer {hello.get('version')!r}")
        rank = hello.get("rank")
        if type(rank) is not int or rank < 0:
            raise HandshakeError(f"peer rank must be an int >= 0, got {rank!r}")
        if rank == self.rank:
            raise HandshakeError(f"peer has the same rank as this endpoint ({rank})")
        for key in ("full_bytes", "small_bytes"):
            if hello.get(key) != getattr(self.config, key):
                raise HandshakeError(
                    f"slab size mismatch ({key}): local {getattr(self.config, key)}, "
                    f"peer {hello.get(key)} (views must match on both ends)")
        self.layout.check_compatible(hello.get("layout", []), f"rank {rank}")

    def peer_joined(self, peer: int, hello: dict[str, Any]) -> None:
        cfg = self.config
        assert self.send_slab is not None and cfg.small_bytes is not None
        m = self.metrics.peer(peer)
        old = self._channels.get(peer)
        if old is not None:  # a restarted peer: start from a clean channel
            old.policy.reset()
        self._channels[peer] = PeerChannel(
            peer, self.transport, self.send_slab,
            ChannelPolicy(cfg.full_bytes, cfg.small_bytes, cfg.streak), cfg.retry, m,
            trimmed=cfg.trimmed, trim_align=cfg.trim_align)
        self._peer_hello[peer] = hello

    def deliver(self, peer: int, msg: bytes, inline: bool = False) -> None:
        try:
            tag, body = codec.decode(msg)
        except ValueError:
            log.warning("rank %d: dropped malformed message from rank %d", self.rank, peer)
            return None
        if tag == codec.LOAD:
            if inline and self._serve_now(peer, body):  # no task switch, nothing awaited
                return None
            if self._inbox is not None:
                try:
                    self._inbox.send_nowait((peer, body))
                    return None
                except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
            log.warning("rank %d: cannot serve rank %d now (closing)", self.rank, peer)
            return None
        try:
            w = self._pending.get(body[0]) if isinstance(body, list) and body else None
            if w is None or w.peer != peer:
                log.debug("rank %d: stray %r from rank %d", self.rank, tag, peer)
                return None
            if tag == codec.LANDED:
                w.wire_bytes = int(body[1])
                w.event.set()
            elif tag == codec.ERROR:
                kind, text = body[1], body[2]
                cls = {"transfer": TransferError, "lost": PeerLostError,
                       "registration": RegistrationError}.get(kind, RemoteError)
                w.fail(cls(f"rank {peer}: {text}"))
        except Exception:  # whatever a peer sends, the poller must survive it
            log.warning("rank %d: dropped malformed %r from rank %d", self.rank, tag, peer)
        return None

    def peer_lost(self, peer: int, exc: BaseException) -> None:
        for w in list(self._pending.values()):
            if w.peer == peer:
                w.fail(exc if isinstance(exc, XavierError) else PeerLostError(str(exc)))
        ch = self._channels.pop(peer, None)
        self._peer_hello.pop(peer, None)
        if ch is not None:
            ch.reset_now()
        if self._tg is not None and self._state == "open":
            self._tg.start_soon(self._forget, peer)

    async def _forget(self, peer: int) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.transport.disconnect(peer)
            except Exception:
                log.debug("rank %d: disconnect of rank %d failed", self.rank, peer, exc_info=True)

    # -- publishing ---------------------------------------------------------------------
    def publish(self, key: BlockKey, slot: int, *, layers: Iterable[LayerId] | None = None) -> None:
        """Make ``key`` loadable by peers: it lives at ``slot`` of each layer's cache
        (all layers by default)."""
        check_key(key)
        targets = list(self.caches) if layers is None else list(layers)
        for layer in targets:
            check_layer_id(layer)
            if layer not in self.caches:
                raise InvalidRequestError(f"unknown layer {layer!r}")
            check_slot(slot, self.layout.layers[layer], layer)
        for layer in targets:
            self._published[layer][key] = slot

    def unpublish(self, key: BlockKey, *, layers: Iterable[LayerId] | None = None) -> None:
        """Stop serving ``key`` (unknown keys are ignored)."""
        for layer in (self.caches if layers is None else layers):
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
        self._check_open()
        plans = normalize(requests, self.layout)
        batches: list[tuple[int, Batch]] = []
        for src, plan in plans.items():
            if src == self.rank:
                raise InvalidRequestError(f"rank {src} cannot load from itself")
            if src not in self._channels:
                raise UnknownPeerError(f"rank {src} is not connected to rank {self.rank}")
            batches.extend((src, b) for b in plan_batches(plan, self.layout, self.config.full_bytes))
        self._enter_work()
        self.metrics.loads += 1
        useful = wire = blocks = 0
        try:
            for src, batch in batches:
                wire += await self._load_batch(src, batch)
                useful += batch.useful_bytes
                blocks += sum(len(s.keys) for s in batch.segments)
        finally:
            self._leave_work()
        return LoadResult(len(batches), blocks, useful, wire)

    async def _load_batch(self, src: int, batch: Batch) -> int:
        m = self.metrics.peer(src)
        async with self._recv_lock:
            self._recv_slab_free()
            req_id = next(self._ids)
            waiter = self._pending[req_id] = _Waiter(src)
            held: BaseException | None = None  # a native cancellation, re-raised afterwards
            try:
                with anyio.CancelScope(shield=True):
                    # from the first byte of the request on, the copy is "started": it is
                    # waited for until the source reports a terminal state
                    try:
                        await self.transport.send(src, codec.encode(codec.LOAD, [req_id, batch.wire()]))
                    except XavierError as exc:
                        waiter.fail(exc)
                    except anyio.get_cancelled_exc_class() as exc:  # native, through the shield
                        held = exc
                    held = await _wait_held(waiter.event, self.config.request_timeout) or held
                    if not waiter.event.is_set():
                        m.load_errors += 1
                        lost = PeerLostError(
                            f"rank {src} did not complete a copy within {self.config.request_timeout} s")
                        self.peer_lost(src, lost)
                        # cut the source off before the receive slab is reused: its copy
                        # may still be under way
                        await self._forget(src)
                        raise held or lost
            finally:
                del self._pending[req_id]
            if held is not None:
                raise held
            if waiter.error is not None:
                m.load_errors += 1
                raise waiter.error
            # a cancellation that arrived during the copy surfaces here, before unpacking
            await anyio.lowlevel.checkpoint()
            self._unpack(batch)
            m.batches_received += 1
            m.bytes_received += waiter.wire_bytes
            return waiter.wire_bytes

    def _unpack(self, batch: Batch) -> None:
        # stream-ordered: only enqueued on the caches' current stream; the receive slab is
        # then reused only after that unpack has run (_recv_slab_free)
        self._unpacked = scatter(self._recv_rows, batch.segments, self._rows,
                                 wait=not self.config.stream_ordered_unpack)

    def _recv_slab_free(self) -> None:
        """Wait for the last unpack to have read the receive slab (CUDA only)."""
        if self._unpacked is not None:
            self._unpacked.synchronize()
            self._unpacked = None

    # -- serving (source side) ------------------------------------------------------------
    async def _serve_loop(self, inbox: MemoryObjectReceiveStream[tuple[int, Any]]) -> None:
        async with inbox:
            async for peer, body in inbox:
                await self._serve(peer, body)

    def _parse_load(self, body: Any) -> tuple[int, list[Segment], int]:
        """(request id, segments, payload) of a LOAD body; InvalidRequestError if malformed."""
        try:
            req_id, wire = body
            segments, payload = segments_from_wire(wire, self.layout)
        except (TypeError, ValueError) as exc:  # a malformed request from the peer
            raise InvalidRequestError(f"malformed load request: {exc}") from None
        if type(req_id) is not int:
            raise InvalidRequestError(f"malformed load request id {req_id!r}")
        if payload > self.config.full_bytes:
            raise InvalidRequestError(f"batch of {payload} B exceeds the full slab")
        return req_id, segments, payload

    def _slots_of(self, segments: list[Segment]) -> list[list[int]]:
        """Source slots of every segment's keys, looked up now (just before packing, with
        nothing awaited in between, so an unpublished key is never served)."""
        slot_lists = []
        for seg in segments:
            table = self._published[seg.layer]
            try:
                slot_lists.append([table[k] for k in seg.keys])
            except (KeyError, TypeError):  # unknown or unhashable keys
                missing = [k for k in seg.keys if not isinstance(k, (int, str, bytes)) or k not in table]
                raise InvalidRequestError(
                    f"block key(s) {missing[:4]!r} not published in layer {seg.layer!r}") from None
        return slot_lists

    def _serve_now(self, peer: int, body: Any) -> bool:
        """Serve a LOAD without awaiting anything, when that is possible: no request queued
        or being served, the view the machine picks already mapped, the send slab free.
        The copy is posted here; if it has not finished while posting, a task of the
        endpoint waits for it. Returns False to leave the request to the queue (which
        also produces any error reply)."""
        if (self._state != "open" or self._serving or self._inbox is None
                or self._inbox.statistics().current_buffer_used):
            return False
        ch = self._channels.get(peer)
        if ch is None:
            return False
        try:
            req_id, segments, payload = self._parse_load(body)
            slot_lists = self._slots_of(segments)
        except InvalidRequestError:
            return False
        try:
            self._send_free.acquire_nowait()
        except anyio.WouldBlock:
            return False
        plan = ch.plan_now(payload, sum(seg.nbytes for seg in segments))
        if plan is None:  # a view to map first: that awaits, so the queue does it
            self._send_free.release()
            return False
        assert self._tg is not None
        self._inflight += 1
        try:
            self._pack(segments, slot_lists)
            pending = ch.post(plan, codec.encode(codec.LANDED, [req_id, plan.wire_bytes]))
        except Exception as exc:  # reply with the error; never raise into the poller
            self._send_free.release()
            self._leave_work()
            err = exc if isinstance(exc, XavierError) else TransferError(f"serving failed: {exc!r}")
            self._tg.start_soon(self._after_failure, ch, peer, req_id, err)
            return True
        if pending is None:
            self._send_free.release()
            self._leave_work()
        else:
            self._tg.start_soon(self._finish_serve, ch, peer, req_id, plan, pending)
        return True

    async def _finish_serve(self, ch: PeerChannel, peer: int, req_id: int, plan: CopyPlan,
                            pending: object) -> None:
        try:
            await ch.finish(plan, pending)
        except XavierError as exc:
            await self._reply_error(peer, req_id, exc)
        finally:
            self._send_free.release()
            self._leave_work()

    async def _after_failure(self, ch: PeerChannel, peer: int, req_id: int, exc: XavierError) -> None:
        await ch.forget()
        await self._reply_error(peer, req_id, exc)

    async def _reply_error(self, peer: int, req_id: int, exc: XavierError) -> None:
        kind = ("lost" if isinstance(exc, PeerLostError) else
                "transfer" if isinstance(exc, TransferError) else
                "registration" if isinstance(exc, RegistrationError) else "refused")
        try:
            await self.transport.send(peer, codec.encode(codec.ERROR, [req_id, kind, str(exc)]))
        except XavierError:
            pass  # the peer is gone; it will notice on its own

    async def _serve(self, peer: int, body: Any) -> None:
        try:
            req_id = body[0]
        except (TypeError, IndexError, KeyError):
            log.warning("rank %d: malformed LOAD from rank %d", self.rank, peer)
            return
        self._inflight += 1
        self._serving = True
        try:
            try:
                if self._state != "open":
                    raise EndpointClosedError(f"rank {self.rank} is closing")
                ch = self.channel(peer)
                req_id, segments, payload = self._parse_load(body)
                self._slots_of(segments)  # refuse unknown keys before anything else
                async with self._send_free:
                    plan = await ch.prepare(payload, sum(seg.nbytes for seg in segments))
                    if self._channels.get(peer) is not ch:  # the peer left (or restarted)
                        raise PeerLostError(f"rank {peer} went away before its copy")
                    self._pack(segments, self._slots_of(segments))
                    await ch.write(plan, codec.encode(codec.LANDED, [req_id, plan.wire_bytes]))
            except XavierError as exc:
                await self._reply_error(peer, req_id, exc)
        finally:
            self._serving = False
            self._leave_work()

    def _pack(self, segments: list[Any], slot_lists: list[list[int]]) -> None:
        assert self.send_slab is not None
        gather(self._send_rows, segments, slot_lists, self._rows)

    # -- diagnostics --------------------------------------------------------------------
    async def copy_raw(self, peer: int, nbytes: int) -> int:
        """Write the first ``nbytes`` of the send slab into ``peer``'s receive slab through
        the view the channel's machine chooses; return that view's size. For benchmarks
        only: the peer must have ``accept_raw_copies=True`` and must not be loading
        anything meanwhile (the write does not take the peer's receive lock)."""
        check_size("nbytes", nbytes)
        ch = self.channel(peer)
        if not self._peer_hello.get(peer, {}).get("accept_raw_copies"):
            raise InvalidRequestError(f"rank {peer} does not accept raw copies")
        if nbytes > self.config.full_bytes:
            raise InvalidRequestError(f"{nbytes} B exceeds the full slab ({self.config.full_bytes} B)")
        self._enter_work()
        try:
            async with self._send_free:
                plan = await ch.prepare(nbytes)
                await ch.write(plan, None)
            # a cancellation that arrived during the (shielded) copy surfaces now
            await anyio.lowlevel.checkpoint_if_cancelled()
            return plan.view_bytes
        finally:
            self._leave_work()

    def snapshot_metrics(self) -> dict[str, Any]:
        """Metrics as a plain dict (registrations include the transport's memory ones)."""
        self.metrics.memory_registrations = self.transport.memory_registrations
        return self.metrics.as_dict()

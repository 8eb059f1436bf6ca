"""NIXL transport: one NIXL agent per endpoint, each slab registered once.

* Memory (:mod:`.nixl_memory`): the slabs and snapshot tiers are registered once; a peer
  learns of a receive slab added later through a transport notification.
* Copies (:mod:`.nixl_copies`): a view *mapping* is a pre-built NIXL transfer handle (a
  view of one send slab -> the peer's receive view of one receive slab, equal lengths)
  re-posted for every copy. A handle cannot be re-posted while in flight; the engine
  never has two copies in flight through one (each holds its send and its receive slab
  until terminal).
* Discovery: each endpoint listens on ``host:port`` (TCP). :meth:`connect` exchanges a
  small handshake there (protocol version, rank, layout, slab sizes, NIXL agent metadata,
  receive-slab addresses) and both ends add each other's agent. The TCP stream then stays
  open as a liveness signal: when a peer process dies its stream closes and everything
  waiting on it fails at once with :class:`PeerLostError`. The TCP side lives next to
  this module: ``peering`` (listen, dial, accept, the connect race), ``handshake`` (the
  frames), ``admission`` (the secret and the pre-authentication slots), ``liveness``
  (watching each peer's stream), ``addresses``; ``nixl_agent`` is NIXL's API as used here.
* Hot path: control messages are NIXL notifications (``send_notif``) and a WRITE carries
  its "landed" notification, both polled by one task of ours (NIXL's progress thread is
  off: with it on, a notification round trip took 16 ms here instead of 15 us). Polling
  yields to the event loop between checks, and backs off to short sleeps when idle.
* Bulk (:mod:`.nixl_bulk`): where the host has cores to spare, a large host WRITE goes
  through a second agent of ours on a thread of its own, so that the event loop does not
  copy it inside ``transfer``; peers learn that agent's name in our hello.

Two agents on two GPUs in one process are pathologically slow in NIXL: run one endpoint
per process per GPU.
"""

from __future__ import annotations

import base64
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio

from .._checks import check_int, check_number, check_size
from ..errors import (EndpointClosedError, HandshakeError, InternalError, InvalidRequestError,
                      PeerLostError, UnknownPeerError)
from .addresses import check_host, parse_address
from .admission import INSECURE_ENV, SECRET_ENV, Admission, resolve_secret
from .base import Regions, TaskSpawner, Transport
from .handshake import FrameStream
from .liveness import Liveness
from .nixl_agent import (AgentFactory, NixlAgent, nixl_agent_factory, nixl_bulk_agent_factory,
                         nixl_version)
from .nixl_bulk import BulkLane, _cpus, default_bulk_bytes
from .nixl_copies import PIECE_BYTES, Copies
from .nixl_memory import XT, Memory
from .nixl_peer import _Peer, parse_peer_frame
from .peering import Peering

if TYPE_CHECKING:
    import torch

    from ..slabs import Slab, SlabView
    from .base import TransportHost

# parse_address and the environment variables' names are importable from here, as before
__all__ = ["INSECURE_ENV", "SECRET_ENV", "AgentFactory", "NixlAgent", "NixlTransport",
           "nixl_agent_factory", "parse_address"]

log = logging.getLogger("xavier_async.nixl")


class NixlTransport(Transport):
    """Real transfers over NIXL (UCX underneath: shared memory / CUDA IPC / NVLink in a
    host, TCP or RDMA across hosts).

    ``host``/``port``: where this endpoint listens for peers (port 0 picks a free one;
    read :attr:`address`). ``advertise``: the host name peers should dial, if it differs
    from ``host`` (for example when listening on ``0.0.0.0``). ``idle_poll``: the longest
    sleep between notification polls when nothing has happened for ``hot_window`` seconds.
    ``trim_handles``: how many exact-length handles to keep per view for trimmed copies.
    ``spin``: seconds :meth:`post` busy-polls a copy before handing it to the event loop.
    ``piece_bytes``: a host-to-host copy larger than this is posted in pieces of this
    size, one per pass through the event loop, so that small copies go out between them
    (UCX copies a host WRITE inside the post: a whole 12 MiB one held the loop ~2.5 ms);
    0 (the default) posts every copy whole. ``bulk_bytes``: a host-to-host WRITE of at
    least this many bytes goes through a second NIXL agent of ours, posted and polled on a
    thread of its own (:mod:`.nixl_bulk`), so that the event loop serves small loads
    meanwhile; 0: never; ``None`` (the default): 1 MiB where this process may run on 8 CPUs
    or more, else 0 (on 2 cores the third busy thread made the small loads' tail worse).
    ``agent_factory``: builds the NIXL agent (tests pass a fake one).

    Peer authentication (docs/threat-model.md): ``secret`` (or ``XAVIER_ASYNC_SECRET``),
    required to listen beyond loopback unless ``insecure`` (or ``XAVIER_ASYNC_INSECURE``,
    parsed strictly: ``1/true/yes/on`` or ``0/false/no/off``/empty).

    Limits before a peer is authenticated, so that silent or slow strangers cannot lock
    real peers out (:mod:`.admission`): a connection must send its first handshake frame
    within ``first_frame_timeout`` seconds and each later one, up to its hello, within
    ``preauth_step_timeout`` (its slot is freed at once when a step is late). At most
    ``max_unauthenticated`` such handshakes are pending at once, and at most
    ``max_unauthenticated_per_host`` from one remote address; a connection beyond either
    cap is told "busy" and closed at once, and a connecting xavier_async endpoint retries
    it until its own timeout. ``handshake_timeout`` bounds a whole handshake and is the
    default timeout of :meth:`connect`. ``rank_grace``: how long a rank lost without a
    clean close stays reserved for its agent. ``stall_check``: after a stall this long
    (SIGSTOP, swap), the poll loop re-checks every peer's connection before serving
    (:mod:`.liveness`).

    Every setting is validated here (:class:`InvalidRequestError` naming it): numbers are
    finite, timeouts > 0, hosts non-empty strings.

    The transport is parts around its NIXL agent: :class:`.peering.Peering` (listening,
    dialling, the connect race), :class:`.admission.Admission` (the pre-authentication
    slots), :class:`.liveness.Liveness` (watching each peer's stream),
    :class:`.nixl_memory.Memory` (registrations, telling peers about new receive slabs)
    and :class:`.nixl_copies.Copies` (transfer handles, post/wait); this class keeps the
    agent, the peer table, the notification poller, and wires the parts.
    """

    name = "nixl"
    direct_writes = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 backends: tuple[str, ...] = ("UCX",), idle_poll: float = 0.0005,
                 hot_window: float = 0.05, write_timeout: float = 30.0,
                 handshake_timeout: float = 10.0, trim_handles: int = 64,
                 spin: float = 0.0001, piece_bytes: int = PIECE_BYTES,
                 bulk_bytes: int | None = None,
                 agent_factory: AgentFactory | None = None,
                 secret: str | bytes | None = None, insecure: bool | None = None,
                 first_frame_timeout: float = 2.0, max_unauthenticated: int = 64,
                 rank_grace: float = 30.0, stall_check: float = 0.25,
                 preauth_step_timeout: float = 1.0, max_unauthenticated_per_host: int = 8) -> None:
        super().__init__()
        # every setting is checked before anything else happens (InvalidRequestError)
        host = check_host("host", host)
        if advertise is not None:
            advertise = check_host("advertise", advertise)
        port = check_int("port", port, minimum=0, maximum=65535)
        if isinstance(backends, str) or not isinstance(backends, (tuple, list)) or not backends \
                or not all(isinstance(b, str) and b for b in backends):
            raise InvalidRequestError(f"backends must be a non-empty tuple of NIXL backend names "
                                      f"such as ('UCX',), got {backends!r}")
        admission = Admission(first_frame_timeout=first_frame_timeout,
                              step_timeout=preauth_step_timeout, max_total=max_unauthenticated,
                              max_per_host=max_unauthenticated_per_host)
        # timeouts must be > 0 (0 would fail every handshake or copy); the others may be 0
        handshake_timeout = check_number("handshake_timeout", handshake_timeout, strictly_positive=True)
        write_timeout = check_number("write_timeout", write_timeout, strictly_positive=True)
        self.idle_poll = check_number("idle_poll", idle_poll)
        self.hot_window = check_number("hot_window", hot_window)
        spin = check_number("spin", spin)
        trim_handles = check_int("trim_handles", trim_handles, minimum=1)
        piece_bytes = check_size("piece_bytes", piece_bytes, minimum=0)
        if bulk_bytes is None:
            bulk_bytes = default_bulk_bytes()
        bulk_bytes = check_size("bulk_bytes", bulk_bytes, minimum=0)
        #: connected peers by rank, and by agent name
        self._peers: dict[int, _Peer] = {}
        self._by_agent: dict[str, int] = {}
        self._liveness = Liveness(self._peers, self._peer_lost, lambda: self._closed,
                                  rank_grace=rank_grace, stall_check=stall_check)
        secret, self.insecure = resolve_secret(secret, insecure, host)
        self._peering = Peering(self._peers, my_hello=self._my_hello, add=self._add_peer,
                                drop=self._drop, admission=admission,
                                liveness=self._liveness, secret=secret,
                                handshake_timeout=handshake_timeout, listen_host=host, port=port,
                                advertise=advertise)
        self._admission = admission
        self._backends = list(backends)
        self.agent: NixlAgent | None = None
        self._agent_factory: AgentFactory = agent_factory or nixl_agent_factory
        self._bulk_factory: AgentFactory = agent_factory or nixl_bulk_agent_factory
        #: large host WRITEs through a second agent on a thread of its own
        self._bulk = BulkLane(bulk_bytes)
        self.agent_name = ""
        self._host: TransportHost | None = None
        self._tg: TaskSpawner | None = None
        self._recv_slab: Slab | None = None
        self._mem = "DRAM"
        self._dev = 0
        #: what the agent has registered, and telling peers about new receive slabs
        self._memory = Memory(self._peers, self._by_agent, self._backends, self._counted)
        #: the copy path: handle caches, post/wait, handles that outlive their copies
        self._copies = Copies(self._memory.pools, write_timeout=write_timeout, spin=spin,
                              trim_handles=trim_handles, piece_bytes=piece_bytes, bulk=self._bulk)
        # the parts' tables under their former names (the same objects; tests read them)
        self._reg, self._recv_slabs = self._memory.regs, self._memory.recv_slabs
        self._in_flight, self._stuck = self._copies.in_flight, self._copies.stuck
        self._release_later = self._copies.release_later
        #: agents of peers we dropped, for late notifications (bounded)
        self._former: OrderedDict[str, int] = OrderedDict()
        self._closed = False
        #: when notifications were last polled (a long gap is a stall), and what polling
        #: yields the CPU with between empty passes (None: not at all)
        self._last_pass = time.monotonic()
        self._sched_yield: Callable[[], None] | None = None

    # -- settings and counters of the parts ----------------------------------------------
    @property
    def write_timeout(self) -> float:
        """Seconds a posted copy may take before it is given up on (stuck)."""
        return self._copies.write_timeout

    @property
    def spin(self) -> float:
        """Seconds :meth:`post` busy-polls a copy before handing it to the event loop."""
        return self._copies.spin

    @property
    def piece_bytes(self) -> int:
        """Host copies larger than this are posted in pieces (0: never)."""
        return self._copies.piece_bytes

    @property
    def pieces(self) -> tuple[int, int]:
        """(copies posted in pieces, pieces posted) so far."""
        return self._copies.pieced, self._copies.pieces_posted

    @property
    def bulk_bytes(self) -> int:
        """Host WRITEs of at least this many bytes go through the bulk agent (0: none)."""
        return self._bulk.min_bytes

    @property
    def bulk_posts(self) -> int:
        """WRITEs posted through the bulk agent so far."""
        return self._bulk.posts

    @property
    def trim_handles(self) -> int:
        """Exact-length handles kept per view (and direct-write handles per peer)."""
        return self._copies.trim_handles

    @property
    def handshake_timeout(self) -> float:
        """Seconds for a whole handshake (the default timeout of :meth:`connect`)."""
        return self._peering.handshake_timeout

    @property
    def first_frame_timeout(self) -> float:
        """Seconds a new connection has for its first handshake frame."""
        return self._admission.first_frame_timeout

    @property
    def preauth_step_timeout(self) -> float:
        """Seconds a connection has for each later handshake frame, up to its hello."""
        return self._admission.step_timeout

    @property
    def max_unauthenticated(self) -> int:
        """At most this many handshakes are pending before their peer's hello passed."""
        return self._admission.max_total

    @property
    def max_unauthenticated_per_host(self) -> int:
        """At most this many of them from one remote address."""
        return self._admission.max_per_host

    @property
    def refused_connections(self) -> int:
        """Connections turned away at once ("busy" refusal) because ``max_unauthenticated``
        handshakes, or ``max_unauthenticated_per_host`` from that host, were pending."""
        return self._admission.refused

    @property
    def rank_grace(self) -> float:
        """Seconds a rank lost without a clean close stays reserved for its agent."""
        return self._liveness.rank_grace

    @property
    def stall_check(self) -> float:
        """A poll pass this many seconds after the previous one re-checks every peer's
        connection before serving (0: off)."""
        return self._liveness.stall_check

    @property
    def stalls_seen(self) -> int:
        """Stalls noticed by the poll loop (each followed by a liveness check)."""
        return self._liveness.stalls_seen

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self, host: TransportHost, send: Slab, recv: Slab, tg: TaskSpawner) -> None:
        self._host, self._tg = host, tg
        self._recv_slab = recv
        dev = send.device
        if dev.type == "cuda":
            self._mem, self._dev = "VRAM", dev.index if dev.index is not None else 0
        elif dev.type == "cpu":
            self._mem, self._dev = "DRAM", 0
        else:
            raise InvalidRequestError(f"NIXL transport supports cpu and cuda caches, not {dev}")
        self.agent_name = f"xa-{host.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = self._agent_factory(self.agent_name, list(self._backends))
        bulk = None
        if self._bulk.min_bytes and self._mem == "DRAM":
            name = self.agent_name + "-bulk"
            bulk = self._bulk_factory(name, list(self._backends))
            self._bulk.bind(bulk, name)
        self._copies.bind(self.agent, self._mem, self._dev)
        self._memory.start(self.agent, self._mem, self._dev, send, recv, bulk)
        await self._peering.start(host, self._tasks, self.agent_name)
        self._tasks.start_soon(self._poll_loop)

    def _peer_lost(self, rank: int, exc: PeerLostError) -> None:
        self._started_host.peer_lost(rank, exc)

    def _counted(self) -> None:
        self.memory_registrations += 1

    # -- memory (nixl_memory.Memory) -----------------------------------------------------
    async def add_send_slab(self, slab: Slab) -> None:
        await self._memory.add_send_slab(slab)

    async def add_recv_slab(self, slab: Slab) -> None:
        await self._memory.add_recv_slab(slab)

    async def add_pool(self, memory: torch.Tensor) -> None:
        """Register a snapshot tier: VRAM on the caches' GPU, or DRAM (pinned on CUDA)."""
        await self._memory.add_pool(memory)

    async def share_recv_slab(self, peer: int, slab: Slab) -> None:
        """Tell ``peer`` about our receive slab ``slab`` and wait for its acknowledgement
        (within ``handshake_timeout``)."""
        await self._memory.share(self._peer(peer), slab, self.handshake_timeout)

    def peer_recv_slabs(self, peer: int) -> tuple[int, ...]:
        return tuple(sorted(self._peer(peer).recv_ptrs))

    def unsettled(self) -> set[int]:
        return self._copies.unsettled()

    @property
    def address(self) -> str:
        address = self._peering.address()
        if address is None:
            raise EndpointClosedError("the NIXL transport is not started (it starts with its "
                                      "endpoint: `async with Endpoint(...)`)")
        return address

    async def connect(self, address: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """Handshake with the endpoint at ``address`` within ``timeout`` (default
        ``handshake_timeout``). A peer that turns the connection away as busy (too many
        handshakes pending there) is tried again with short, growing, jittered pauses
        until the timeout; every failure is a :class:`HandshakeError` whose ``reason`` says
        why (or a :class:`LayoutMismatchError`). See :mod:`.peering`."""
        return await self._peering.connect(address, timeout)

    def describe(self) -> dict[str, Any]:
        return {"transport": self.name, "nixl": nixl_version(), "memory": self._mem,
                "backends": self._backends}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._peering.stop_listening()
            for rank in list(self._peers):
                await self.disconnect(rank)
            if self.agent is not None:
                self._bulk.close()  # every peer is lost by now: its job has ended or ends
                self._copies.close()
                self._memory.deregister_all()

    @property
    def _started_host(self) -> TransportHost:
        """The endpoint this transport serves (from :meth:`start` on)."""
        if self._host is None:
            raise InternalError("the NIXL transport is used before start()")
        return self._host

    @property
    def _tasks(self) -> TaskSpawner:
        """Where background tasks start (the endpoint's, from :meth:`start` on)."""
        if self._tg is None:
            raise InternalError("the NIXL transport is used before start()")
        return self._tg

    @property
    def _agent(self) -> NixlAgent:
        if self.agent is None:
            raise InternalError("the NIXL transport is used before start()")
        return self.agent

    def _my_hello(self) -> dict[str, Any]:
        if self._recv_slab is None:
            raise InternalError("the NIXL transport has no receive slab before start()")
        return {"hello": self._started_host.hello(), "agent": self.agent_name,
                "meta": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "recv_ptr": self._recv_slab.tensor.data_ptr(), "recv_dev": self._dev,
                "recv_slabs": {str(i): s.tensor.data_ptr() for i, s in self._recv_slabs.items()},
                "mem": self._mem, **({"bulk_agent": self._bulk.name} if self._bulk.name else {})}

    def _add_peer(self, frame: dict[str, Any], fs: FrameStream, told: set[int] | None = None) -> _Peer:
        hello, rank, meta, recv_ptrs, recv_dev, mem, bulk_agent = parse_peer_frame(frame)
        old = self._peers.get(rank)
        if old is not None and not old.lost:
            raise HandshakeError(f"rank {rank} is already connected")
        if old is not None:
            self._drop(rank)
        name = self._memory.add_remote(meta)
        peer = _Peer(rank, name, recv_ptrs, recv_dev, mem, fs, hello,
                     set(told) if told is not None else {0})
        peer.bulk_agent = bulk_agent if bulk_agent != name else None
        self._peers[rank] = peer
        for agent in peer.agents():
            self._former.pop(agent, None)
            self._by_agent[agent] = rank
        return peer

    # -- peers --------------------------------------------------------------------------
    def _peer(self, rank: int) -> _Peer:
        p = self._peers.get(rank)
        if p is None:
            raise UnknownPeerError(f"rank {rank} is not connected")
        if p.lost:
            raise PeerLostError(f"rank {rank} is gone")
        return p

    def _drop(self, rank: int) -> None:
        peer = self._peers.pop(rank, None)
        if peer is None:
            return
        peer.lost = True
        self._copies.release_peer(peer)
        for agent in peer.agents():
            self._by_agent.pop(agent, None)
            self._former[agent] = rank  # its late notifications still mean something
        while len(self._former) > 256:
            self._former.popitem(last=False)
        self._peering.notify()
        self._memory.remove_remote(peer.agent)

    async def forget(self, peer: int) -> None:
        p = self._peers.get(peer)
        if p is not None:
            self._copies.release_peer(p)

    async def disconnect(self, peer: int) -> None:
        p = self._peers.get(peer)
        if p is None:
            return
        self._drop(peer)
        with anyio.CancelScope(shield=True):
            await p.fs.aclose()

    # -- data path (the copies: nixl_copies.Copies) -------------------------------------
    async def map_view(self, peer: int, view: SlabView, slab: int = 0) -> object:
        p = self._peer(peer)
        send = view.slab.index
        if self._memory.send_slabs.get(send) is not view.slab:
            raise InvalidRequestError(f"{view} is not a view of this endpoint's send slabs")
        if slab not in p.recv_ptrs:
            raise InvalidRequestError(f"rank {peer} has not shared a receive slab {slab}")
        await anyio.lowlevel.checkpoint()
        return self._copies.mapping(p, send, view.data_ptr, view.nbytes, slab)

    def post(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        return self._copies.post(self._peer(peer), mapping, nbytes, notify)

    def post_regions(self, peer: int, regions: Regions, slab: int,
                     notify: bytes | None) -> object | None:
        """One WRITE of ``regions`` straight from a registered pool (a snapshot tier) into
        the peer's receive slab ``slab``. Its transfer handle is kept in a per-peer LRU
        (``trim_handles`` of them), so a block served again re-posts its handle."""
        return self._copies.post_regions(self._peer(peer), regions, slab, notify)

    def wait(self, pending: object) -> Coroutine[Any, Any, None]:
        """Poll a posted copy to a terminal state. A copy is never abandoned while NIXL
        may still be reading the send slab: if the peer is lost meanwhile, polling goes on
        (UCX fails the copy once the connection is gone) until ``write_timeout``. A copy
        that reached DONE landed, even if its peer was lost meanwhile (it counts as sent);
        one still posted at ``write_timeout`` stays *unsettled* (:meth:`unsettled`) until
        NIXL reports a terminal state for it. (Returns the copy path's coroutine itself:
        no frame of ours in between.)"""
        return self._copies.wait(pending)

    async def send(self, peer: int, msg: bytes) -> None:
        """Send a notification; it does not yield to the event loop (the caller awaits
        its reply next, which does: a second pass through the loop cost a load ~10 us)."""
        self.send_now(peer, msg)

    @property
    def polls_inline(self) -> bool:  # type: ignore[override]
        """True, unless a subclass sends its own way (a fault injector overriding
        :meth:`send`): its requests must keep going through it."""
        return type(self).send is NixlTransport.send

    def send_now(self, peer: int, msg: bytes) -> None:
        """:meth:`send`, as a plain call."""
        p = self._peer(peer)
        self._copies.last_activity = time.monotonic()
        try:
            self._agent.send_notif(p.agent, msg)
        except Exception as exc:
            raise PeerLostError(f"cannot notify rank {peer}: {exc}") from exc

    def poll_until(self, done: Callable[[], bool], seconds: float) -> bool:
        """One poll pass after another (:meth:`_poll_pass`, yielding the CPU between empty
        ones as the poller does) until ``done()`` or ``seconds`` have passed."""
        if done():
            return True
        until = time.perf_counter() + seconds
        poll, clock, sched_yield = self._poll_pass, time.perf_counter, self._sched_yield
        while True:
            if poll():
                if done():
                    return True
            elif clock() > until:
                return done()
            elif sched_yield is not None:
                sched_yield()

    def _poll_pass(self) -> bool:
        """Deliver whatever notifications arrived (whether any did). After a stall (a
        pass long after the previous one) the peers' connections are checked first."""
        liveness, copies = self._liveness, self._copies
        now = time.monotonic()
        if liveness.stall_check and now - self._last_pass > liveness.stall_check:
            liveness.sweep()  # we were stalled: drop peers that hung up before serving them
        self._last_pass = now
        if copies.stuck:
            copies.check_stuck()
        notifs = self._agent.get_new_notifs()
        if not notifs:
            return False
        copies.last_activity = time.monotonic()
        host, by_agent = self._started_host, self._by_agent
        for raw_name, msgs in notifs.items():
            name = raw_name if isinstance(raw_name, str) else raw_name.decode()
            rank = by_agent.get(name)
            for msg in msgs:
                try:
                    if msg[:3] == XT:
                        self._memory.on_message(name, msg)
                    elif rank is not None:
                        host.deliver(rank, msg, True)  # a load request may be served right here
                    elif name in self._former:  # a late reply from a dropped peer
                        host.deliver_late(self._former[name], msg)
                except Exception:  # never let one message stop the poller
                    log.exception("delivering a message from agent %s failed", name)
        return True

    @staticmethod
    def _yielder() -> Callable[[], None] | None:
        """``os.sched_yield`` where this process may run on more than one CPU. Pinned to
        one, a yield hands that CPU to CUDA's and UCX's own threads and costs a
        timeslice (~200 us measured): then polling goes through the event loop only."""
        sched_yield = getattr(os, "sched_yield", None)
        return sched_yield if sched_yield is not None and _cpus() > 1 else None

    async def _poll_loop(self) -> None:
        """Deliver NIXL notifications to the endpoint; spin while busy, nap while idle."""
        checkpoint, sleep, monotonic = anyio.lowlevel.checkpoint, anyio.sleep, time.monotonic
        poll, copies = self._poll_pass, self._copies
        self._last_pass = monotonic()
        self._sched_yield = self._yielder()
        while True:
            if poll():
                await checkpoint()
            elif monotonic() - copies.last_activity < self.hot_window:
                # nothing yet: give the core to any other runnable process (often our peer,
                # on a small machine) before polling again
                if self._sched_yield is not None:
                    self._sched_yield()
                await checkpoint()
            else:
                await sleep(self.idle_poll)
                self._sched_yield = self._yielder()  # affinity may have changed

"""NIXL transport: one NIXL agent per endpoint, each slab registered once.

* Memory: the send and receive slabs (the endpoint's pools) are registered once at start
  (DRAM, or VRAM on the caches' GPU). Views and peers never register memory again; a view
  *mapping* is a pre-built NIXL transfer handle (a view of one send slab -> the peer's
  receive view of one receive slab, equal lengths) that is re-posted for every copy. A
  handle cannot be re-posted while in flight; the engine never has two copies in flight
  through one (each holds its send and its receive slab until terminal).
* Discovery: each endpoint listens on ``host:port`` (TCP). :meth:`connect` exchanges a
  small handshake there (protocol version, rank, layout, slab sizes, NIXL agent metadata,
  receive-slab address) and both ends add each other's agent. The TCP stream then stays
  open as a liveness signal: when a peer process dies its stream closes and everything
  waiting on it fails at once with :class:`PeerLostError`.
* Hot path: control messages are NIXL notifications (``send_notif``) and a WRITE carries
  its "landed" notification, both polled by one task of ours (NIXL's progress thread is
  off: with it on, a notification round trip took 16 ms here instead of 15 us). Polling
  yields to the event loop between checks, and backs off to short sleeps when idle.

Two agents on two GPUs in one process are pathologically slow in NIXL: run one endpoint
per process per GPU.
"""

from __future__ import annotations

import base64
import errno
import ipaddress
import json
import logging
import os
import random
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import SocketStream

from .._checks import check_bool, check_int, check_number, env_flag
from ..errors import (EndpointClosedError, HandshakeError, InternalError, InvalidRequestError,
                      ListenError, PeerLostError, TransferError, UnknownPeerError, XavierError)
from .base import TaskSpawner, Transport
from .handshake import BUSY, FrameStream, PeerYielded, busy, exchange, refusal

if TYPE_CHECKING:
    from ..slabs import Slab, SlabView
    from .base import TransportHost

log = logging.getLogger("xavier_async.nixl")

#: prefix of the transport's own notifications (new receive slabs and their acks)
_XT = b"XT:"

#: environment variables: the shared secret, and "1" to listen beyond loopback without one
SECRET_ENV = "XAVIER_ASYNC_SECRET"
INSECURE_ENV = "XAVIER_ASYNC_INSECURE"


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable from this machine only."""
    import ipaddress
    import socket
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)

def _check_host(name: str, host: object) -> str:
    """A host name or IP address to listen on or advertise: a non-empty string without
    spaces or control characters (an IPv6 address may be bracketed)."""
    if not isinstance(host, str) or not host.strip("[]"):
        raise InvalidRequestError(f"{name} must be a non-empty host name or IP address string "
                                  f"such as '127.0.0.1', got {host!r}")
    if any(c.isspace() or not c.isprintable() for c in host):
        raise InvalidRequestError(f"{name} must be a host name or IP address, got {host!r} "
                                  "(it contains spaces or control characters)")
    return host


def _keepalive(stream: SocketStream, idle: int = 5, interval: int = 2, count: int = 3) -> None:
    """TCP keepalive on a peer's stream: a host that vanishes without closing its socket
    (power loss, partition) is noticed in about idle + interval * count seconds."""
    import socket
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    except (OSError, anyio.TypedAttributeLookupError):
        log.debug("could not enable TCP keepalive", exc_info=True)


def _remote_host(stream: SocketStream) -> str:
    """The peer's IP address (what the per-host pre-authentication cap counts by)."""
    try:
        addr = stream.extra(anyio.abc.SocketAttribute.remote_address)
        return str(addr[0]) if isinstance(addr, tuple) else str(addr)
    except (anyio.TypedAttributeLookupError, ValueError, TypeError, IndexError):
        return "?"


def _remote(stream: SocketStream) -> str:
    try:
        addr = stream.extra(anyio.abc.SocketAttribute.remote_address)
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
    except (anyio.TypedAttributeLookupError, ValueError, TypeError):
        return "?"


def parse_address(address: object) -> tuple[str, int]:
    """``"host:port"`` (or ``"nixl://host:port"``; an IPv6 host in brackets,
    ``"[::1]:7000"``) -> (host, port). The port is 1-65535 in ASCII digits, the host a
    host name or an IP address; anything else is a :class:`HandshakeError` with
    ``reason="address"``, raised before anything is dialled."""

    def bad(why: str) -> HandshakeError:
        return HandshakeError(f"bad peer address {address!r}: {why}; expected 'host:port' (an "
                              "IPv6 host in brackets: '[::1]:7000')", reason="address")

    if not isinstance(address, str):
        raise bad("not a string")
    host, sep, port = address.removeprefix("nixl://").rpartition(":")
    if not sep or not host:
        raise bad("no host")
    if not (port.isascii() and port.isdigit()) or len(port) > 5 or not 0 < int(port) < 65536:
        raise bad("the port must be a number from 1 to 65535")
    if host.startswith("[") or host.endswith("]") or ":" in host:  # IPv6
        if host.startswith("[") != host.endswith("]"):
            raise bad("unbalanced brackets")
        host = host[1:-1] if host.startswith("[") else host
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad("a host with ':' must be an IPv6 address") from None
        return host, int(port)
    if any(c.isspace() or not c.isprintable() for c in host):
        raise bad("the host contains spaces or control characters")
    try:
        host.encode("idna")
    except UnicodeError:
        raise bad("not a valid host name") from None
    return host, int(port)


class NixlAgent(Protocol):
    """The part of ``nixl._api.nixl_agent`` this transport uses (a fake one stands in for
    it in unit tests: ``NixlTransport(agent_factory=...)``)."""

    def get_reg_descs(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Any: ...
    def register_memory(self, descs: Any) -> Any: ...
    def deregister_memory(self, reg: Any) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> str | bytes: ...
    def remove_remote_agent(self, agent: str) -> None: ...
    def get_xfer_descs(self, descs: list[tuple[int, int, int]], mem_type: str) -> Any: ...
    def initialize_xfer(self, op: str, local: Any, remote: Any, agent: str) -> Any: ...
    def transfer(self, handle: Any, notif: bytes = b"") -> str: ...
    def check_xfer_state(self, handle: Any) -> str: ...
    def release_xfer_handle(self, handle: Any) -> None: ...
    def send_notif(self, agent: str, msg: bytes) -> None: ...
    def get_new_notifs(self) -> dict[Any, list[bytes]]: ...


#: builds the agent: (agent name, backends) -> agent
AgentFactory = Callable[[str, "list[str]"], NixlAgent]


def nixl_agent_factory(name: str, backends: list[str]) -> NixlAgent:
    """The real NIXL agent, progress thread off (we poll)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent: NixlAgent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=backends))
    return agent


class _Peer:
    __slots__ = ("rank", "agent", "recv_ptrs", "recv_dev", "mem", "fs", "lost", "handles", "hello",
                 "joined", "told")

    def __init__(self, rank: int, agent: str, recv_ptrs: dict[int, int], recv_dev: int, mem: str,
                 fs: FrameStream, hello: dict[str, Any], told: set[int]) -> None:
        self.rank, self.agent, self.recv_dev, self.mem = rank, agent, recv_dev, mem
        #: the peer's receive slabs we may write: index -> address
        self.recv_ptrs = recv_ptrs
        self.fs = fs
        self.hello = hello
        self.lost = False
        self.joined = False
        #: (our send slab, view bytes, the peer's receive slab) -> _Mapping
        self.handles: dict[tuple[int, int, int], _Mapping] = {}
        #: our receive slabs this peer knows (their registrations reached its agent)
        self.told = told

    @property
    def recv_ptr(self) -> int:
        return self.recv_ptrs[0]


class _Mapping:
    """Transfer handles for one (peer, send slab, view, peer's receive slab): the
    view-length handle plus a bounded cache of exact-length handles for trimmed copies."""

    __slots__ = ("view_bytes", "local_ptr", "by_len", "slab")

    def __init__(self, view_bytes: int, local_ptr: int, handle: Any, slab: int = 0) -> None:
        self.view_bytes = view_bytes
        self.local_ptr = local_ptr
        self.slab = slab
        self.by_len: OrderedDict[int, Any] = OrderedDict({view_bytes: handle})


class _Pending:
    __slots__ = ("peer", "handle", "nbytes", "deadline")

    def __init__(self, peer: _Peer, handle: Any, nbytes: int, deadline: float) -> None:
        self.peer, self.handle, self.nbytes, self.deadline = peer, handle, nbytes, deadline


class _Join:
    """One handshake's state on our side (the :class:`handshake.Party`).

    Connect races: while a handshake with rank ``r`` is under way it holds the claim on
    ``r``; a second handshake with the same agent meets it. The lower-ranked end decides,
    without waiting: its own connection wins over one the peer started that it has not
    committed yet (that one is *superseded*); any other newcomer yields. The higher-ranked
    end waits for the handshake in progress to end and then looks again. A handshake
    that yields makes its ``connect`` wait for the surviving connection and return its
    rank, so both ends end with exactly one connection.
    """

    def __init__(self, t: NixlTransport, fs: FrameStream, initiator: bool) -> None:
        self.t, self.fs, self.initiator = t, fs, initiator
        self.frame: dict[str, Any] = {}
        self.peer: _Peer | None = None
        self.rank: int | None = None
        self.agent: str | None = None
        self.superseded = False
        self.committed = False
        self.done = anyio.Event()
        #: our receive slabs named in the hello we sent (the peer's agent learns them)
        self.sent_slabs: set[int] = set()
        #: the acceptor's pre-authentication slot: the remote host it is counted under,
        #: until the peer's hello passed (or the handshake ended)
        self.preauth: str | None = None

    def release_preauth(self) -> None:
        """Give back the pre-authentication slot (once)."""
        who, self.preauth = self.preauth, None
        if who is not None:
            self.t._release_preauth(who)

    def _yield(self, message: str, kind: str) -> PeerYielded:
        return PeerYielded(message, kind, self.t._started_host.rank, self.t.agent_name)

    def hello(self) -> dict[str, Any]:
        frame = self.t._my_hello()
        self.sent_slabs = {int(i) for i in frame["recv_slabs"]}
        return frame

    async def check_hello(self, frame: dict[str, Any]) -> None:
        t = self.t
        t._check(frame)
        self.frame = frame
        rank, agent = frame["hello"]["rank"], frame["agent"]
        if type(rank) is not int or rank < 0 or not isinstance(agent, str):
            raise HandshakeError(f"malformed handshake from peer (rank {rank!r}, agent {agent!r})")
        self.rank, self.agent = rank, agent
        me = t._started_host.rank
        while True:
            other = t._claims.get(rank)
            if other is None:
                p = t._peers.get(rank)
                if p is not None and not p.lost:
                    if p.agent == agent:
                        raise self._yield(f"rank {rank} is already connected", "connected")
                    raise HandshakeError(f"rank {rank} is connected to another agent ({p.agent}); "
                                         "it cannot be claimed until that one is gone")
                t._check_owner(rank, agent)
                break
            if other.agent != agent:
                raise HandshakeError(f"rank {rank} is being claimed by another agent ({other.agent})")
            if me < rank:  # we decide, at once
                if self.initiator and not other.initiator and not other.committed:
                    other.superseded = True
                    break
                raise self._yield(f"a connection with rank {rank} is already being set up",
                                  "superseded")
            await other.done.wait()  # the peer decides: see how that handshake ends
        t._claims[rank] = self
        self.release_preauth()  # authenticated and introduced: no longer a stranger

    def commit(self) -> None:
        if self.superseded or self.rank is None or self.t._claims.get(self.rank) is not self:
            raise self._yield("superseded by the connection rank "
                              f"{min(self.rank or 0, self.t._host.rank if self.t._host else 0)} started",
                              "superseded")
        self.peer = self.t._add_peer(self.frame, self.fs, self.sent_slabs)
        self.committed = True

    def finish(self) -> None:
        if self.rank is not None and self.t._claims.get(self.rank) is self:
            del self.t._claims[self.rank]
        self.done.set()
        self.t._notify()


class NixlTransport(Transport):
    """Real transfers over NIXL (UCX underneath: shared memory / CUDA IPC / NVLink in a
    host, TCP or RDMA across hosts).

    ``host``/``port``: where this endpoint listens for peers (port 0 picks a free one;
    read :attr:`address`). ``advertise``: the host name peers should dial, if it differs
    from ``host`` (for example when listening on ``0.0.0.0``). ``idle_poll``: the longest
    sleep between notification polls when nothing has happened for ``hot_window`` seconds.
    ``trim_handles``: how many exact-length handles to keep per view for trimmed copies.
    ``spin``: seconds :meth:`post` busy-polls a copy before handing it to the event loop.
    ``agent_factory``: builds the NIXL agent (tests pass a fake one).

    Peer authentication (docs/threat-model.md): ``secret`` (or ``XAVIER_ASYNC_SECRET``),
    required to listen beyond loopback unless ``insecure`` (or ``XAVIER_ASYNC_INSECURE``,
    parsed strictly: ``1/true/yes/on`` or ``0/false/no/off``/empty).

    Limits before a peer is authenticated, so that silent or slow strangers cannot lock
    real peers out: a connection must send its first handshake frame within
    ``first_frame_timeout`` seconds and each later one, up to its hello, within
    ``preauth_step_timeout`` (its slot is freed at once when a step is late). At most
    ``max_unauthenticated`` such handshakes are pending at once, and at most
    ``max_unauthenticated_per_host`` from one remote address; a connection beyond either
    cap is told "busy" and closed at once, and a connecting xavier_async endpoint retries
    it until its own timeout. ``handshake_timeout`` bounds a whole handshake and is the
    default timeout of :meth:`connect`. ``rank_grace``: how long a rank lost without a
    clean close stays reserved for its agent. ``stall_check``: after a stall this long
    (SIGSTOP, swap), the poll loop re-checks every peer's connection before serving.

    Every setting is validated here (:class:`InvalidRequestError` naming it): numbers are
    finite, timeouts > 0, hosts non-empty strings.
    """

    name = "nixl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None,
                 backends: tuple[str, ...] = ("UCX",), idle_poll: float = 0.0005,
                 hot_window: float = 0.05, write_timeout: float = 30.0,
                 handshake_timeout: float = 10.0, trim_handles: int = 64,
                 spin: float = 0.0001, agent_factory: AgentFactory | None = None,
                 secret: str | bytes | None = None, insecure: bool | None = None,
                 first_frame_timeout: float = 2.0, max_unauthenticated: int = 64,
                 rank_grace: float = 30.0, stall_check: float = 0.25,
                 preauth_step_timeout: float = 1.0, max_unauthenticated_per_host: int = 8) -> None:
        super().__init__()
        # every setting is checked before anything else happens (InvalidRequestError)
        host = _check_host("host", host)
        if advertise is not None:
            advertise = _check_host("advertise", advertise)
        port = check_int("port", port, minimum=0, maximum=65535)
        if isinstance(backends, str) or not isinstance(backends, (tuple, list)) or not backends \
                or not all(isinstance(b, str) and b for b in backends):
            raise InvalidRequestError(f"backends must be a non-empty tuple of NIXL backend names "
                                      f"such as ('UCX',), got {backends!r}")
        # timeouts must be > 0 (0 would fail every handshake or copy); the others may be 0
        first_frame_timeout = check_number("first_frame_timeout", first_frame_timeout,
                                           strictly_positive=True)
        preauth_step_timeout = check_number("preauth_step_timeout", preauth_step_timeout,
                                            strictly_positive=True)
        handshake_timeout = check_number("handshake_timeout", handshake_timeout, strictly_positive=True)
        write_timeout = check_number("write_timeout", write_timeout, strictly_positive=True)
        idle_poll = check_number("idle_poll", idle_poll)
        hot_window = check_number("hot_window", hot_window)
        spin = check_number("spin", spin)
        rank_grace = check_number("rank_grace", rank_grace)
        stall_check = check_number("stall_check", stall_check)
        trim_handles = check_int("trim_handles", trim_handles, minimum=1)
        max_unauthenticated = check_int("max_unauthenticated", max_unauthenticated, minimum=1)
        max_unauthenticated_per_host = check_int("max_unauthenticated_per_host",
                                                 max_unauthenticated_per_host, minimum=1)
        if insecure is None:
            insecure = env_flag(INSECURE_ENV)
        check_bool("insecure", insecure)
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or None
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise InvalidRequestError(f"secret must be str or bytes of at least 16 bytes "
                                      f"(got {type(secret).__name__} of {len(secret) if isinstance(secret, bytes) else '?'}); "
                                      "for example: python -c 'import secrets; print(secrets.token_hex(32))'")
        if secret is None and not insecure and not _is_loopback(host):
            raise InvalidRequestError(
                f"refusing to listen on {host!r} without a secret: anyone who can reach that port "
                f"could read every published block and write into this endpoint's receive slab. "
                f"Pass secret= (or set {SECRET_ENV}) on every endpoint, or insecure=True (or "
                f"{INSECURE_ENV}=1) if the network is trusted")
        self._secret: bytes | None = secret
        self.insecure = insecure
        self.first_frame_timeout, self.rank_grace = first_frame_timeout, rank_grace
        self.preauth_step_timeout = preauth_step_timeout
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_host = min(max_unauthenticated_per_host, max_unauthenticated)
        #: handshakes accepted whose peer has not passed its hello yet, in all and by host
        self._unauthenticated = 0
        self._unauthenticated_by_host: dict[str, int] = {}
        #: connections turned away at once ("busy" refusal) because max_unauthenticated
        #: handshakes, or max_unauthenticated_per_host from that host, were pending
        self.refused_connections = 0
        #: ranks lost without a clean close: rank -> (agent, reserved until)
        self._gone: dict[int, tuple[str, float]] = {}
        self._listen_host, self._port = host, port
        self._advertise = advertise
        self._backends = list(backends)
        self.idle_poll, self.hot_window = idle_poll, hot_window
        self.write_timeout, self.handshake_timeout = write_timeout, handshake_timeout
        self.trim_handles = trim_handles
        self.spin = spin
        #: a poll loop that finds itself this many seconds after its previous pass (the
        #: process was stalled: SIGSTOP, swap, a long GC) re-checks every peer's control
        #: stream before it serves anything; 0 turns the check off
        self.stall_check = stall_check
        self.agent: NixlAgent | None = None
        self._agent_factory: AgentFactory = agent_factory or nixl_agent_factory
        self.agent_name = ""
        self._host: TransportHost | None = None
        self._tg: TaskSpawner | None = None
        self._send_slab: Slab | None = None
        #: our send slabs by index (the first is _send_slab)
        self._send_slabs: dict[int, Slab] = {}
        self._recv_slab: Slab | None = None
        self._mem = "DRAM"
        self._dev = 0
        self._reg: list[Any] = []
        #: receive slabs by index and their registrations
        self._recv_slabs: dict[int, Slab] = {}
        self._recv_regs: dict[int, Any] = {}
        #: receive slab indices whose registration is under way
        self._registering: set[int] = set()
        #: (peer agent, slab index) -> set when the peer acknowledged our new slab
        self._acks: dict[tuple[str, int], anyio.Event] = {}
        #: agents of peers we dropped, for late notifications (bounded)
        self._former: OrderedDict[str, int] = OrderedDict()
        #: copies given up on (timed out while still posted): handle id -> (rank, handle)
        self._stuck: dict[int, tuple[int, Any]] = {}
        #: stalls noticed by the poll loop (each followed by a liveness check)
        self.stalls_seen = 0
        self._peers: dict[int, _Peer] = {}
        self._by_agent: dict[str, int] = {}
        #: handshakes under way, by the rank they claim
        self._claims: dict[int, _Join] = {}
        self._changed = anyio.Event()
        self._listener: Any = None
        self._bound: tuple[str, int] | None = None
        self._last_activity = 0.0
        self._closed = False
        #: ids of transfer handles with a copy posted and not yet terminal, and handles
        #: whose release waits for that
        self._in_flight: dict[int, int] = {}
        self._release_later: dict[int, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self, host: TransportHost, send: Slab, recv: Slab, tg: TaskSpawner) -> None:
        self._host, self._tg = host, tg
        self._send_slab, self._recv_slab = send, recv
        self._send_slabs = {send.index: send}
        dev = send.device
        if dev.type == "cuda":
            self._mem, self._dev = "VRAM", dev.index if dev.index is not None else 0
        elif dev.type == "cpu":
            self._mem, self._dev = "DRAM", 0
        else:
            raise InvalidRequestError(f"NIXL transport supports cpu and cuda caches, not {dev}")
        self.agent_name = f"xa-{host.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = self._agent_factory(self.agent_name, list(self._backends))
        for slab in (send, recv):
            self._reg.append(self._agent.register_memory(self._reg_descs(slab)))
            self.memory_registrations += 1
        self._recv_slabs[recv.index] = recv
        self._recv_regs[recv.index] = self._reg[-1]
        self._listener = await self._listen()
        sock = self._listener.extra(anyio.abc.SocketAttribute.local_address)
        self._bound = (sock[0], sock[1])
        for listener in getattr(self._listener, "listeners", [self._listener]):
            self._tasks.start_soon(self._accept_loop, listener)
        self._tasks.start_soon(self._poll_loop)

    async def _listen(self) -> Any:
        """Bind and listen on ``host:port``; a failure is a :class:`ListenError` naming both,
        with the operating system's error chained."""
        host, port = self._listen_host, self._port
        where = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            return await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                hint = "the port is in use: pass another port (0 picks a free one) or stop what listens there"
            elif exc.errno == errno.EADDRNOTAVAIL:
                hint = "that host is not an address of this machine: pass one of its own addresses"
            elif isinstance(exc, socket.gaierror):
                hint = "that host name does not resolve: pass an address of this machine"
            elif exc.errno == errno.EACCES:
                hint = "this process may not bind that port (ports below 1024 need privileges)"
            else:
                hint = "pass another host or port"
            raise ListenError(f"cannot listen on {where}: {exc.strerror or exc}; {hint}",
                              exc.errno) from exc

    def _reg_descs(self, slab: Slab) -> Any:
        return self._agent.get_reg_descs([(slab.tensor.data_ptr(), slab.full.nbytes, self._dev, "")],
                                         self._mem)

    async def _register(self, slab: Slab) -> Any:
        """Register one more slab of the endpoint's (its device's) memory."""
        await anyio.lowlevel.checkpoint()
        if self._send_slab is None or slab.device != self._send_slab.device:
            raise InvalidRequestError(
                f"{'receive' if slab.direction == 'recv' else 'send'} slab on {slab.device}, "
                "not on the endpoint's device")
        reg = self._agent.register_memory(self._reg_descs(slab))
        self._reg.append(reg)
        self.memory_registrations += 1
        return reg

    async def add_send_slab(self, slab: Slab) -> None:
        await self._register(slab)
        self._send_slabs[slab.index] = slab

    async def add_recv_slab(self, slab: Slab) -> None:
        if slab.index in self._recv_slabs or slab.index in self._registering:
            raise InvalidRequestError(f"receive slab {slab.index} is already registered")
        self._registering.add(slab.index)  # claimed before the registration awaits
        try:
            self._recv_regs[slab.index] = await self._register(slab)
            self._recv_slabs[slab.index] = slab
        finally:
            self._registering.discard(slab.index)

    async def share_recv_slab(self, peer: int, slab: Slab) -> None:
        """Send the slab's registration (NIXL partial agent metadata) and address to the
        peer as a notification and wait for its acknowledgement."""
        p = self._peer(peer)
        if slab.index in p.told:
            return
        if slab.index not in self._recv_regs:
            raise InvalidRequestError(f"receive slab {slab.index} is not registered")
        meta = self._agent.get_partial_agent_metadata(self._reg_descs(slab), False, self._backends)  # type: ignore[attr-defined]
        key = (p.agent, slab.index)
        ack = self._acks[key] = anyio.Event()
        msg = _XT + json.dumps({"slab": slab.index, "ptr": slab.tensor.data_ptr(),
                                "meta": base64.b64encode(meta).decode()}).encode()
        try:
            try:
                self._agent.send_notif(p.agent, msg)
            except Exception as exc:
                raise PeerLostError(f"cannot tell rank {peer} about receive slab {slab.index}: {exc}") from exc
            with anyio.move_on_after(self.handshake_timeout) as scope:
                await ack.wait()
            if scope.cancelled_caught or p.lost:
                raise PeerLostError(f"rank {peer} did not acknowledge receive slab {slab.index} "
                                    f"within {self.handshake_timeout} s")
        finally:
            self._acks.pop(key, None)
        p.told.add(slab.index)

    def _on_transport_msg(self, agent: str, msg: bytes) -> None:
        """A transport-level notification: a peer's new receive slab, or our ack."""
        try:
            body = json.loads(msg[len(_XT):])
            if "ack" in body:
                ev = self._acks.get((agent, int(body["ack"])))
                if ev is not None:
                    ev.set()
                return
            rank = self._by_agent.get(agent)
            p = self._peers.get(rank) if rank is not None else None
            if p is None or p.lost:
                return
            index, ptr = int(body["slab"]), int(body["ptr"])
            self._agent.add_remote_agent(base64.b64decode(body["meta"], validate=True))
            p.recv_ptrs[index] = ptr
            self._agent.send_notif(agent, _XT + json.dumps({"ack": index}).encode())
        except Exception:
            log.warning("bad transport message from agent %s", agent, exc_info=True)

    def peer_recv_slabs(self, peer: int) -> tuple[int, ...]:
        return tuple(sorted(self._peer(peer).recv_ptrs))

    def unsettled(self) -> set[int]:
        return set(self._in_flight.values()) | {rank for rank, _ in self._stuck.values()}

    def _check_stuck(self) -> None:
        for key, (rank, h) in list(self._stuck.items()):
            try:
                state = self._agent.check_xfer_state(h)
            except Exception:
                state = "ERR"
            if state != "PROC":
                del self._stuck[key]
                self._release_handle(h)

    def _sweep(self) -> None:
        """After a stall: a peer whose control stream has ended is lost now, before any
        request of its is served (its receiver may have given up on us meanwhile)."""
        import socket
        self.stalls_seen += 1
        for peer in list(self._peers.values()):
            if peer.lost:
                continue
            try:
                # the event loop's socket object refuses recv(): peek through a duplicate
                fd = peer.fs.stream.extra(anyio.abc.SocketAttribute.raw_socket).fileno()
                with socket.socket(fileno=os.dup(fd)) as dup:
                    data = dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except Exception:  # a broken socket, or none: treat the stream as ended
                data = b""
            if data == b"":  # the other end closed its side
                self._peer_gone(peer, True)
                self._started_host.peer_lost(peer.rank, PeerLostError(
                    f"rank {peer.rank} closed the connection (noticed after a stall)"))

    @property
    def address(self) -> str:
        if self._bound is None:
            raise EndpointClosedError("the NIXL transport is not started (it starts with its "
                                      "endpoint: `async with Endpoint(...)`)")
        host = self._advertise or (self._bound[0] if self._bound[0] not in ("0.0.0.0", "::")
                                   else "127.0.0.1")
        return f"{host}:{self._bound[1]}"

    def describe(self) -> dict[str, Any]:
        import nixl
        try:
            from importlib.metadata import version
            ver = version("nixl")
        except Exception:
            ver = getattr(nixl, "__version__", "?")
        return {"transport": self.name, "nixl": ver, "memory": self._mem, "backends": self._backends}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._listener is not None:
                await self._listener.aclose()
            for rank in list(self._peers):
                await self.disconnect(rank)
            if self.agent is not None:
                stuck = list(self._stuck.values())
                self._stuck.clear()
                for _, h in stuck:
                    self._release_handle(h)
                for reg in self._reg:
                    try:
                        self._agent.deregister_memory(reg)
                    except Exception:
                        log.warning("deregister_memory failed", exc_info=True)
                self._reg.clear()

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

    # -- handshake ----------------------------------------------------------------------
    def _my_hello(self) -> dict[str, Any]:
        if self._recv_slab is None:
            raise InternalError("the NIXL transport has no receive slab before start()")
        return {"hello": self._started_host.hello(), "agent": self.agent_name,
                "meta": base64.b64encode(self._agent.get_agent_metadata()).decode(),
                "recv_ptr": self._recv_slab.tensor.data_ptr(), "recv_dev": self._dev,
                "recv_slabs": {str(i): s.tensor.data_ptr() for i, s in self._recv_slabs.items()},
                "mem": self._mem}

    def _check(self, frame: dict[str, Any]) -> None:
        try:
            hello = frame["hello"]
            frame["agent"], frame["meta"], frame["recv_ptr"]
        except (KeyError, TypeError):
            raise HandshakeError("malformed handshake from peer") from None
        self._started_host.check_hello(hello)

    def _add_peer(self, frame: dict[str, Any], fs: FrameStream, told: set[int] | None = None) -> _Peer:
        try:  # parse everything before touching the agent
            rank = frame["hello"]["rank"]
            meta = base64.b64decode(frame["meta"], validate=True)
            recv_ptr, recv_dev = int(frame["recv_ptr"]), int(frame.get("recv_dev", 0))
            recv_ptrs = {int(i): int(p) for i, p in dict(frame.get("recv_slabs", {})).items()}
            recv_ptrs.setdefault(0, recv_ptr)
            mem = str(frame.get("mem", "DRAM"))
        except (KeyError, TypeError, ValueError) as exc:
            raise HandshakeError(f"malformed handshake from peer: {exc!r}") from None
        if type(rank) is not int or rank < 0 or mem not in ("DRAM", "VRAM"):
            raise HandshakeError(f"malformed handshake from peer (rank {rank!r}, memory {mem!r})")
        old = self._peers.get(rank)
        if old is not None and not old.lost:
            raise HandshakeError(f"rank {rank} is already connected")
        if old is not None:
            self._drop(rank)
        name = self._agent.add_remote_agent(meta)
        if isinstance(name, bytes):
            name = name.decode()
        self._former.pop(name, None)
        peer = _Peer(rank, name, recv_ptrs, recv_dev, mem, fs, frame["hello"],
                     set(told) if told is not None else {0})
        self._peers[rank] = peer
        self._by_agent[peer.agent] = rank
        return peer

    def _timeout(self, timeout: float | None) -> float:
        if timeout is None:
            return self.handshake_timeout
        return float(check_number("timeout", timeout, strictly_positive=True))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _joined(self, join: _Join) -> _Peer:
        peer = join.peer
        if peer is None:
            raise InternalError("a handshake finished without adding its peer")
        peer.joined = True
        self._started_host.peer_joined(peer.rank, peer.hello)
        return peer

    async def _await_peer(self, rank: int | None, agent: str | None, deadline: float,
                          address: str) -> _Peer:
        """After yielding a connect race: wait for the surviving connection."""
        while True:
            p = self._peers.get(rank) if rank is not None else None
            if p is not None and not p.lost and p.joined and (agent is None or p.agent == agent):
                return p
            changed = self._changed
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())) as scope:
                await changed.wait()
            if scope.cancelled_caught:
                raise HandshakeError(f"handshake with {address}: the other connection with rank "
                                     f"{rank} did not come up in time", reason="timeout")

    async def connect(self, address: str, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """Handshake with the endpoint at ``address`` within ``timeout`` (default
        ``handshake_timeout``). A peer that turns the connection away as busy (too many
        handshakes pending there) is tried again with short, growing, jittered pauses
        until the timeout; every failure is a :class:`HandshakeError` whose ``reason`` says
        why (or a :class:`LayoutMismatchError`)."""
        limit = self._timeout(timeout)
        host, port = parse_address(address)
        deadline = anyio.current_time() + limit
        pause = 0.01
        while True:
            try:
                return await self._connect_once(address, host, port, deadline)
            except HandshakeError as exc:
                if exc.reason != BUSY:
                    raise
                left = deadline - anyio.current_time()
                if left <= pause:
                    raise HandshakeError(
                        f"the peer at {address} stayed busy for the whole {limit:g} s connect "
                        f"timeout ({exc}): it may be under a connection flood; try again later, "
                        "or raise its max_unauthenticated", reason=BUSY) from exc
                log.debug("%s is busy, trying again: %s", address, exc)
                await anyio.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, 0.2)

    async def _connect_once(self, address: str, host: str, port: int,
                            deadline: float) -> tuple[int, dict[str, Any]]:
        tasks = self._tasks
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                stream = await anyio.connect_tcp(host, port)
        except TimeoutError as exc:
            raise HandshakeError(f"cannot reach a peer at {address}: no connection in time",
                                 reason="timeout") from exc
        except (OSError, ValueError) as exc:  # ValueError: a host name the resolver refuses
            raise HandshakeError(f"cannot reach a peer at {address}: {exc}",
                                 reason="unreachable") from exc
        _keepalive(stream)
        fs = FrameStream(stream)
        join = _Join(self, fs, initiator=True)
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                await exchange(fs, initiator=True, party=join, secret=self._secret)
        except BaseException as exc:
            if join.peer is not None:  # added but never joined: forget it again
                self._drop(join.peer.rank)
            join.finish()
            await fs.aclose()
            if isinstance(exc, PeerYielded):  # a connect race, or already connected
                rank = join.rank if join.rank is not None else exc.rank
                agent = join.agent if join.agent is not None else exc.agent
                p = await self._await_peer(rank, agent, deadline, address)
                return p.rank, p.hello
            if isinstance(exc, XavierError):
                raise
            if isinstance(exc, TimeoutError):
                raise HandshakeError(f"handshake with {address} failed: no answer in time",
                                     reason="timeout") from exc
            if isinstance(exc, (OSError, anyio.EndOfStream, anyio.IncompleteRead,
                                anyio.BrokenResourceError)):
                raise HandshakeError(
                    f"handshake with {address} failed: the peer closed the connection without "
                    f"saying why ({type(exc).__name__}); it may be stopping, or it is not an "
                    "xavier_async endpoint", reason="closed") from exc
            if isinstance(exc, (ValueError, TypeError)):
                raise HandshakeError(f"handshake with {address} failed: {exc!r}") from exc
            raise
        peer = self._joined(join)
        join.finish()
        tasks.start_soon(self._watch, peer)
        return peer.rank, peer.hello

    async def _accept_loop(self, listener: Any) -> None:
        tasks = self._tasks
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of file descriptors (a flood), or the like: go on
                log.warning("accepting a connection failed: %s", exc)
                await anyio.sleep(0.05)
                continue
            who = _remote_host(stream)
            full = self._busy(who)
            if full is not None:  # a flood: say so, and hang up at once
                self.refused_connections += 1
                await self._turn_away(stream, full)
                continue
            self._unauthenticated += 1
            self._unauthenticated_by_host[who] = self._unauthenticated_by_host.get(who, 0) + 1
            tasks.start_soon(self._accept, stream, who)

    def _busy(self, who: str) -> str | None:
        """Why a new connection from ``who`` is turned away now, or ``None``."""
        if self._unauthenticated >= self.max_unauthenticated:
            return (f"{self._unauthenticated} handshakes are pending at this endpoint "
                    f"(max_unauthenticated={self.max_unauthenticated}); try again shortly")
        mine = self._unauthenticated_by_host.get(who, 0)
        if mine >= self.max_unauthenticated_per_host:
            return (f"{mine} handshakes from {who} are pending at this endpoint "
                    f"(max_unauthenticated_per_host={self.max_unauthenticated_per_host}); "
                    "try again shortly")
        return None

    def _release_preauth(self, who: str) -> None:
        self._unauthenticated -= 1
        left = self._unauthenticated_by_host.get(who, 0) - 1
        if left > 0:
            self._unauthenticated_by_host[who] = left
        else:
            self._unauthenticated_by_host.pop(who, None)

    async def _turn_away(self, stream: SocketStream, why: str) -> None:
        """Tell a connection we will not serve now why (a "busy" refusal frame, which its
        ``connect`` retries), then close it. Bounded: a fresh socket's send buffer takes
        the small frame at once, and nothing is read."""
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(0.05):
                try:
                    await FrameStream(stream).send(refusal(busy(why)))
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass
            await stream.aclose()

    async def _accept(self, stream: SocketStream, who: str) -> None:
        fs = FrameStream(stream)
        join = _Join(self, fs, initiator=False)
        join.preauth = who  # taken by _accept_loop; released at the hello, or below
        try:
            try:
                with anyio.fail_after(self.handshake_timeout):
                    await exchange(fs, initiator=False, party=join, secret=self._secret,
                                   first_timeout=self.first_frame_timeout,
                                   step_timeout=self.preauth_step_timeout)
            finally:
                join.release_preauth()
        except Exception as exc:
            if isinstance(exc, PeerYielded):
                log.debug("handshake from a peer gave way to another connection: %s", exc)
            elif "authentication failed" in str(exc):
                log.warning("refused a peer from %s: %s", _remote(stream), exc)
            else:
                log.info("handshake from %s failed: %r", _remote(stream), exc)
            if join.peer is not None:
                self._drop(join.peer.rank)
            join.finish()
            await fs.aclose()
            return
        _keepalive(stream)
        peer = self._joined(join)
        join.finish()
        await self._watch(peer)

    async def _watch(self, peer: _Peer) -> None:
        """Hold the peer's TCP stream; its end means the peer is gone."""
        reason = "closed the connection"
        confirmed = False  # its side closed the connection: the process closed or died
        try:
            while True:
                await peer.fs.reader.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            reason = f"connection ended ({type(exc).__name__})"
            confirmed = isinstance(exc, anyio.EndOfStream) or isinstance(
                exc.__cause__ or exc, ConnectionResetError)
        finally:
            current = self._peers.get(peer.rank)
            if current is peer and not peer.lost and not self._closed:
                self._peer_gone(peer, confirmed)
                self._started_host.peer_lost(peer.rank, PeerLostError(f"rank {peer.rank} {reason}"))

    def _peer_gone(self, peer: _Peer, confirmed: bool) -> None:
        """Mark ``peer`` lost. Unless its side closed the connection (``confirmed``), its
        rank stays reserved for its agent for ``rank_grace`` seconds: the old process may
        still be alive behind a partition and still hold our receive slab's address."""
        peer.lost = True
        if confirmed:
            self._gone.pop(peer.rank, None)
        else:
            self._gone[peer.rank] = (peer.agent, anyio.current_time() + self.rank_grace)

    def _check_owner(self, rank: int, agent: str) -> None:
        gone = self._gone.get(rank)
        if gone is None:
            return
        old, until = gone
        left = until - anyio.current_time()
        if old == agent or left <= 0:
            del self._gone[rank]
            return
        raise HandshakeError(
            f"rank {rank} was lost {self.rank_grace - left:.1f} s ago without a clean close and "
            f"may still be alive; another agent can claim it in {left:.1f} s, or at once after "
            f"the old one ({old}) reconnects and closes")

    # -- peers --------------------------------------------------------------------------
    def _peer(self, rank: int) -> _Peer:
        p = self._peers.get(rank)
        if p is None:
            raise UnknownPeerError(f"rank {rank} is not connected")
        if p.lost:
            raise PeerLostError(f"rank {rank} is gone")
        return p

    def _release_handle(self, h: Any) -> None:
        if id(h) in self._in_flight:  # still posted: released when its copy is terminal
            self._release_later[id(h)] = h
            return
        if id(h) in self._stuck:  # timed out but maybe still posted: _check_stuck releases it
            return
        try:
            self._agent.release_xfer_handle(h)
        except Exception:
            log.debug("release_xfer_handle failed", exc_info=True)

    def _release(self, peer: _Peer) -> None:
        for m in peer.handles.values():
            for h in m.by_len.values():
                self._release_handle(h)
        peer.handles.clear()

    def _drop(self, rank: int) -> None:
        peer = self._peers.pop(rank, None)
        if peer is None:
            return
        peer.lost = True
        self._release(peer)
        self._by_agent.pop(peer.agent, None)
        self._former[peer.agent] = rank  # its late notifications still mean something
        while len(self._former) > 256:
            self._former.popitem(last=False)
        self._notify()
        try:
            self._agent.remove_remote_agent(peer.agent)
        except Exception:
            log.debug("remove_remote_agent failed", exc_info=True)

    async def forget(self, peer: int) -> None:
        p = self._peers.get(peer)
        if p is not None:
            self._release(p)

    async def disconnect(self, peer: int) -> None:
        p = self._peers.get(peer)
        if p is None:
            return
        self._drop(peer)
        with anyio.CancelScope(shield=True):
            await p.fs.aclose()

    # -- data path ----------------------------------------------------------------------
    def _handle(self, peer: _Peer, local_ptr: int, nbytes: int, slab: int = 0) -> Any:
        return self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs([(local_ptr, nbytes, self._dev)], self._mem),
            self._agent.get_xfer_descs([(peer.recv_ptrs[slab], nbytes, peer.recv_dev)], peer.mem),
            peer.agent)

    async def map_view(self, peer: int, view: SlabView, slab: int = 0) -> object:
        p = self._peer(peer)
        send = view.slab.index
        if self._send_slabs.get(send) is not view.slab:
            raise InvalidRequestError(f"{view} is not a view of this endpoint's send slabs")
        if slab not in p.recv_ptrs:
            raise InvalidRequestError(f"rank {peer} has not shared a receive slab {slab}")
        await anyio.lowlevel.checkpoint()
        key = (send, view.nbytes, slab)
        old = p.handles.get(key)
        if old is not None:
            return old
        m = _Mapping(view.nbytes, view.data_ptr, self._handle(p, view.data_ptr, view.nbytes, slab), slab)
        p.handles[key] = m
        return m

    def post(self, peer: int, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        p = self._peer(peer)
        if not isinstance(mapping, _Mapping):
            raise InvalidRequestError(f"not a mapping of this transport: {mapping!r}")
        m = mapping
        h = m.by_len.get(nbytes)
        if h is None:  # trimmed copy of a new length: exact-length handle, kept in a small LRU
            h = self._handle(p, m.local_ptr, nbytes, m.slab)
            m.by_len[nbytes] = h
            if len(m.by_len) > self.trim_handles + 1:
                for old_len in list(m.by_len):
                    if old_len != m.view_bytes and old_len != nbytes:
                        self._release_handle(m.by_len.pop(old_len))
                        break
        elif nbytes != m.view_bytes:
            m.by_len.move_to_end(nbytes)
        agent = self._agent
        now = time.monotonic()
        self._last_activity = now
        state = agent.transfer(h, notify or b"")
        # spin briefly: a small copy completes in ~10-20 us, far less than a trip
        # through the event loop. Spinning also drives UCX's progress: a copy that does
        # not finish inside this call sends its notification only from a later
        # check_xfer_state, which a busy event loop makes late. (Skipping the spin for
        # copies posted under load and for large copies was measured on the H200 pair,
        # same loan: 20% fewer small loads/s with two endpoints loading from each other.)
        until = time.perf_counter() + self.spin
        while state == "PROC" and time.perf_counter() < until:
            state = agent.check_xfer_state(h)
        if state == "DONE":
            return None
        if state != "PROC":
            raise TransferError(f"NIXL reported {state} for a copy of {nbytes} B to rank {peer}")
        self._in_flight[id(h)] = p.rank
        return _Pending(p, h, nbytes, now + self.write_timeout)

    async def wait(self, pending: object) -> None:
        """Poll a posted copy to a terminal state. A copy is never abandoned while NIXL
        may still be reading the send slab: if the peer is lost meanwhile, polling goes on
        (UCX fails the copy once the connection is gone) until ``write_timeout``. A copy
        that reached DONE landed, even if its peer was lost meanwhile (it counts as sent);
        one still posted at ``write_timeout`` stays *unsettled* (:meth:`unsettled`) until
        NIXL reports a terminal state for it."""
        if not isinstance(pending, _Pending):
            raise InvalidRequestError(f"not a pending copy of this transport: {pending!r}")
        w = pending
        agent, checkpoint = self._agent, anyio.lowlevel.checkpoint
        key = id(w.handle)
        stuck = False
        try:
            while True:
                await checkpoint()
                state = agent.check_xfer_state(w.handle)
                if state == "DONE":  # the bytes landed, whether or not the peer is still here
                    return
                if state != "PROC":
                    if w.peer.lost:
                        raise PeerLostError(f"rank {w.peer.rank} went away during a copy")
                    raise TransferError(
                        f"NIXL reported {state} for a copy of {w.nbytes} B to rank {w.peer.rank}")
                if time.monotonic() > w.deadline:
                    stuck = True
                    raise TransferError(
                        f"copy to rank {w.peer.rank} did not finish in {self.write_timeout} s")
        finally:
            self._in_flight.pop(key, None)
            late = self._release_later.pop(key, None)
            if stuck:  # may still land: watched by the poll loop, released when terminal
                self._stuck[key] = (w.peer.rank, late if late is not None else w.handle)
            elif late is not None:
                self._release_handle(late)

    async def send(self, peer: int, msg: bytes) -> None:
        p = self._peer(peer)
        self._last_activity = time.monotonic()
        try:
            self._agent.send_notif(p.agent, msg)
        except Exception as exc:
            raise PeerLostError(f"cannot notify rank {peer}: {exc}") from exc
        await anyio.lowlevel.checkpoint()

    async def _poll_loop(self) -> None:
        """Deliver NIXL notifications to the endpoint; spin while busy, nap while idle."""
        agent, host = self._agent, self._started_host
        by_agent = self._by_agent
        deliver = host.deliver
        checkpoint, sleep, monotonic = anyio.lowlevel.checkpoint, anyio.sleep, time.monotonic
        sched_yield = getattr(os, "sched_yield", None)
        # Pinned to one CPU, a yield hands that CPU to CUDA's and UCX's own threads and
        # costs a timeslice (~200 us measured): poll through the event loop only.
        share = sched_yield is not None and _cpus() > 1
        last_pass = monotonic()
        while True:
            now = monotonic()
            if self.stall_check and now - last_pass > self.stall_check:
                self._sweep()  # we were stalled: drop peers that hung up before serving them
            last_pass = now
            if self._stuck:
                self._check_stuck()
            notifs = agent.get_new_notifs()
            if notifs:
                self._last_activity = monotonic()
                for raw_name, msgs in notifs.items():
                    name = raw_name if isinstance(raw_name, str) else raw_name.decode()
                    rank = by_agent.get(name)
                    for msg in msgs:
                        try:
                            if msg[:3] == _XT:
                                self._on_transport_msg(name, msg)
                            elif rank is not None:
                                deliver(rank, msg, True)  # a load request may be served right here
                            elif name in self._former:  # a late reply from a dropped peer
                                host.deliver_late(self._former[name], msg)
                        except Exception:  # never let one message stop the poller
                            log.exception("delivering a message from agent %s failed", name)
                await checkpoint()
            elif monotonic() - self._last_activity < self.hot_window:
                # nothing yet: give the core to any other runnable process (often our peer,
                # on a small machine) before polling again
                if share and sched_yield is not None:
                    sched_yield()
                await checkpoint()
            else:
                await sleep(self.idle_poll)
                share = sched_yield is not None and _cpus() > 1  # affinity may have changed


def _cpus() -> int:
    """CPUs this process may run on (its affinity), 2 where that cannot be known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 2

"""How NIXL endpoints meet: listening, dialling, accepting, and the connect race.

:class:`Peering` is the TCP side of one :class:`~xavier_async.transports.nixl.NixlTransport`:

* it **listens** on ``host:port`` and **accepts** connections, each under a
  pre-authentication slot (:mod:`.admission`) until the peer's hello passed;
* it **dials** (:meth:`Peering.connect`), retrying a peer that turned it away as busy
  with short, growing, jittered pauses until the connect timeout;
* both run the same handshake (:func:`.handshake.exchange`) and, once it passed, hand the
  peer's stream to :mod:`.liveness` to watch.

The transport keeps the peers themselves (their NIXL agents): peering calls it back to
build its hello, check the peer's, add the peer when the handshake commits and drop it
again.

**The connect race** (:class:`_Join`, one per handshake): while a handshake with rank
``r`` is under way it holds the *claim* on ``r``; a second handshake with the same agent
meets it. The lower-ranked end decides, without waiting: its own connection wins over
one the peer started that it has not committed yet (that one is *superseded*); any other
newcomer yields. The higher-ranked end waits for the handshake in progress to end and
then looks again. A handshake that yields makes its ``connect`` wait for the surviving
connection and return its rank, so both ends end with exactly one connection.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.abc import SocketStream

from .._checks import check_number
from ..errors import HandshakeError, InternalError, ListenError, XavierError
from .addresses import parse_address, remote_address, remote_host
from .admission import Admission
from .handshake import BUSY, Frame, FrameStream, PeerYielded, exchange
from .liveness import Liveness, keepalive

if TYPE_CHECKING:
    from .base import TaskSpawner, TransportHost

log = logging.getLogger("xavier_async.nixl")


class Peer(Protocol):
    """A peer in the transport's table, as peering sees it."""

    rank: int
    agent: str
    fs: FrameStream
    lost: bool
    #: the handshake passed on both ends (``peer_joined`` was called)
    joined: bool
    #: the endpoint's hello it sent
    hello: dict[str, Any]


class _Join:
    """One handshake's state on our side (the :class:`.handshake.Party`): the claim it
    holds in the connect race (see the module's docstring)."""

    def __init__(self, p: Peering, fs: FrameStream, initiator: bool) -> None:
        self.p, self.fs, self.initiator = p, fs, initiator
        self.frame: Frame = {}
        self.peer: Peer | None = None
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
            self.p.admission.release(who)

    def _yield(self, message: str, kind: str) -> PeerYielded:
        return PeerYielded(message, kind, self.p.host.rank, self.p.agent_name)

    def hello(self) -> Frame:
        frame = self.p.my_hello()
        self.sent_slabs = {int(i) for i in frame["recv_slabs"]}
        return frame

    async def check_hello(self, frame: Frame) -> None:
        p = self.p
        p.check(frame)
        self.frame = frame
        rank, agent = frame["hello"]["rank"], frame["agent"]
        if type(rank) is not int or rank < 0 or not isinstance(agent, str):
            raise HandshakeError(f"malformed handshake from peer (rank {rank!r}, agent {agent!r})")
        self.rank, self.agent = rank, agent
        me = p.host.rank
        while True:
            other = p.claims.get(rank)
            if other is None:
                peer = p.peers.get(rank)
                if peer is not None and not peer.lost:
                    if peer.agent == agent:
                        raise self._yield(f"rank {rank} is already connected", "connected")
                    raise HandshakeError(f"rank {rank} is connected to another agent ({peer.agent}); "
                                         "it cannot be claimed until that one is gone")
                p.liveness.check_owner(rank, agent)
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
        p.claims[rank] = self
        self.release_preauth()  # authenticated and introduced: no longer a stranger

    def commit(self) -> None:
        if self.superseded or self.rank is None or self.p.claims.get(self.rank) is not self:
            raise self._yield("superseded by the connection rank "
                              f"{min(self.rank or 0, self.p.host.rank)} started", "superseded")
        self.peer = self.p.add(self.frame, self.fs, self.sent_slabs)
        self.committed = True

    def finish(self) -> None:
        if self.rank is not None and self.p.claims.get(self.rank) is self:
            del self.p.claims[self.rank]
        self.done.set()
        self.p.notify()


class Peering:
    """The TCP side of one NIXL transport (see the module's docstring).

    ``peers``: the transport's table (read only here). ``my_hello``: our hello frame;
    ``add``: adds the peer when its handshake commits (given its hello frame, its stream
    and our receive slabs it learned); ``drop``: forgets a peer again. ``secret``: what both ends prove (``None``: no authentication).
    """

    def __init__(self, peers: Mapping[int, Peer], *, my_hello: Callable[[], Frame],
                 add: Callable[[Frame, FrameStream, set[int]], Peer], drop: Callable[[int], None],
                 admission: Admission, liveness: Liveness, secret: bytes | None,
                 handshake_timeout: float, listen_host: str, port: int,
                 advertise: str | None) -> None:
        self.peers, self.my_hello, self.add, self.drop = peers, my_hello, add, drop
        self.admission, self.liveness = admission, liveness
        self.secret = secret
        self.handshake_timeout = handshake_timeout
        self.listen_host, self.port, self.advertise = listen_host, port, advertise
        #: handshakes under way, by the rank they claim
        self.claims: dict[int, _Join] = {}
        self._changed = anyio.Event()
        self.listener: Any = None
        self.bound: tuple[str, int] | None = None
        self._host: TransportHost | None = None
        self._tasks: TaskSpawner | None = None
        self.agent_name = ""

    async def start(self, host: TransportHost, tasks: TaskSpawner, agent_name: str) -> None:
        """Listen, and accept connections in ``tasks`` from now on."""
        self._host, self._tasks, self.agent_name = host, tasks, agent_name
        self.listener = await self._listen()
        sock = self.listener.extra(anyio.abc.SocketAttribute.local_address)
        self.bound = (sock[0], sock[1])
        for listener in getattr(self.listener, "listeners", [self.listener]):
            tasks.start_soon(self._accept_loop, listener)

    async def stop_listening(self) -> None:
        """Close the listener (no new connections; those already made stay)."""
        if self.listener is not None:
            await self.listener.aclose()

    @property
    def host(self) -> TransportHost:
        """The endpoint the transport serves (from :meth:`start` on)."""
        if self._host is None:
            raise InternalError("the NIXL transport is used before start()")
        return self._host

    @property
    def tasks(self) -> TaskSpawner:
        """Where handshakes and watches run: the endpoint's guarded task group."""
        if self._tasks is None:
            raise InternalError("the NIXL transport is used before start()")
        return self._tasks

    def address(self) -> str | None:
        """Where peers dial us (``None`` before :meth:`start`)."""
        if self.bound is None:
            return None
        host = self.advertise or (self.bound[0] if self.bound[0] not in ("0.0.0.0", "::")
                                  else "127.0.0.1")
        return f"{host}:{self.bound[1]}"

    async def _listen(self) -> Any:
        """Bind and listen on ``host:port``; a failure is a :class:`ListenError` naming both,
        with the operating system's error chained."""
        host, port = self.listen_host, self.port
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

    def check(self, frame: Frame) -> None:
        """A peer's hello frame has the transport's fields, and the endpoint accepts its
        hello (:class:`HandshakeError` or a layout error otherwise)."""
        try:
            hello = frame["hello"]
            frame["agent"], frame["meta"], frame["recv_ptr"]
        except (KeyError, TypeError):
            raise HandshakeError("malformed handshake from peer") from None
        self.host.check_hello(hello)

    def notify(self) -> None:
        """The peer table changed (a handshake ended, a peer was dropped)."""
        self._changed.set()
        self._changed = anyio.Event()

    def _joined(self, join: _Join) -> Peer:
        peer = join.peer
        if peer is None:
            raise InternalError("a handshake finished without adding its peer")
        peer.joined = True
        self.host.peer_joined(peer.rank, peer.hello)
        return peer

    async def _await_peer(self, rank: int | None, agent: str | None, deadline: float,
                          address: str) -> Peer:
        """After yielding a connect race: wait for the surviving connection."""
        while True:
            p = self.peers.get(rank) if rank is not None else None
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
        ``handshake_timeout``), retrying while the peer turns us away as busy."""
        limit = self.handshake_timeout if timeout is None else float(
            check_number("timeout", timeout, strictly_positive=True))
        host, port = parse_address(address)
        deadline = anyio.current_time() + limit
        pause = 0.01
        turned_away: HandshakeError | None = None  # the last "busy" refusal, if any

        def stayed_busy(exc: HandshakeError) -> HandshakeError:
            return HandshakeError(
                f"the peer at {address} stayed busy for the whole {limit:g} s connect "
                f"timeout ({exc}): it may be under a connection flood; try again later, "
                "or raise its max_unauthenticated", reason=BUSY)
        while True:
            try:
                return await self._connect_once(address, host, port, deadline)
            except HandshakeError as exc:
                if exc.reason == "timeout" and turned_away is not None:
                    # the deadline fell in a retry: what the peer said was "busy"
                    raise stayed_busy(turned_away) from exc
                if exc.reason != BUSY:
                    raise
                turned_away = exc
                left = deadline - anyio.current_time()
                if left <= pause:
                    raise stayed_busy(exc) from exc
                log.debug("%s is busy, trying again: %s", address, exc)
                await anyio.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, 0.2)

    async def _connect_once(self, address: str, host: str, port: int,
                            deadline: float) -> tuple[int, dict[str, Any]]:
        tasks = self.tasks
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                stream = await anyio.connect_tcp(host, port)
        except TimeoutError as exc:
            raise HandshakeError(f"cannot reach a peer at {address}: no connection in time",
                                 reason="timeout") from exc
        except (OSError, ValueError) as exc:  # ValueError: a host name the resolver refuses
            raise HandshakeError(f"cannot reach a peer at {address}: {exc}",
                                 reason="unreachable") from exc
        keepalive(stream)
        fs = FrameStream(stream)
        join = _Join(self, fs, initiator=True)
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                await exchange(fs, initiator=True, party=join, secret=self.secret)
        except BaseException as exc:
            if join.peer is not None:  # added but never joined: forget it again
                self.drop(join.peer.rank)
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
        tasks.start_soon(self.liveness.watch, peer)
        return peer.rank, peer.hello

    async def _accept_loop(self, listener: Any) -> None:
        tasks = self.tasks
        while True:
            try:
                stream = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of file descriptors (a flood), or the like: go on
                log.warning("accepting a connection failed: %s", exc)
                await anyio.sleep(0.05)
                continue
            who = remote_host(stream)
            full = self.admission.busy(who)
            if full is not None:  # a flood: say so, and hang up at once
                await self.admission.turn_away(stream, full)
                continue
            self.admission.take(who)
            tasks.start_soon(self._accept, stream, who)

    async def _accept(self, stream: SocketStream, who: str) -> None:
        fs = FrameStream(stream)
        join = _Join(self, fs, initiator=False)
        join.preauth = who  # taken by _accept_loop; released at the hello, or below
        admission = self.admission
        try:
            try:
                with anyio.fail_after(self.handshake_timeout):
                    await exchange(fs, initiator=False, party=join, secret=self.secret,
                                   first_timeout=admission.first_frame_timeout,
                                   step_timeout=admission.step_timeout)
            finally:
                join.release_preauth()
        except Exception as exc:
            if isinstance(exc, PeerYielded):
                log.debug("handshake from a peer gave way to another connection: %s", exc)
            elif "authentication failed" in str(exc):
                log.warning("refused a peer from %s: %s", remote_address(stream), exc)
            else:
                log.info("handshake from %s failed: %r", remote_address(stream), exc)
            if join.peer is not None:
                self.drop(join.peer.rank)
            join.finish()
            await fs.aclose()
            return
        keepalive(stream)
        peer = self._joined(join)
        join.finish()
        await self.liveness.watch(peer)

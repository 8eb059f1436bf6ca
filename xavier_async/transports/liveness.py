"""Whether a NIXL peer is still there.

After the handshake, each peer's TCP stream stays open and carries nothing: its end is
the liveness signal.

* :func:`keepalive`: TCP keepalive on the stream, so a host that vanishes without
  closing its socket (power loss, partition) is noticed within seconds.
* :meth:`Liveness.watch`: one task per peer holds its stream; when the stream ends, the
  peer is lost (:class:`PeerLostError` to everything that waits on it).
* **Rank grace** (:meth:`Liveness.peer_gone`, :meth:`Liveness.check_owner`): a peer lost
  without a clean close may still be alive behind a partition, holding our receive
  slab's address, so its rank stays reserved for its agent for ``rank_grace`` seconds.
* **Stall sweep** (:meth:`Liveness.sweep`): after the process was stalled (SIGSTOP, swap,
  a long GC), every peer's stream is peeked before anything is served, so a peer that
  hung up meanwhile is lost first.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Protocol

import anyio
from anyio.abc import SocketStream

from .._checks import check_number
from ..errors import HandshakeError, PeerLostError
from .handshake import FrameStream

log = logging.getLogger("xavier_async.nixl")


def keepalive(stream: SocketStream, idle: int = 5, interval: int = 2, count: int = 3) -> None:
    """TCP keepalive on a peer's stream: a host that vanishes without closing its socket
    (power loss, partition) is noticed in about idle + interval * count seconds."""
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    except (OSError, anyio.TypedAttributeLookupError):
        log.debug("could not enable TCP keepalive", exc_info=True)


class Link(Protocol):
    """A connected peer, as liveness sees it."""

    rank: int
    #: its NIXL agent's name
    agent: str
    #: its TCP stream (the handshake's)
    fs: FrameStream
    lost: bool


class Liveness:
    """The liveness of one transport's peers.

    ``peers``: the transport's table of connected peers (read only here). ``report``:
    tells the endpoint a peer is lost (its host's ``peer_lost``). ``closed``: whether the
    transport is closing (then nothing is reported). ``rank_grace``, ``stall_check``:
    seconds, validated here (:class:`InvalidRequestError` naming them)."""

    def __init__(self, peers: Mapping[int, Link], report: Callable[[int, PeerLostError], None],
                 closed: Callable[[], bool], *, rank_grace: float = 30.0,
                 stall_check: float = 0.25) -> None:
        #: how long a rank lost without a clean close stays reserved for its agent
        self.rank_grace = check_number("rank_grace", rank_grace)
        #: a poll loop that finds itself this many seconds after its previous pass (the
        #: process was stalled: SIGSTOP, swap, a long GC) calls :meth:`sweep` before it
        #: serves anything; 0 turns the check off
        self.stall_check = check_number("stall_check", stall_check)
        self._peers, self._report, self._closed = peers, report, closed
        #: ranks lost without a clean close: rank -> (agent, reserved until)
        self.gone: dict[int, tuple[str, float]] = {}
        #: stalls noticed by the poll loop (each followed by a sweep)
        self.stalls_seen = 0

    async def watch(self, peer: Link) -> None:
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
            if current is peer and not peer.lost and not self._closed():
                self.peer_gone(peer, confirmed)
                self._report(peer.rank, PeerLostError(f"rank {peer.rank} {reason}"))

    def peer_gone(self, peer: Link, confirmed: bool) -> None:
        """Mark ``peer`` lost. Unless its side closed the connection (``confirmed``), its
        rank stays reserved for its agent for ``rank_grace`` seconds: the old process may
        still be alive behind a partition and still hold our receive slab's address."""
        peer.lost = True
        if confirmed:
            self.gone.pop(peer.rank, None)
        else:
            self.gone[peer.rank] = (peer.agent, anyio.current_time() + self.rank_grace)

    def check_owner(self, rank: int, agent: str) -> None:
        """Refuse (:class:`HandshakeError`) ``agent`` claiming ``rank`` while the rank is
        reserved for the agent that lost it without a clean close."""
        gone = self.gone.get(rank)
        if gone is None:
            return
        old, until = gone
        left = until - anyio.current_time()
        if old == agent or left <= 0:
            del self.gone[rank]
            return
        raise HandshakeError(
            f"rank {rank} was lost {self.rank_grace - left:.1f} s ago without a clean close and "
            f"may still be alive; another agent can claim it in {left:.1f} s, or at once after "
            f"the old one ({old}) reconnects and closes")

    def sweep(self) -> None:
        """After a stall: a peer whose control stream has ended is lost now, before any
        request of its is served (its receiver may have given up on us meanwhile)."""
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
                self.peer_gone(peer, True)
                self._report(peer.rank, PeerLostError(
                    f"rank {peer.rank} closed the connection (noticed after a stall)"))

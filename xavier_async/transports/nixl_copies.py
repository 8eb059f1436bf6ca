"""The NIXL transport's copies: transfer handles, posting, completion.

* Handles: a view *mapping* (:class:`_Mapping`) is the NIXL WRITE handle of one view of
  a send slab to the peer's receive slab, re-posted for every copy, plus a small LRU of
  exact-length handles for trimmed copies (``trim_handles`` of them). A write straight
  from a registered pool (a snapshot tier, :meth:`Copies.post_regions`) has its handle
  in a per-peer LRU (``peer.direct``) keyed by its regions (and whether it notifies).
* Posting: :meth:`Copies.start` posts a handle and spins briefly (``spin``); a copy not
  terminal by then is *in flight* (``in_flight``) and returns a :class:`_Pending` that
  :meth:`Copies.wait` polls to a terminal state or ``write_timeout``. A host copy larger
  than ``piece_bytes`` goes in pieces (:class:`_Pieces`): UCX copies host memory inside
  the post, so one post of 12 MiB held the event loop ~2.5 ms; a piece at a time, small
  copies go out between them.
* Notifications: NIXL keeps a handle's last notification and sends it again when the
  handle is re-posted with an empty one (NIXL 1.5.1, measured). So a handle that carries
  notifications is never posted without one: a copy without a notification (a bare copy,
  or a piece before the last) goes through handles of its own (``silent``, and pieces
  keyed by whether they notify).
* Bulk: a host WRITE of at least ``bulk.min_bytes`` goes through the endpoint's second
  agent, posted and polled on a thread of its own (:mod:`.nixl_bulk`); its handles are
  that agent's (``_Mapping.bulk``, and ``owner`` says which agent releases them).
* Release: a handle is never released while NIXL may still read through it: one whose
  copy is in flight is released when the copy is terminal (``release_later``); one given
  up on at ``write_timeout`` is *stuck* until the poller (:meth:`Copies.check_stuck`)
  sees it terminal.

The transport (:mod:`.nixl`) owns the agent, the registrations and the peer table; it
binds the agent here at start and delegates each copy with one call. The peers' caches
(``handles``, ``direct``) live on its peer records, which this module sees as
:class:`Target`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import anyio

from ..errors import InternalError, InvalidRequestError, PeerLostError, TransferError
from .base import Regions
from .nixl_bulk import BulkLane, _Bulk

if TYPE_CHECKING:
    from .nixl_agent import NixlAgent

log = logging.getLogger("xavier_async.nixl")
K = TypeVar("K")

#: the default of ``NixlTransport(piece_bytes=...)``: off. On the 2-core machine pieces of
#: 1-2 MiB did not lower the small-load p99 and cut the 12 MiB stream from 0.34-0.40 to
#: 0.27-0.32 of raw (docs/benchmarks.md); opt in where a host measures a gain.
PIECE_BYTES = 0


class _Mapping:
    """Transfer handles for one (peer, send slab, view, peer's receive slab): the
    view-length handle plus a bounded cache of exact-length handles for trimmed copies;
    ``silent``: the same for copies posted without a notification (see the module)."""

    __slots__ = ("view_bytes", "local_ptr", "by_len", "silent", "slab", "pieces", "bulk")

    def __init__(self, view_bytes: int, local_ptr: int, handle: Any, slab: int = 0) -> None:
        self.view_bytes = view_bytes
        self.local_ptr = local_ptr
        self.slab = slab
        self.by_len: OrderedDict[int, Any] = OrderedDict({view_bytes: handle})
        self.silent: OrderedDict[int, Any] = OrderedDict()
        #: (offset, bytes, notifies) -> the handle of one piece of a large copy
        #: (:class:`_Pieces`); only a last piece notifies
        self.pieces: OrderedDict[tuple[int, int, bool], Any] = OrderedDict()
        #: (bytes, notifies) -> a handle of the bulk agent (:mod:`.nixl_bulk`)
        self.bulk: OrderedDict[tuple[int, bool], Any] = OrderedDict()


class Target(Protocol):
    """A connected peer, as the copy path sees it (the transport's peer record)."""

    rank: int
    #: its NIXL agent's name
    agent: str
    #: its receive slabs we may write: index -> address
    recv_ptrs: dict[int, int]
    recv_dev: int
    mem: str
    lost: bool
    #: (our send slab, view bytes, its receive slab) -> the view's handles
    handles: dict[tuple[int, int, int], _Mapping]
    #: (its receive slab, regions, notifies) -> handle, least recently used first
    direct: OrderedDict[tuple[int, Regions, bool], Any]


class _Pending:
    __slots__ = ("peer", "handle", "nbytes", "deadline")

    def __init__(self, peer: Target, handle: Any, nbytes: int, deadline: float) -> None:
        self.peer, self.handle, self.nbytes, self.deadline = peer, handle, nbytes, deadline


class _Pieces:
    """A large WRITE cut into pieces (``Copies.piece_bytes``), posted one after another
    from :meth:`Copies.wait`, one per pass through the event loop, so that small copies
    posted meanwhile go out between them. Piece ``k + 1`` is posted once piece ``k`` is
    DONE, and only the last carries the notification: when it lands, every byte has."""

    __slots__ = ("peer", "handles", "notify", "nbytes", "deadline", "index")

    def __init__(self, peer: Target, handles: list[Any], notify: bytes, nbytes: int,
                 deadline: float) -> None:
        self.peer, self.handles, self.notify = peer, handles, notify
        self.nbytes, self.deadline = nbytes, deadline
        #: the piece posted last
        self.index = 0

    @property
    def handle(self) -> Any:
        """The handle of the piece posted last."""
        return self.handles[self.index]


class Copies:
    """The copy path of one NIXL transport: its handle caches, post and wait, and the
    handles that must outlive their copies. ``pools`` is the transport's list of
    registered pools (read here, appended to by the transport)."""

    def __init__(self, pools: list[tuple[int, int, str, int]], *, write_timeout: float,
                 spin: float, trim_handles: int, piece_bytes: int = 0,
                 bulk: BulkLane | None = None) -> None:
        self.write_timeout = write_timeout
        self.spin = spin
        self.trim_handles = trim_handles
        #: host-to-host copies larger than this are posted in pieces (0: never)
        self.piece_bytes = piece_bytes
        #: copies posted in pieces, and pieces posted, so far
        self.pieced = self.pieces_posted = 0
        #: registered pools (snapshot tiers): (first address, end, memory type, device)
        self.pools = pools
        self.agent: NixlAgent | None = None
        #: large host WRITEs through a second agent on a thread of its own
        self.bulk = bulk if bulk is not None else BulkLane(0)
        #: handle id -> the agent that made it, for handles not the main agent's
        self.owner: dict[int, NixlAgent] = {}
        #: our memory's NIXL type and device (the slabs')
        self.mem, self.dev = "DRAM", 0
        #: when a copy or a message was last posted (the poller stays hot after it)
        self.last_activity = 0.0
        #: ids of transfer handles with a copy posted and not yet terminal -> rank, and
        #: handles whose release waits for that
        self.in_flight: dict[int, int] = {}
        self.release_later: dict[int, Any] = {}
        #: copies given up on (timed out while still posted): handle id -> (rank, handle)
        self.stuck: dict[int, tuple[int, Any]] = {}

    def bind(self, agent: NixlAgent, mem: str, dev: int) -> None:
        """The transport started: its agent and its memory's type and device."""
        self.agent, self.mem, self.dev = agent, mem, dev

    @property
    def _agent(self) -> NixlAgent:
        if self.agent is None:
            raise InternalError("the NIXL transport is used before start()")
        return self.agent

    # -- handles -------------------------------------------------------------------------
    def handle(self, peer: Target, local_ptr: int, nbytes: int, slab: int = 0,
               offset: int = 0, agent: NixlAgent | None = None) -> Any:
        """A new WRITE handle: ``nbytes`` at ``local_ptr`` to ``offset`` bytes into
        ``peer``'s receive slab ``slab`` (made by ``agent``, by default the main one)."""
        if agent is None:
            agent = self._agent
        return agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(local_ptr, nbytes, self.dev)], self.mem),
            agent.get_xfer_descs([(peer.recv_ptrs[slab] + offset, nbytes, peer.recv_dev)], peer.mem),
            peer.agent)

    def _piece_handles(self, p: Target, m: _Mapping, nbytes: int, notifies: bool) -> list[Any]:
        """The handles of the pieces of a copy of ``nbytes`` through ``m``: whole pieces,
        made once, and a shorter last one (trimmed copies; kept in a small LRU). The last
        piece of a copy that notifies has a handle of its own (see the module)."""
        size, out = self.piece_bytes, []
        for off in range(0, nbytes, size):
            n = min(size, nbytes - off)
            key = (off, n, notifies and off + n == nbytes)
            h = m.pieces.get(key)
            if h is None:
                h = m.pieces[key] = self.handle(p, m.local_ptr + off, n, m.slab, off)
                if n != size:
                    self._evict_one(m.pieces, self.trim_handles + 2 * (m.view_bytes // size),
                                    lambda k: k[1] == size or k == key)
            elif n != size:
                m.pieces.move_to_end(key)
            out.append(h)
        return out

    def _evict_one(self, cache: OrderedDict[K, Any], bound: int, kept: Callable[[K], bool]) -> None:
        """Past ``bound`` handles, release the least recently used one not ``kept``."""
        if len(cache) > bound:
            for old in list(cache):
                if not kept(old):
                    self.release_handle(cache.pop(old))
                    break

    def mapping(self, peer: Target, send: int, local_ptr: int, nbytes: int, slab: int) -> _Mapping:
        """The mapping of a view (``nbytes`` at ``local_ptr`` of send slab ``send``) to
        ``peer``'s receive slab ``slab``, made once per peer."""
        key = (send, nbytes, slab)
        old = peer.handles.get(key)
        if old is not None:
            return old
        m = _Mapping(nbytes, local_ptr, self.handle(peer, local_ptr, nbytes, slab), slab)
        peer.handles[key] = m
        return m

    def release_handle(self, h: Any) -> None:
        if id(h) in self.in_flight:  # still posted: released when its copy is terminal
            self.release_later[id(h)] = h
            return
        if id(h) in self.stuck:  # timed out but maybe still posted: check_stuck releases it
            return
        try:
            self.owner.pop(id(h), self._agent).release_xfer_handle(h)
        except Exception:
            log.debug("release_xfer_handle failed", exc_info=True)

    def release_peer(self, peer: Target) -> None:
        """Release every handle cached for ``peer`` (those still posted once terminal)."""
        for m in peer.handles.values():
            for h in [*m.by_len.values(), *m.silent.values(), *m.pieces.values(),
                      *m.bulk.values()]:
                self.release_handle(h)
        peer.handles.clear()
        for h in peer.direct.values():
            self.release_handle(h)
        peer.direct.clear()

    def _pool_of(self, regions: Regions) -> tuple[str, int]:
        """(memory type, device) of the one registered pool every region lies in."""
        for lo, hi, mem, dev in self.pools:
            if all(lo <= a and a + n <= hi for a, _, n in regions):
                return mem, dev
        raise InvalidRequestError("a region to write is not inside one registered pool")

    # -- posting -------------------------------------------------------------------------
    def post(self, p: Target, mapping: object, nbytes: int, notify: bytes | None) -> object | None:
        if not isinstance(mapping, _Mapping):
            raise InvalidRequestError(f"not a mapping of this transport: {mapping!r}")
        m = mapping
        if self.bulk.wants(nbytes, self.mem, p.mem):
            return self._post_bulk(p, m, nbytes, notify or b"")
        if self.piece_bytes and nbytes > self.piece_bytes and self.mem == p.mem == "DRAM":
            handles = self._piece_handles(p, m, nbytes, bool(notify))
            return self._start_pieces(p, handles, nbytes, notify or b"")
        cache = m.by_len if notify else m.silent
        h = cache.get(nbytes)
        if h is None:  # a new length (or the first silent copy): a handle, kept in a small LRU
            h = self.handle(p, m.local_ptr, nbytes, m.slab)
            cache[nbytes] = h
            self._evict_one(cache, self.trim_handles + (m.view_bytes in cache),
                            lambda n: n in (m.view_bytes, nbytes))
        elif nbytes != m.view_bytes:
            cache.move_to_end(nbytes)
        return self.start(p, h, nbytes, notify)

    def _post_bulk(self, p: Target, m: _Mapping, nbytes: int, notify: bytes) -> _Bulk:
        """Hand a large host WRITE to the bulk thread (:mod:`.nixl_bulk`) through a handle
        of the bulk agent's, one per (length, notifies), kept in a small LRU."""
        key = (nbytes, bool(notify))
        h = m.bulk.get(key)
        if h is None:
            agent = self.bulk.agent
            if agent is None:
                raise InternalError("a bulk WRITE without a bulk agent")
            h = m.bulk[key] = self.handle(p, m.local_ptr, nbytes, m.slab, agent=agent)
            self.owner[id(h)] = agent
            self._evict_one(m.bulk, self.trim_handles + 2,
                            lambda k: k in ((m.view_bytes, True), (m.view_bytes, False), key))
        else:
            m.bulk.move_to_end(key)
        self.last_activity = time.monotonic()
        self.in_flight[id(h)] = p.rank
        try:
            return self.bulk.submit(p, h, nbytes, notify, time.monotonic() + self.write_timeout)
        except BaseException:
            self.in_flight.pop(id(h), None)
            raise

    def post_regions(self, p: Target, regions: Regions, slab: int,
                     notify: bytes | None) -> object | None:
        if slab not in p.recv_ptrs:
            raise InvalidRequestError(f"rank {p.rank} has not shared a receive slab {slab}")
        key = (slab, regions, bool(notify))
        h = p.direct.get(key)
        if h is None:
            mem, dev = self._pool_of(regions)
            base = p.recv_ptrs[slab]
            agent = self._agent
            h = agent.initialize_xfer(
                "WRITE", agent.get_xfer_descs([(a, n, dev) for a, _, n in regions], mem),
                agent.get_xfer_descs([(base + off, n, p.recv_dev) for _, off, n in regions], p.mem),
                p.agent)
            p.direct[key] = h
            if len(p.direct) > self.trim_handles:
                self.release_handle(p.direct.popitem(last=False)[1])
        else:
            p.direct.move_to_end(key)
        return self.start(p, h, sum(n for _, _, n in regions), notify)

    def _transfer(self, h: Any, notify: bytes) -> str:
        """Post ``h`` and spin briefly; NIXL's state after it. A small copy completes in
        ~10-20 us, far less than a trip through the event loop. Spinning also drives
        UCX's progress: a copy that does not finish inside this call sends its
        notification only from a later check_xfer_state, which a busy event loop makes
        late. (Skipping the spin for copies posted under load and for large copies was
        measured on the H200 pair, same loan: 20% fewer small loads/s with two endpoints
        loading from each other.)"""
        agent = self._agent
        self.last_activity = time.monotonic()
        state = agent.transfer(h, notify)
        until = time.perf_counter() + self.spin
        while state == "PROC" and time.perf_counter() < until:
            state = agent.check_xfer_state(h)
        return state

    def start(self, p: Target, h: Any, nbytes: int, notify: bytes | None) -> object | None:
        now = time.monotonic()
        state = self._transfer(h, notify or b"")
        if state == "DONE":
            return None
        if state != "PROC":
            raise TransferError(f"NIXL reported {state} for a copy of {nbytes} B to rank {p.rank}")
        self.in_flight[id(h)] = p.rank
        return _Pending(p, h, nbytes, now + self.write_timeout)

    def _start_pieces(self, p: Target, handles: list[Any], nbytes: int, notify: bytes) -> _Pieces:
        """Post the first piece of a copy in pieces (:class:`_Pieces`); :meth:`wait`
        posts the others."""
        w = _Pieces(p, handles, notify, nbytes, time.monotonic() + self.write_timeout)
        self.pieced += 1
        self._post_piece(w)
        return w

    def _post_piece(self, w: _Pieces) -> None:
        """Post piece ``w.index`` (the notification goes with the last one)."""
        last = w.index == len(w.handles) - 1
        self.pieces_posted += 1
        state = self._transfer(w.handle, w.notify if last else b"")
        if state == "PROC":
            self.in_flight[id(w.handle)] = w.peer.rank
        elif state != "DONE":
            raise TransferError(f"NIXL reported {state} for piece {w.index} of a copy of "
                                f"{w.nbytes} B to rank {w.peer.rank}")

    # -- completion ----------------------------------------------------------------------
    async def wait(self, pending: object) -> None:
        if isinstance(pending, _Bulk):
            return await self._wait_bulk(pending)
        if isinstance(pending, _Pieces):
            return await self._wait_pieces(pending)
        if not isinstance(pending, _Pending):
            raise InvalidRequestError(f"not a pending copy of this transport: {pending!r}")
        w = pending
        agent, checkpoint = self._agent, anyio.lowlevel.checkpoint
        stuck = False
        try:
            while True:
                await checkpoint()
                state = agent.check_xfer_state(w.handle)
                if state == "DONE":  # the bytes landed, whether or not the peer is still here
                    return
                if state != "PROC":
                    raise self._failure(state, w.peer, w.nbytes)
                if time.monotonic() > w.deadline:
                    stuck = True
                    raise self._late(w.peer)
        finally:
            self._settle(w.peer, w.handle, stuck)

    async def _wait_pieces(self, w: _Pieces) -> None:
        """Poll each posted piece to DONE and post the next, one per pass through the
        event loop; a peer lost between pieces gets no more of them."""
        agent, checkpoint = self._agent, anyio.lowlevel.checkpoint
        stuck = False
        try:
            while True:
                await checkpoint()
                if id(w.handle) in self.in_flight:
                    state = agent.check_xfer_state(w.handle)
                    if state == "PROC":
                        if time.monotonic() > w.deadline:
                            stuck = True
                            raise self._late(w.peer)
                        continue
                    self._settle(w.peer, w.handle, False)
                    if state != "DONE":
                        raise self._failure(state, w.peer, w.nbytes)
                if w.index == len(w.handles) - 1:
                    return
                if w.peer.lost:
                    raise PeerLostError(f"rank {w.peer.rank} went away during a copy")
                w.index += 1
                self._post_piece(w)
        finally:
            if id(w.handle) in self.in_flight or stuck:
                self._settle(w.peer, w.handle, stuck)

    async def _wait_bulk(self, w: _Bulk) -> None:
        """Wait for the bulk thread's job (re-entrant after a native cancellation: the
        handle is settled only once the job has ended)."""
        peer = cast(Target, w.peer)  # the peer record post() handed over
        try:
            state = await self.bulk.ended(w)
        except Exception as exc:  # NIXL refused the post: nothing is in flight
            self._settle(peer, w.handle, False)
            raise self._failure(f"an error ({exc!r})", peer, w.nbytes) from exc
        self._settle(peer, w.handle, state == "PROC")
        if state == "PROC":
            if peer.lost:
                raise PeerLostError(f"rank {peer.rank} went away during a copy")
            raise self._late(peer)
        if state != "DONE":
            raise self._failure(state, peer, w.nbytes)

    def _failure(self, state: str, peer: Target, nbytes: int) -> Exception:
        if peer.lost:
            return PeerLostError(f"rank {peer.rank} went away during a copy")
        return TransferError(f"NIXL reported {state} for a copy of {nbytes} B to rank {peer.rank}")

    def _late(self, peer: Target) -> TransferError:
        return TransferError(f"copy to rank {peer.rank} did not finish in {self.write_timeout} s")

    def _settle(self, peer: Target, h: Any, stuck: bool) -> None:
        """A copy through ``h`` is no longer waited for: release the handle if it was
        released meanwhile, or (given up on while posted) leave it to the poller."""
        key = id(h)
        self.in_flight.pop(key, None)
        late = self.release_later.pop(key, None)
        if stuck:  # may still land: watched by the poll loop, released when terminal
            self.stuck[key] = (peer.rank, late if late is not None else h)
        elif late is not None:
            self.release_handle(late)

    def unsettled(self) -> set[int]:
        return set(self.in_flight.values()) | {rank for rank, _ in self.stuck.values()}

    def check_stuck(self) -> None:
        """Release the handles of stuck copies that NIXL now reports terminal (the poller
        calls this while any are stuck)."""
        for key, (rank, h) in list(self.stuck.items()):
            try:
                state = self.owner.get(id(h), self._agent).check_xfer_state(h)
            except Exception:
                state = "ERR"
            if state != "PROC":
                del self.stuck[key]
                self.release_handle(h)

    def close(self) -> None:
        """The transport closes: release the stuck copies' handles too."""
        if self.agent is None:
            return
        stuck = list(self.stuck.values())
        self.stuck.clear()
        for _, h in stuck:
            self.release_handle(h)

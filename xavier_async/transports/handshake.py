"""The NIXL transport's TCP handshake: length-prefixed JSON frames and one hello exchange.

Both ends run the same :func:`exchange`; only the order differs (the side that dialled,
the *initiator*, speaks first in every phase). Phases, each one frame per side:

1. ``hello``: the full hello (endpoint hello, NIXL agent metadata, receive-slab address).
   The acceptor checks the initiator's before it answers with its own.
2. ``ok``: each side *commits* (adds the peer) right before it says ok: the initiator
   after checking the acceptor's hello, the acceptor after the initiator's ok.

A side that refuses sends ``{"error": ..., "kind": ...}`` instead of its frame and raises;
a side that receives a refusal raises it as :class:`HandshakeError` (or
:class:`LayoutMismatchError`). Frames are JSON, never pickle.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from ..errors import HandshakeError, LayoutMismatchError, XavierError

_HEADER = struct.Struct("!I")
#: the largest hello frame accepted (agent metadata and layout are a few KiB)
MAX_FRAME = 1 << 20

Frame = dict[str, Any]


class PeerYielded(HandshakeError):
    """This connection gave way to another one with the same peer (a connect race, or
    the peer is already connected): the caller waits for that one instead."""

    def __init__(self, message: str, kind: str, rank: int | None = None, agent: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        #: who to wait for: the rank and agent of the side that raised it (sent with the
        #: refusal, so a connector refused before it saw the peer's hello knows them)
        self.rank, self.agent = rank, agent


#: refusal kinds that mean "use the other connection", not "failed"
YIELD_KINDS = ("connected", "superseded")


def refusal(exc: XavierError) -> Frame:
    """The frame that tells the peer why we refuse."""
    if isinstance(exc, PeerYielded):
        return {"error": str(exc), "kind": exc.kind, "rank": exc.rank, "agent": exc.agent}
    else:
        kind = "layout" if isinstance(exc, LayoutMismatchError) else "handshake"
    return {"error": str(exc), "kind": kind}


def raise_refusal(frame: Frame) -> None:
    """Raise the error a peer's refusal frame stands for."""
    kind, text = frame.get("kind"), str(frame.get("error"))
    if kind in YIELD_KINDS:
        rank, agent = frame.get("rank"), frame.get("agent")
        raise PeerYielded(f"peer: {text}", str(kind), rank if type(rank) is int else None,
                          agent if isinstance(agent, str) else None)
    cls = LayoutMismatchError if kind == "layout" else HandshakeError
    raise cls(f"peer refused the handshake: {text}")


class FrameStream:
    """Length-prefixed JSON objects over a byte stream, read with ``receive_exactly``.

    After the handshake the same :attr:`reader` keeps reading the stream (bytes already
    buffered are not lost)."""

    def __init__(self, stream: ByteStream, max_frame: int = MAX_FRAME) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.max_frame = max_frame

    async def send(self, obj: Frame) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        await self.stream.send(_HEADER.pack(len(data)) + data)

    async def receive(self) -> Frame:
        (n,) = _HEADER.unpack(await self.reader.receive_exactly(_HEADER.size))
        if n > self.max_frame:
            raise HandshakeError(f"handshake frame too large ({n} B > {self.max_frame} B): "
                                 "not an xavier_async peer?")
        try:
            obj = json.loads(await self.reader.receive_exactly(n))
        except (ValueError, UnicodeDecodeError):
            raise HandshakeError("malformed handshake frame (not JSON)") from None
        if not isinstance(obj, dict):
            raise HandshakeError("malformed handshake frame (not a JSON object)")
        return obj

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


class Party(Protocol):
    """One side of one handshake (the transport's per-connection state)."""

    def hello(self) -> Frame:
        """Our hello frame (sent only when the phases before it passed)."""

    async def check_hello(self, frame: Frame) -> None:
        """Validate the peer's hello and claim its rank; raise a :class:`XavierError`."""

    def commit(self) -> None:
        """Add the peer (called right before we say ok)."""


async def _refuse(fs: FrameStream, exc: XavierError) -> None:
    try:
        await fs.send(refusal(exc))
    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


async def swap(fs: FrameStream, initiator: bool, mine: Callable[[], Frame],
               check: Callable[[Frame], Awaitable[None]]) -> Frame:
    """One phase: the initiator sends then checks the answer; the acceptor checks then
    answers. A check (or building our frame) that raises sends a refusal first."""

    async def receive_checked() -> Frame:
        try:
            theirs = await fs.receive()
        except HandshakeError as exc:  # malformed or oversized: say so, then hang up
            await _refuse(fs, exc)
            raise
        if "error" in theirs:
            raise_refusal(theirs)
        try:
            await check(theirs)
        except XavierError as exc:
            await _refuse(fs, exc)
            raise
        return theirs

    async def send_mine() -> None:
        try:
            frame = mine()
        except XavierError as exc:
            await _refuse(fs, exc)
            raise
        await fs.send(frame)

    if initiator:
        await send_mine()
        return await receive_checked()
    theirs = await receive_checked()
    await send_mine()
    return theirs


async def _check_ok(frame: Frame) -> None:
    if frame.get("ok") is not True:
        raise HandshakeError("malformed handshake frame (expected ok)")


async def exchange(fs: FrameStream, *, initiator: bool, party: Party) -> Frame:
    """Run the whole handshake on ``fs``; return the peer's hello frame."""
    theirs = await swap(fs, initiator, party.hello, party.check_hello)

    def ok() -> Frame:
        party.commit()
        return {"ok": True}

    await swap(fs, initiator, ok, _check_ok)
    return theirs

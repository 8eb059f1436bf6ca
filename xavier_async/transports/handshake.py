"""The NIXL transport's TCP handshake: length-prefixed JSON frames and one hello exchange.

Both ends run the same :func:`exchange`; only the order differs (the side that dialled,
the *initiator*, speaks first in every phase). Phases, each one frame per side:

0. ``greet``: the handshake version, a random 32-byte nonce and whether this side holds a
   secret. Frames are at most :data:`MAX_PREAUTH_FRAME` bytes until both sides proved
   themselves. A side with a secret refuses a side without one, and the other way round.
   ``proof`` (only with a secret): ``HMAC-SHA256(secret, role || SHA-256(transcript))``,
   the transcript being every frame sent and received so far (so both nonces); the
   initiator proves first, the acceptor checks (``hmac.compare_digest``) and only then
   proves itself. Nothing about the endpoint (agent metadata, slab address, layout, rank)
   is sent before this phase passed on both ends.
1. ``hello``: the full hello (endpoint hello, NIXL agent metadata, receive-slab address).
   The acceptor checks the initiator's before it answers with its own.
2. ``ok``: each side *commits* (adds the peer) right before it says ok: the initiator
   after checking the acceptor's hello, the acceptor after the initiator's ok.

A side that refuses sends ``{"error": ..., "kind": ...}`` instead of its frame and raises;
a side that receives a refusal raises it as :class:`HandshakeError` (``reason``
``"refused"``) or :class:`LayoutMismatchError`. A listener at its cap of pending
handshakes sends the refusal kind ``"busy"`` before reading anything, and closes; the
connecting side raises it with ``reason="busy"`` (transient: the transport retries it).

Deadlines on the acceptor until the peer's hello passed: ``first_timeout`` for the first
frame, ``step_timeout`` for each later one (so a stranger that greets and falls silent
is dropped after ``step_timeout``). Frames are JSON, never pickle.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
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
#: the largest frame accepted from a side that has not proved itself yet
MAX_PREAUTH_FRAME = 1024
#: the handshake's own version (the endpoint's protocol version is checked in the hello)
WIRE_VERSION = "xavier-async-handshake/2"

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


#: the refusal kind of a connection turned away because too many handshakes were pending:
#: transient, the connecting side retries it (:class:`HandshakeError` ``reason="busy"``)
BUSY = "busy"


def refusal(exc: XavierError) -> Frame:
    """The frame that tells the peer why we refuse."""
    if isinstance(exc, PeerYielded):
        return {"error": str(exc), "kind": exc.kind, "rank": exc.rank, "agent": exc.agent}
    if isinstance(exc, LayoutMismatchError):
        kind = "layout"
    elif isinstance(exc, HandshakeError) and exc.reason == BUSY:
        kind = BUSY
    else:
        kind = "handshake"
    return {"error": str(exc), "kind": kind}


def busy(message: str) -> HandshakeError:
    """The error a listener sends (as a refusal frame) to a connection it turns away."""
    return HandshakeError(message, reason=BUSY)


def raise_refusal(frame: Frame) -> None:
    """Raise the error a peer's refusal frame stands for: :class:`PeerYielded` for a
    connect race, :class:`HandshakeError` with ``reason`` ``"busy"`` (transient) or
    ``"refused"``, or :class:`LayoutMismatchError`."""
    kind, text = frame.get("kind"), str(frame.get("error"))
    if kind in YIELD_KINDS:
        rank, agent = frame.get("rank"), frame.get("agent")
        raise PeerYielded(f"peer: {text}", str(kind), rank if type(rank) is int else None,
                          agent if isinstance(agent, str) else None)
    if kind == BUSY:
        raise HandshakeError(f"peer is busy and turned the connection away: {text}", reason=BUSY)
    if kind == "layout":
        raise LayoutMismatchError(f"peer refused the handshake: {text}")
    raise HandshakeError(f"peer refused the handshake: {text}", reason="refused")


class FrameStream:
    """Length-prefixed JSON objects over a byte stream, read with ``receive_exactly``.

    After the handshake the same :attr:`reader` keeps reading the stream (bytes already
    buffered are not lost)."""

    def __init__(self, stream: ByteStream, max_frame: int = MAX_FRAME) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.max_frame = max_frame
        #: SHA-256 of every frame sent and received, and its value before the last receive
        self.transcript = hashlib.sha256()
        self.before_last = self.transcript.copy()
        #: which side we are (frames enter the transcript tagged by who sent them)
        self.initiator = True

    async def send(self, obj: Frame) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        self.transcript.update((b"I" if self.initiator else b"A") + _HEADER.pack(len(data)) + data)
        await self.stream.send(_HEADER.pack(len(data)) + data)

    async def receive(self) -> Frame:
        (n,) = _HEADER.unpack(await self.reader.receive_exactly(_HEADER.size))
        if n > self.max_frame:
            raise HandshakeError(f"handshake frame too large ({n} B > {self.max_frame} B): "
                                 "not an xavier_async peer?")
        data = await self.reader.receive_exactly(n)
        self.before_last = self.transcript.copy()
        self.transcript.update((b"A" if self.initiator else b"I") + _HEADER.pack(n) + data)
        try:
            obj = json.loads(data)
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
               check: Callable[[Frame], Awaitable[None]], timeout: float | None = None) -> Frame:
    """One phase: the initiator sends then checks the answer; the acceptor checks then
    answers. A check (or building our frame) that raises sends a refusal first.
    ``timeout``: how long to wait for the peer's frame (``None``: the caller's deadline)."""

    async def receive_checked() -> Frame:
        try:
            if timeout is None:
                theirs = await fs.receive()
            else:
                with anyio.move_on_after(timeout) as scope:
                    theirs = await fs.receive()
                if scope.cancelled_caught:
                    raise HandshakeError(f"no handshake frame within {timeout:g} s", reason="timeout")
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


def _mac(secret: bytes, label: bytes, transcript: Any) -> str:
    return hmac.new(secret, label + transcript.digest(), hashlib.sha256).hexdigest()


def _label(initiator: bool, what: str) -> bytes:
    return f"xavier-async {what} by {'initiator' if initiator else 'acceptor'}".encode()


def _checked_mac(fs: FrameStream, frame: Frame, key: str, secret: bytes, label: bytes, what: str) -> None:
    """The peer's MAC over the transcript as it stood before its frame; constant time."""
    got = frame.get(key)
    want = _mac(secret, label, fs.before_last)
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), want.encode()):
        raise HandshakeError(f"authentication failed ({what}): the peer does not hold the same secret")


async def exchange(fs: FrameStream, *, initiator: bool, party: Party, secret: bytes | None = None,
                   first_timeout: float | None = None, step_timeout: float | None = None) -> Frame:
    """Run the whole handshake on ``fs``; return the peer's hello frame.

    ``secret``: the shared secret both sides must prove (``None``: no authentication; a
    peer that has one refuses us). ``first_timeout``: how long the acceptor waits for the
    peer's first frame; ``step_timeout``: for each of its later frames up to and including
    the hello (the proof, then the hello), so a peer that greets and falls silent is
    dropped after ``step_timeout``, not after the caller's whole handshake deadline. Both
    apply to the acceptor only (the initiator is bounded by its connect timeout)."""
    step = step_timeout if not initiator else None
    fs.initiator = initiator
    fs.max_frame = MAX_PREAUTH_FRAME
    nonce = secrets.token_hex(32)

    async def check_greet(frame: Frame) -> None:
        if frame.get("xa") != WIRE_VERSION:
            raise HandshakeError(f"handshake version mismatch: local {WIRE_VERSION!r}, peer "
                                 f"{frame.get('xa')!r} (another xavier_async version, or not one)")
        n = frame.get("nonce")
        if not isinstance(n, str) or len(n) != 64 or n == nonce:
            raise HandshakeError("malformed handshake frame (nonce)")
        auth = frame.get("auth")
        if secret is not None and auth is not True:
            raise HandshakeError("authentication failed: the peer has no secret, and this endpoint "
                                 "only accepts peers holding its secret")
        if secret is None and auth is not False:
            raise HandshakeError("authentication failed: the peer requires a shared secret and this "
                                 "endpoint has none (pass secret= or set XAVIER_ASYNC_SECRET)")

    await swap(fs, initiator, lambda: {"xa": WIRE_VERSION, "nonce": nonce, "auth": secret is not None},
               check_greet, first_timeout if not initiator else None)
    if secret is not None:
        key = secret

        async def check_proof(frame: Frame) -> None:
            _checked_mac(fs, frame, "proof", key, _label(not initiator, "proof"), "proof")

        await swap(fs, initiator, lambda: {"proof": _mac(key, _label(initiator, "proof"), fs.transcript)},
                   check_proof, step)
    fs.max_frame = MAX_FRAME  # authenticated (or no secret on either side)
    theirs = await swap(fs, initiator, party.hello, party.check_hello, step)

    def ok() -> Frame:
        party.commit()
        if secret is None:
            return {"ok": True}
        return {"ok": True, "mac": _mac(secret, _label(initiator, "ok"), fs.transcript)}

    async def check_ok(frame: Frame) -> None:
        if frame.get("ok") is not True:
            raise HandshakeError("malformed handshake frame (expected ok)")
        if secret is not None:
            _checked_mac(fs, frame, "mac", secret, _label(not initiator, "ok"), "hello transcript")

    await swap(fs, initiator, ok, check_ok)
    return theirs

"""The wire protocol between endpoints and the source's serve decision (pure: no I/O, no
event loop, no transport).

Control messages are frozen dataclasses, each with ``to_wire``/``from_wire``:

* :class:`Load` (receiver -> source): serve batch ``batch`` under request id ``req_id``,
  into the receiver's receive slab number ``slab``, under the pair's ``epoch``;
* :class:`BlockLoad` (receiver -> source): the same for the common batch "these block
  keys in each of these layers" (one segment per layer, every segment the same keys), in a
  fixed binary layout: 64-bit keys and 32-bit layer ids, no per-item Python on either side;
* :class:`Probe` (receiver -> source): are all these keys published? (answered with a
  ``Landed`` of 0 bytes or an ``Error``; nothing is written);
* :class:`Landed` (source -> receiver, carried by the WRITE): the batch's bytes are in the
  receiver's receive slab (with a digest of the payload when the receiver asked for one);
* :class:`Error` (source -> receiver): the source refused or failed the request;
  ``settled`` says whether the source is sure no write of it can still land;
* :class:`Announce` (either way): which block keys the sender now holds or no longer
  holds, for a peer's directory of who holds what (nothing is written; the engine only
  hands it to the application's :class:`~xavier_async.endpoint.PeerWatcher`).

On the wire a message is ``b"XA"``, one tag byte and its body. The hot path's messages
(:class:`BlockLoad`, :class:`Landed`) are fixed-layout binary (``struct``, little-endian);
the others are compact JSON (never pickle: a peer can never make us execute code; byte keys
travel as ``{"b": hex}``). The handshake's
:class:`Hello` is a JSON object the transport carries; :func:`check_hello` validates a
peer's. :class:`RequestTable` correlates replies with the receiver's outstanding
requests. The source's serve decision is :mod:`xavier_async.decision`.

Everything here can be fed arbitrary bytes: malformed input raises :class:`ProtocolError`
(a ``ValueError``) from ``from_wire``/:func:`decode`, or becomes a :class:`Refuse`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, Union

from .errors import (HandshakeError, LayoutMismatchError, PeerLostError,
                     RegistrationError, RemoteError, StaleRequestError, TransferError, XavierError)
from .layout import CacheLayout
from .sizes import SlabSizes

PROTOCOL_VERSION: Final = 4
MAGIC: Final = b"XA"
LOAD_TAG: Final = b"L"
BLOCK_TAG: Final = b"B"
LANDED_TAG: Final = b"D"
ERROR_TAG: Final = b"E"
PROBE_TAG: Final = b"P"
ANNOUNCE_TAG: Final = b"N"
#: the most keys one :class:`Announce` carries (:func:`announce_wires` splits longer lists)
MAX_ANNOUNCE_KEYS: Final = 512


class ProtocolError(ValueError):
    """A control message that is not well formed (dropped by the receiver)."""


_dumps = json.JSONEncoder(separators=(",", ":"), default=lambda o: {"b": o.hex()}).encode


def _hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and "b" in obj:
        return bytes.fromhex(obj["b"])
    return obj


_loads = json.JSONDecoder(object_hook=_hook).decode


def _encode(tag: bytes, body: Any) -> bytes:
    return MAGIC + tag + _dumps(body).encode()


#: BlockLoad's fixed header: request id, epoch, receive slab, verify, layer count, key count
_BLOCK = struct.Struct("<qQIBHI")
_BLOCK_PREFIX = MAGIC + BLOCK_TAG
#: the most keys one BlockLoad names (a batch never holds more blocks than this)
MAX_BLOCK_KEYS: Final = 1 << 20

#: request ids are signed 64-bit, counts and epochs unsigned 64-bit, slab numbers 32-bit
_ID_RANGE = range(-(1 << 63), 1 << 63)
_COUNT_RANGE = range(0, 1 << 64)
_SLAB_RANGE = range(0, 1 << 32)


def _req_id(value: object) -> int:
    if type(value) is not int or value not in _ID_RANGE:
        raise ProtocolError(f"malformed request id {value!r}")
    return value


def _count(value: object, what: str, valid: range = _COUNT_RANGE) -> int:
    if type(value) is not int or value not in valid:
        raise ProtocolError(f"malformed {what} {value!r}")
    return value


@lru_cache(maxsize=256)
def _array(code: str, n: int) -> struct.Struct:
    """The layout of ``n`` little-endian items of ``code`` (made once per length)."""
    return struct.Struct(f"<{n}{code}")


def pack_layers(layers: Sequence[object]) -> bytes | None:
    """Layer ids as :class:`BlockLoad` carries them (32-bit signed ints), or ``None`` if
    one of them is not such an int (that request travels as a JSON :class:`Load`)."""
    for layer in layers:
        if type(layer) is not int or not -(1 << 31) <= layer < 1 << 31:
            return None
    return _array("i", len(layers)).pack(*layers)


def packed_keys(keys: Sequence[object]) -> bytes | None:
    """Block keys as :class:`BlockLoad` carries them (64-bit unsigned ints), or ``None``
    if one of them is not such an int (bool included) or there are too many."""
    if len(keys) > MAX_BLOCK_KEYS:
        return None
    for key in keys:
        if type(key) is not int:
            return None
    try:
        return _array("Q", len(keys)).pack(*keys)
    except struct.error:  # out of range
        return None


# -- messages ------------------------------------------------------------------------------

class Wired(Protocol):
    """A batch as the wire names it (``[[layer, [keys] or 0], ...]``)."""

    def wire(self) -> list[Any]: ...


@dataclass(frozen=True, slots=True)
class Load:
    """Receiver -> source: pack and write one batch. ``batch`` is :meth:`Batch.wire`'s form
    (``[[layer, [keys] or 0], ...]``), checked by :func:`parse_load`, not here, so that a
    malformed batch can still be answered with an :class:`Error` for its request id."""

    req_id: int
    batch: Any
    #: the (receiver, source) pair's epoch: a source refuses requests of an older epoch
    epoch: int = 0
    #: which of the receiver's receive slabs to write into
    slab: int = 0
    #: send a digest of the payload with ``Landed`` (``EndpointConfig(verify=True)``)
    verify: bool = False

    @classmethod
    def of(cls, req_id: int, batch: Wired, epoch: int = 0, slab: int = 0,
           verify: bool = False) -> Load:
        """The request for ``batch`` (anything with a ``wire()`` form: a planned batch, a
        merged group)."""
        return cls(req_id, batch.wire(), epoch, slab, verify)

    def to_wire(self) -> bytes:
        return _encode(LOAD_TAG, [self.req_id, self.batch, self.epoch, self.slab, int(self.verify)])

    @classmethod
    def from_body(cls, body: Any) -> Load:
        if not isinstance(body, list) or len(body) != 5 or body[4] not in (0, 1) \
                or type(body[4]) is not int:
            raise ProtocolError("malformed LOAD body")
        return cls(_req_id(body[0]), body[1], _count(body[2], "epoch"),
                   _count(body[3], "slab", _SLAB_RANGE), bool(body[4]))




@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Receiver -> source, binary: pack and write one batch of every key of ``keys`` in
    each layer of ``layers``, laid out as the planner lays out such a batch (a segment per
    layer, in this order, at aligned offsets; :func:`~xavier_async.planning.segment_offsets`).
    Keys are unsigned 64-bit ints and layer ids signed 32-bit ints; other batches travel as
    a :class:`Load`. The other fields are :class:`Load`'s."""

    req_id: int
    layers: tuple[int, ...]
    keys: tuple[int, ...]
    epoch: int = 0
    slab: int = 0
    verify: bool = False

    def to_wire(self) -> bytes:
        layers = pack_layers(self.layers)
        if layers is None:
            raise ProtocolError(f"layer ids {self.layers[:4]!r} do not fit a BlockLoad")
        keys = packed_keys(self.keys)
        if keys is None:
            raise ProtocolError(f"block keys {self.keys[:4]!r} do not fit a BlockLoad")
        return block_load_wire(self.req_id, layers, len(self.layers), keys, len(self.keys),
                               self.epoch, self.slab, self.verify)

    @classmethod
    def from_wire(cls, msg: bytes) -> BlockLoad:
        """Parse a whole message (``b"XAB"`` and the body); :class:`ProtocolError` unless
        its length is exactly what its header says."""
        try:
            req_id, epoch, slab, verify, nl, nk = _BLOCK.unpack_from(msg, 3)
        except struct.error:
            raise ProtocolError("malformed BLOCK LOAD header") from None
        at = 3 + _BLOCK.size
        if verify > 1 or nk > MAX_BLOCK_KEYS or len(msg) != at + 4 * nl + 8 * nk:
            raise ProtocolError("malformed BLOCK LOAD body")
        layers = _array("i", nl).unpack_from(msg, at)
        keys = _array("Q", nk).unpack_from(msg, at + 4 * nl)
        return cls(req_id, layers, keys, epoch, slab, bool(verify))


def block_load_wire(req_id: int, layers: bytes, nlayers: int, keys: bytes, nkeys: int,
                    epoch: int, slab: int, verify: bool) -> bytes:
    """A :class:`BlockLoad` from its parts already packed (:func:`pack_layers`, 64-bit
    keys): what the receiver's hot path sends."""
    try:
        head = _BLOCK.pack(req_id, epoch, slab, verify, nlayers, nkeys)
    except struct.error as exc:
        raise ProtocolError(f"a BlockLoad field is out of range: {exc}") from None
    return _BLOCK_PREFIX + head + layers + keys


class BlockForm(Protocol):
    """A batch that may travel as a :class:`BlockLoad`."""

    def block_form(self) -> tuple[bytes, int, bytes, int] | None:
        """(packed layer ids, layer count, packed keys, key count), or ``None``."""


def load_wire(req_id: int, batch: Wired, epoch: int = 0, slab: int = 0,
              verify: bool = False) -> bytes:
    """The request for ``batch``: a :class:`BlockLoad` when the batch has a block form
    (``batch.block_form()``: every segment the same integer keys, integer layers), else a
    JSON :class:`Load`."""
    form = getattr(batch, "block_form", None)
    if form is not None:
        parts = form()
        if parts is not None:
            layers, nl, keys, nk = parts
            return block_load_wire(req_id, layers, nl, keys, nk, epoch, slab, verify)
    return Load.of(req_id, batch, epoch, slab, verify).to_wire()


@dataclass(frozen=True, slots=True)
class Probe:
    """Receiver -> source: check that every key of ``batch`` (same form as :class:`Load`'s)
    is published, before any batch of a multi-batch load moves. Answered with
    ``Landed(req_id, 0)`` or an :class:`Error`; nothing is written."""

    req_id: int
    batch: Any
    epoch: int = 0

    def to_wire(self) -> bytes:
        return _encode(PROBE_TAG, [self.req_id, self.batch, self.epoch])

    @classmethod
    def from_body(cls, body: Any) -> Probe:
        if not isinstance(body, list) or len(body) != 3:
            raise ProtocolError("malformed PROBE body")
        return cls(_req_id(body[0]), body[1], _count(body[2], "epoch"))


@dataclass(frozen=True, slots=True)
class Landed:
    """Source -> receiver, delivered after the WRITE's bytes: ``wire_bytes`` moved into
    the receiver's receive slab number ``slab`` (the one the source's mapping wrote; the
    receiver unpacks only if it is the one it asked for). ``tiers``: how many of the
    (layer, block) pieces the source served from its snapshot store's device and host
    tiers (the rest from its live slots)."""

    req_id: int
    wire_bytes: int
    #: digest of the payload as the source packed it (:func:`xavier_async.slabs.payload_digest`), if asked
    digest: str | None = None
    slab: int = 0
    tiers: tuple[int, int] = (0, 0)

    def to_wire(self) -> bytes:
        """Binary: a fixed header (request id, bytes, slab, the two tier counts, whether
        there is a digest and its length) and the digest's UTF-8 bytes."""
        digest = b"" if self.digest is None else self.digest.encode()
        try:
            return _LANDED_PREFIX + _LANDED.pack(
                self.req_id, self.wire_bytes, self.slab, self.tiers[0], self.tiers[1],
                self.digest is not None, len(digest)) + digest
        except struct.error as exc:
            raise ProtocolError(f"a LANDED field is out of range: {exc}") from None

    @classmethod
    def from_wire(cls, msg: bytes) -> Landed:
        """Parse a whole message (``b"XAD"`` and the body)."""
        try:
            req_id, n, slab, dev, host, has, size = _LANDED.unpack_from(msg, 3)
        except struct.error:
            raise ProtocolError("malformed LANDED header") from None
        at = 3 + _LANDED.size
        if has > 1 or len(msg) != at + size or (size and not has):
            raise ProtocolError("malformed LANDED body")
        digest = None
        if has:
            try:
                digest = bytes(msg[at:]).decode()
            except UnicodeDecodeError:
                raise ProtocolError("malformed LANDED digest") from None
        return cls(req_id, n, digest, slab, (dev, host))


#: Landed's fixed header: request id, bytes, slab, tier counts, has a digest, digest length
_LANDED = struct.Struct("<qQIQQBH")
_LANDED_PREFIX = MAGIC + LANDED_TAG


#: error kind on the wire <-> the exception the receiver raises (one table, both ways)
ERROR_KINDS: Final[Mapping[str, type[XavierError]]] = {
    "lost": PeerLostError,
    "transfer": TransferError,
    "registration": RegistrationError,
    "stale": StaleRequestError,  # before its base RemoteError
    "refused": RemoteError,
}


def _kind_of(exc: BaseException) -> str:
    for kind, cls in ERROR_KINDS.items():  # PeerLostError before its base TransferError
        if isinstance(exc, cls):
            return kind
    return "refused"


@dataclass(frozen=True, slots=True)
class Error:
    """Source -> receiver: request ``req_id`` failed (``kind`` is a key of :data:`ERROR_KINDS`)."""

    req_id: int
    kind: str
    text: str
    #: the source is sure that no write of it for this request can still land
    settled: bool = True

    @classmethod
    def of(cls, req_id: int, exc: BaseException, settled: bool = True) -> Error:
        return cls(req_id, _kind_of(exc), str(exc), settled)

    def exception(self, peer: int) -> XavierError:
        """The exception the receiver raises (unknown kinds become :class:`RemoteError`)."""
        return ERROR_KINDS.get(self.kind, RemoteError)(f"rank {peer}: {self.text}")

    def to_wire(self) -> bytes:
        return _encode(ERROR_TAG, [self.req_id, self.kind, self.text, int(self.settled)])

    @classmethod
    def from_body(cls, body: Any) -> Error:
        if not isinstance(body, list) or len(body) != 4 or not isinstance(body[1], str) \
                or not isinstance(body[2], str) or type(body[3]) is not int or body[3] not in (0, 1):
            raise ProtocolError("malformed ERROR body")
        return cls(_req_id(body[0]), body[1], body[2], bool(body[3]))


def _announced_keys(value: object) -> tuple[Any, ...]:
    if not isinstance(value, list) or len(value) > MAX_ANNOUNCE_KEYS:
        raise ProtocolError("malformed ANNOUNCE key list")
    for key in value:
        if type(key) not in (int, str, bytes) or (type(key) is int and key not in _COUNT_RANGE):
            raise ProtocolError(f"malformed announced key {key!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class Announce:
    """Either way: the sender now holds ``published`` and no longer holds ``evicted``;
    with ``replace`` the sender holds exactly ``published`` (what a peer gets when it
    joins, or after a resync; a long list travels as several messages, only the first with
    ``replace``). Keys are ints (0 <= key < 2**64), strings or bytes."""

    published: tuple[Any, ...] = ()
    evicted: tuple[Any, ...] = ()
    replace: bool = False

    def to_wire(self) -> bytes:
        return _encode(ANNOUNCE_TAG, [list(self.published), list(self.evicted), int(self.replace)])

    @classmethod
    def from_body(cls, body: Any) -> Announce:
        if not isinstance(body, list) or len(body) != 3 or body[2] not in (0, 1) \
                or type(body[2]) is not int:
            raise ProtocolError("malformed ANNOUNCE body")
        return cls(_announced_keys(body[0]), _announced_keys(body[1]), bool(body[2]))


def announce_wires(published: Sequence[Any], evicted: Sequence[Any] = (),
                   replace: bool = False) -> list[bytes]:
    """The :class:`Announce` messages that say this, each at most
    :data:`MAX_ANNOUNCE_KEYS` keys a list (one message even when both are empty, so that
    ``replace`` with nothing published still says "I hold nothing")."""
    out: list[bytes] = []
    step = MAX_ANNOUNCE_KEYS
    for i in range(0, max(len(published), len(evicted), 1), step):
        out.append(Announce(tuple(published[i:i + step]), tuple(evicted[i:i + step]),
                            replace and i == 0).to_wire())
    return out


Message = Union[Load, BlockLoad, Probe, Landed, Error, Announce]
#: the JSON messages, by tag
_BY_TAG: Final[Mapping[bytes, Callable[[Any], Message]]] = {
    LOAD_TAG: Load.from_body, PROBE_TAG: Probe.from_body, ERROR_TAG: Error.from_body,
    ANNOUNCE_TAG: Announce.from_body}
#: the binary messages, by their first three bytes
_BINARY: Final[Mapping[bytes, Callable[[bytes], Message]]] = {
    _BLOCK_PREFIX: BlockLoad.from_wire, _LANDED_PREFIX: Landed.from_wire}


def decode(msg: bytes) -> Message:
    """Bytes from a peer -> a message; :class:`ProtocolError` on anything malformed."""
    if not isinstance(msg, (bytes, bytearray)) or len(msg) < 3 or msg[:2] != MAGIC:
        raise ProtocolError(f"not an xavier_async control message: {bytes(msg[:16])!r}")
    binary = _BINARY.get(bytes(msg[:3]))
    if binary is not None:
        return binary(bytes(msg))
    parse = _BY_TAG.get(bytes(msg[2:3]))
    if parse is None:
        raise ProtocolError(f"unknown message tag {bytes(msg[2:3])!r}")
    try:
        body = _loads(bytes(msg[3:]).decode())
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise ProtocolError(f"malformed control message: {exc!r}") from None
    return parse(body)


# -- the handshake's hello -------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    """What an endpoint tells a peer when they connect. ``extras`` carries optional,
    uninterpreted fields (the benchmark's consent to raw copies, for example).

    Fencing fields: ``incarnation`` names this endpoint instance (a restarted process has a
    new one); ``epochs[rank]`` is the epoch of our last connection with ``rank`` as its
    receiver (the next one is that plus one; a source refuses older requests);
    ``unsettled`` lists the ranks to which a write of ours may still land (a copy posted
    and not terminal, or a connection we have not yet seen end)."""

    rank: int
    layout: list[Any]
    sizes: SlabSizes
    device: str
    version: int = PROTOCOL_VERSION
    extras: Mapping[str, Any] = field(default_factory=dict)
    incarnation: str = ""
    epochs: Mapping[int, int] = field(default_factory=dict)
    unsettled: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {**self.extras, "version": self.version, "rank": self.rank, "layout": self.layout,
                "full_bytes": self.sizes.full, "small_bytes": self.sizes.small,
                "device": self.device, "incarnation": self.incarnation,
                "epochs": [[r, e] for r, e in self.epochs.items()],
                "unsettled": list(self.unsettled)}


@dataclass(frozen=True, slots=True)
class PeerFacts:
    """The fencing fields of a peer's (already checked) hello, as seen by rank ``me``."""

    incarnation: str
    #: the epoch our requests to this peer carry from now on (its view of us plus one)
    epoch_as_receiver: int
    #: the epoch this peer's requests to us must carry at least
    min_epoch: int
    #: the peer may still land a write of its in our receive slabs
    writes_unsettled: bool


def peer_facts(me: int, peer: Mapping[str, Any], our_epochs: Mapping[int, int]) -> PeerFacts:
    """Fencing facts from a peer's hello (malformed fields count as the unsafe answer)."""
    rank = peer.get("rank")
    epochs = peer.get("epochs")
    theirs = 0
    if isinstance(epochs, list):
        for item in epochs:
            if isinstance(item, list) and len(item) == 2 and item[0] == me and type(item[1]) is int:
                theirs = max(theirs, item[1])
    unsettled = peer.get("unsettled")
    inc = peer.get("incarnation")
    return PeerFacts(
        incarnation=inc if isinstance(inc, str) else "",
        epoch_as_receiver=our_epochs.get(rank, 0) + 1 if type(rank) is int else 1,
        min_epoch=theirs + 1,
        writes_unsettled=not isinstance(unsettled, list) or me in unsettled)


def check_hello(local: Hello, peer: Any, layout: CacheLayout) -> int:
    """Validate a peer's hello against ours; return the peer's rank. Raises
    :class:`HandshakeError` (or :class:`LayoutMismatchError`) naming the problem."""
    try:
        if not isinstance(peer, dict):
            raise HandshakeError("malformed handshake from peer: hello is not an object")
        if peer.get("version") != local.version:
            raise HandshakeError(
                f"protocol version mismatch: local {local.version}, peer {peer.get('version')!r}")
        rank = peer.get("rank")
        if type(rank) is not int or rank < 0:
            raise HandshakeError(f"peer rank must be an int >= 0, got {rank!r}")
        if rank == local.rank:
            raise HandshakeError(f"peer has the same rank as this endpoint ({rank})")
        for key, mine in (("full_bytes", local.sizes.full), ("small_bytes", local.sizes.small)):
            if peer.get(key) != mine:
                raise HandshakeError(
                    f"slab size mismatch ({key}): local {mine}, peer {peer.get(key)} "
                    f"(views must match on both ends)")
        peer_layout = peer.get("layout", [])
        layout.check_compatible(peer_layout, f"rank {rank}")
        theirs = {item[0] for item in peer_layout}
        if not any(layer in theirs for layer in layout.layers):
            raise LayoutMismatchError(
                f"rank {rank} has no layer id in common with this endpoint (local "
                f"{list(layout.layers)[:8]!r}, rank {rank} {sorted(theirs, key=repr)[:8]!r}): "
                "every load between them would fail")
        return rank
    except XavierError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError, IndexError) as exc:
        raise HandshakeError(f"malformed handshake from peer: {exc!r}") from None


# -- the receiver's outstanding requests -------------------------------------------------------

class PendingRequest:
    """One request awaiting its reply. ``on_done`` is called once, when it resolves."""

    __slots__ = ("req_id", "peer", "wire_bytes", "digest", "slab", "tiers", "error", "settled",
                 "done", "_on_done")

    def __init__(self, req_id: int, peer: int, on_done: Callable[[], None]) -> None:
        self.req_id, self.peer = req_id, peer
        self.wire_bytes = 0
        self.digest: str | None = None
        #: the receive slab the source reports writing
        self.slab = -1
        #: pieces the source served from its store's device and host tiers
        self.tiers = (0, 0)
        self.error: XavierError | None = None
        #: no write for this request can land any more (false while it may still land)
        self.settled = False
        self.done = False
        self._on_done = on_done

    def resolve(self, wire_bytes: int, digest: str | None = None, slab: int = -1,
                tiers: tuple[int, int] = (0, 0)) -> None:
        if not self.done:
            self.wire_bytes, self.digest, self.slab, self.tiers = wire_bytes, digest, slab, tiers
            self.settled = self.done = True
            self._on_done()

    def is_done(self) -> bool:
        """Whether it resolved or failed (:attr:`done`, as a call)."""
        return self.done

    def fail(self, exc: XavierError, settled: bool = False) -> None:
        """Fail the request; ``settled``: the source can no longer write for it."""
        if not self.done:
            self.error, self.settled, self.done = exc, settled, True
            self._on_done()


class RequestTable:
    """Request ids and the replies that match them: a reply counts only if it comes from
    the peer the request went to."""

    def __init__(self) -> None:
        self._next = 1
        self._open: dict[int, PendingRequest] = {}

    def open(self, peer: int, on_done: Callable[[], None]) -> PendingRequest:
        req = PendingRequest(self._next, peer, on_done)
        self._next += 1
        self._open[req.req_id] = req
        return req

    def close(self, req: PendingRequest) -> None:
        self._open.pop(req.req_id, None)

    def reply(self, peer: int, msg: Landed | Error) -> PendingRequest | None:
        """Resolve the request ``msg`` answers; ``None`` for a stray or foreign reply."""
        req = self._open.get(msg.req_id)
        if req is None or req.peer != peer:
            return None
        if isinstance(msg, Landed):
            req.resolve(msg.wire_bytes, msg.digest, msg.slab, msg.tiers)
        else:
            req.fail(msg.exception(peer), settled=msg.settled)
        return req

    def fail(self, exc: XavierError, peer: int | None = None, settled: bool = False) -> None:
        """Fail every open request (to ``peer`` only, if given); unless ``settled``, a
        write for them may still land (the source was lost, not heard from)."""
        for req in list(self._open.values()):
            if peer is None or req.peer == peer:
                req.fail(exc, settled)

    def __iter__(self) -> Iterator[PendingRequest]:
        return iter(list(self._open.values()))

    def __len__(self) -> int:
        return len(self._open)


__all__ = ["PROTOCOL_VERSION", "ProtocolError", "Load", "BlockLoad", "BlockForm", "load_wire",
           "block_load_wire", "pack_layers", "packed_keys", "MAX_BLOCK_KEYS", "Probe", "Landed", "Error", "ERROR_KINDS",
           "Announce", "announce_wires", "MAX_ANNOUNCE_KEYS",
           "Message", "decode", "Hello", "PeerFacts", "peer_facts", "check_hello",
           "PendingRequest", "RequestTable"]

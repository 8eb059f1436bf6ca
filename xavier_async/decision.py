"""The source's serve decision (pure: no I/O, no event loop, no transport).

:func:`parse_load` turns a request into segments once, checked against the source's
layout; :func:`decide` answers, as often as asked, whether it can be served now
(:class:`Ready`), needs a view mapped first (:class:`NeedsMapping`) or must be refused
(:class:`Refuse`). Everything here can be fed arbitrary requests: malformed ones become a
:class:`Refuse`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import itemgetter
from typing import Any, Union

from .errors import InvalidRequestError, StaleRequestError, XavierError
from .layout import BlockKey, CacheLayout, LayerId
from .planning import BlockSpec, Segment, SegmentItem, segment_offsets, segments_from_wire
from .policy import ChannelPolicy
from .protocol import BlockLoad, Load, Probe
from .sizes import View


class ParsedLoad:
    """A request checked against the source's layout: its segments and payload. A block
    load's (``block``) segments are built only if something asks for them: the serve path
    reads :meth:`segment_items` (plain tuples) and :attr:`block` instead."""

    __slots__ = ("req_id", "_segments", "payload", "useful", "epoch", "slab", "verify", "block")

    def __init__(self, req_id: int, segments: list[Segment] | None, payload: int, useful: int,
                 epoch: int = 0, slab: int = 0, verify: bool = False,
                 block: BlockSpec | None = None) -> None:
        if segments is None and block is None:
            raise ValueError("a parsed load needs its segments or its block spec")
        self.req_id, self._segments, self.payload, self.useful = req_id, segments, payload, useful
        self.epoch, self.slab, self.verify, self.block = epoch, slab, verify, block

    @property
    def segments(self) -> list[Segment]:
        segs = self._segments
        if segs is None:
            layers, keys, offsets, sizes = self.block  # type: ignore[misc]
            segs = self._segments = [Segment(layer, keys, o, bn)
                                     for layer, o, bn in zip(layers, offsets, sizes)]
        return segs

    def segment_items(self) -> Iterable[SegmentItem]:
        """Each segment as ``(layer, keys, offset, block_nbytes, slots)`` (a
        :class:`Segment` is such a tuple), without building segments for a block load."""
        b = self.block
        if b is None or self._segments is not None:
            return self.segments
        layers, keys, offsets, sizes = b
        return zip(layers, repeat(keys), offsets, sizes, repeat(()))

    def __repr__(self) -> str:
        return (f"ParsedLoad(req_id={self.req_id}, payload={self.payload}, useful={self.useful}, "
                f"epoch={self.epoch}, slab={self.slab}, verify={self.verify}, "
                f"block={self.block is not None})")


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer the request with an :class:`Error`."""

    req_id: int
    error: XavierError


@dataclass(frozen=True, slots=True)
class NeedsMapping:
    """The view the channel's machine picks is not mapped to the request's receive slab
    yet: map it, then decide again."""

    view: View
    slab: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """Serve now: pack ``slot_lists`` into the send slab and write through ``view``."""

    load: ParsedLoad
    slot_lists: list[Sequence[int]]
    view: View

    @property
    def target(self) -> tuple[View, int]:
        """The mapping this copy uses: (send view, receiver's receive slab)."""
        return (self.view, self.load.slab)


Decision = Union[Refuse, NeedsMapping, Ready]


class BlockShapes:
    """Where each layer's segment of a :class:`BlockLoad` lies, per (layers, key count):
    :func:`~xavier_async.planning.segment_offsets` computed once per shape (the receiver's
    planner lays such a batch out the same way), at most ``size`` shapes kept."""

    def __init__(self, layout: CacheLayout, size: int = 256) -> None:
        self.layout = layout
        self.size = size
        self._shapes: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], tuple[int, ...], int]] = {}

    def shape(self, layers: tuple[int, ...], n: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(segment offsets, block sizes, payload end) of ``n`` keys in each of
        ``layers``; :class:`InvalidRequestError` naming a layer this layout lacks."""
        key = (layers, n)
        hit = self._shapes.get(key)
        if hit is not None:
            return hit
        specs = self.layout.layers
        sizes = []
        for layer in layers:
            spec = specs.get(layer)
            if spec is None:
                raise InvalidRequestError(f"unknown layer {layer!r} on the source")
            sizes.append(spec.block_nbytes)
        offsets, end = segment_offsets((bn, n) for bn in sizes)
        if len(self._shapes) >= self.size:
            self._shapes.pop(next(iter(self._shapes)))  # oldest first
        hit = self._shapes[key] = (tuple(offsets), tuple(sizes), end)
        return hit

    def parse(self, load: BlockLoad, full_bytes: int) -> ParsedLoad | Refuse:
        """A block load's segments: one per layer, each naming every key (one shared
        tuple, so the lookup makes one getter for them all)."""
        keys, layers = load.keys, load.layers
        if not keys or not layers:
            return Refuse(load.req_id, InvalidRequestError("empty load request"))
        try:
            offsets, sizes, end = self.shape(layers, len(keys))
        except InvalidRequestError as exc:
            return Refuse(load.req_id, exc)
        if end > full_bytes:
            return Refuse(load.req_id, InvalidRequestError(f"batch of {end} B exceeds the full slab"))
        return ParsedLoad(load.req_id, None, end, len(keys) * sum(sizes), load.epoch,
                          load.slab, load.verify, (layers, keys, offsets, sizes))


def parse_load(load: Load | BlockLoad, layout: CacheLayout, full_bytes: int,
               shapes: BlockShapes | None = None) -> ParsedLoad | Refuse:
    """Rebuild a request's segments (same offsets as the receiver computed); a
    :class:`BlockLoad`'s through ``shapes`` (a cache kept by the caller; one made here
    otherwise)."""
    if isinstance(load, BlockLoad):
        return (shapes or BlockShapes(layout)).parse(load, full_bytes)
    try:
        segments, payload = segments_from_wire(load.batch, layout)
    except InvalidRequestError as exc:
        return Refuse(load.req_id, exc)
    except (TypeError, ValueError) as exc:  # a malformed request from the peer
        return Refuse(load.req_id, InvalidRequestError(f"malformed load request: {exc}"))
    if payload > full_bytes:
        return Refuse(load.req_id, InvalidRequestError(f"batch of {payload} B exceeds the full slab"))
    if payload <= 0:
        return Refuse(load.req_id, InvalidRequestError("empty load request"))
    return ParsedLoad(load.req_id, segments, payload, sum(s.nbytes for s in segments),
                      load.epoch, load.slab, load.verify)


def check_probe(probe: Probe, layout: CacheLayout,
                published: Mapping[LayerId, Mapping[BlockKey, int]]) -> XavierError | None:
    """``None`` if every key ``probe`` names is published here, else the refusal."""
    try:
        segments, _ = segments_from_wire(probe.batch, layout)
    except InvalidRequestError as exc:
        return exc
    except (TypeError, ValueError) as exc:
        return InvalidRequestError(f"malformed probe: {exc}")
    refused = slots_of(ParsedLoad(probe.req_id, segments, 0, 0), published)
    return refused.error if isinstance(refused, Refuse) else None


def check_epoch(req_id: int, epoch: int, min_epoch: int) -> Refuse | None:
    """A request from an epoch older than the pair's current one is refused (its
    receiver has moved on: it gave up on it, or reconnected since)."""
    if epoch < min_epoch:
        return Refuse(req_id, StaleRequestError(
            f"request {req_id} is from epoch {epoch}, the connection is at epoch {min_epoch}: "
            "its receiver has moved on"))
    return None


def _no_slots(table: Mapping[BlockKey, int]) -> tuple[int, ...]:
    return ()


def _getter(keys: tuple[BlockKey, ...]) -> Callable[[Mapping[BlockKey, int]], Any]:
    """``table -> the slots of keys`` (a sequence, also for one key or none)."""
    if len(keys) > 1:
        return itemgetter(*keys)
    if keys:
        key = keys[0]
        return lambda table: (table[key],)
    return _no_slots


def slots_of(load: ParsedLoad, published: Mapping[LayerId, Mapping[BlockKey, int]],
             uniform: bool = False) -> list[Sequence[int]] | Refuse:
    """Source slots of every segment's keys, or a refusal naming the unpublished ones (a
    block load's segments are read unbuilt: :meth:`ParsedLoad.segment_items`).
    ``uniform``: every layer's table is the same mapping (a source with a snapshot store
    publishes whole blocks), so a block load's keys are looked up once, for every layer."""
    b = load.block
    if uniform and b is not None and load._segments is None:
        layers, block_keys = b[0], b[1]
        table = published.get(layers[0], {})
        try:
            slots = _getter(block_keys)(table)
        except (KeyError, TypeError):
            return _unpublished(load.req_id, block_keys, table, layers[0])
        return [slots] * len(layers)
    slot_lists: list[Sequence[int]] = []
    keys: tuple[BlockKey, ...] | None = None
    get: Callable[[Mapping[BlockKey, int]], Any] = _no_slots
    empty: Mapping[BlockKey, int] = {}
    for layer, seg_keys, _, _, _ in load.segment_items():
        table = published.get(layer, empty)
        if seg_keys is not keys:  # (segments that repeat the previous keys share them)
            keys = seg_keys
            get = _getter(keys)
        try:
            slot_lists.append(get(table))  # one C call for every key of the segment
        except (KeyError, TypeError):  # unknown or unhashable keys
            return _unpublished(load.req_id, seg_keys, table, layer)
    return slot_lists


def _unpublished(req_id: int, keys: Sequence[BlockKey], table: Mapping[BlockKey, int],
                 layer: LayerId) -> Refuse:
    """The refusal naming the (first few) ``keys`` that ``table`` lacks or cannot hold."""
    missing = [k for k in keys if not isinstance(k, (int, str, bytes)) or k not in table]
    return Refuse(req_id, InvalidRequestError(
        f"block key(s) {missing[:4]!r} not published in layer {layer!r}"))


def decide(load: ParsedLoad, published: Mapping[LayerId, Mapping[BlockKey, int]],
           policy: ChannelPolicy, mapped: Container[tuple[View, int]],
           uniform: bool = False) -> Decision:
    """Whether ``load`` can be served now. Pure: the machine is only peeked at; the caller
    commits the choice when it posts the copy, with nothing awaited in between.
    ``mapped`` holds the (view, receive slab) pairs the channel has mappings for;
    ``uniform`` as for :func:`slots_of`."""
    slots = slots_of(load, published, uniform)
    if isinstance(slots, Refuse):
        return slots
    view = policy.peek_view(load.payload)
    if (view, load.slab) not in mapped:
        return NeedsMapping(view, load.slab)
    return Ready(load, slots, view)


__all__ = ["BlockShapes", "ParsedLoad", "Refuse", "NeedsMapping", "Ready", "Decision", "parse_load",
           "check_probe", "check_epoch", "slots_of", "decide"]

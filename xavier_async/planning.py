"""Turning a load request into batches that fit the slab (pure core, no I/O).

A request names, per source rank, ``{layer: {block key: slot or [slots]}}``; the layer
:data:`~xavier_async.layout.ALL_LAYERS` stands for every layer of the caches. Requests are
merged and validated as a whole before anything is sent: unknown layers, bad slots and two
different blocks aimed at one slot are rejected up front. Each source's blocks are then
packed greedily, in request order, into batches no larger than the full slab; a batch is a
list of per-layer segments at aligned offsets. Source and receiver compute the same offsets
from the same layout, so only the keys cross the wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple, Union

from .errors import InternalError, InvalidRequestError
from .layout import (ALL_LAYERS, SEGMENT_ALIGN, BlockKey, CacheLayout, LayerId, align_up,
                     check_key, check_layer_id, check_slot)
from .protocol import pack_layers, packed_keys

SlotSpec = Union[int, Sequence[int]]
#: ``{source rank: {layer: {block key: slot or [slots]}}}``; layers are LayerId and keys
#: BlockKey, typed Any because Mapping is invariant in its key (a ``dict[int, ...]`` must fit)
LoadRequest = Mapping[int, Mapping[Any, Mapping[Any, SlotSpec]]]
#: Normalized request for one source: ``{layer: {key: (slots...)}}``, in request order.
SourcePlan = dict[LayerId, dict[BlockKey, tuple[int, ...]]]


class Segment(NamedTuple):
    """Consecutive blocks of one layer inside a batch (a named tuple: made per layer per
    batch on the hot path, so it must be cheap to build)."""

    layer: LayerId
    keys: tuple[BlockKey, ...]
    offset: int
    block_nbytes: int
    #: receiver slots for each key (one key may feed several slots)
    slots: tuple[tuple[int, ...], ...] = ()

    @property
    def nbytes(self) -> int:
        return self.block_nbytes * len(self.keys)


#: a segment's fields as a plain tuple (a :class:`Segment` is one)
SegmentItem = tuple[LayerId, tuple[BlockKey, ...], int, int, Any]
#: a block load's segments, unbuilt: (layers, keys, offsets, block sizes), segment ``i``
#: being layer ``layers[i]`` of every key at ``offsets[i]``
BlockSpec = tuple[tuple[LayerId, ...], tuple[BlockKey, ...], tuple[int, ...], tuple[int, ...]]


class Batch(NamedTuple):
    """One copy: segments packed from offset 0; ``nbytes`` is the payload end."""

    segments: tuple[Segment, ...]
    nbytes: int

    @property
    def useful_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def wire(self) -> list[Any]:
        """What the source needs to pack it: ``[[layer, [keys] or 0], ...]``.

        ``0`` means "the same keys as the previous segment" (the common case: one block
        hash names the same slot in every layer), which keeps requests small.
        """
        out: list[Any] = []
        prev: tuple[BlockKey, ...] | None = None
        for s in self.segments:
            out.append([s.layer, 0 if s.keys == prev else list(s.keys)])
            prev = s.keys
        return out


def _conflict(layer: LayerId, slot: int, prev: tuple[int, BlockKey], src: int, key: BlockKey) -> None:
    raise InvalidRequestError(
        f"conflicting destinations: slot {slot} of layer {layer!r} is targeted by key "
        f"{prev[1]!r} from rank {prev[0]} and by key {key!r} from rank {src}")


def _expand_all_layers(layers: Mapping[Any, Any], layout: CacheLayout) -> Iterable[tuple[Any, Any]]:
    """The request's ``(layer, blocks)`` pairs, :data:`ALL_LAYERS` standing for each layer."""
    for layer, blocks in layers.items():
        if layer is ALL_LAYERS:
            yield from ((each, blocks) for each in layout.layers)
        else:
            yield layer, blocks


def normalize(requests: LoadRequest | Iterable[LoadRequest], layout: CacheLayout,
              ) -> dict[int, SourcePlan]:
    """Merge one or several requests and validate them all before any byte moves."""
    if isinstance(requests, Mapping):
        requests = [requests]
    merged: dict[int, SourcePlan] = {}
    owner: dict[LayerId, dict[int, tuple[int, BlockKey]]] = {}  # layer -> slot -> (src, key)
    for req in requests:
        if not isinstance(req, Mapping):
            raise InvalidRequestError(f"a load request must be a mapping, got {type(req).__name__}")
        for src, layers in req.items():
            if isinstance(src, bool) or not isinstance(src, int) or src < 0:
                raise InvalidRequestError(f"source ranks must be ints >= 0, got {src!r}")
            if not isinstance(layers, Mapping):
                raise InvalidRequestError(f"request for source {src} must map layer -> blocks")
            per_src = merged.setdefault(src, {})
            for layer, blocks in _expand_all_layers(layers, layout):
                check_layer_id(layer)
                spec = layout.layers.get(layer)
                if spec is None:
                    raise InvalidRequestError(f"unknown layer {layer!r} (not in this endpoint's caches)")
                if not isinstance(blocks, Mapping):
                    raise InvalidRequestError(f"blocks for layer {layer!r} must map key -> slot")
                per_layer = per_src.setdefault(layer, {})
                owned = owner.setdefault(layer, {})
                nslots = spec.num_slots
                for key, slots in blocks.items():
                    tk = type(key)
                    if tk is not int and tk is not str and tk is not bytes:
                        check_key(key)
                    if type(slots) is int and 0 <= slots < nslots:  # the common case, fast
                        prev = owned.setdefault(slots, (src, key))
                        if prev[1] != key or prev[0] != src:
                            _conflict(layer, slots, prev, src, key)
                        old = per_layer.get(key)
                        if old is None:
                            per_layer[key] = (slots,)
                        elif slots not in old:
                            per_layer[key] = old + (slots,)
                        continue
                    raw_slots = tuple(slots) if isinstance(slots, (list, tuple)) else (slots,)
                    if not raw_slots:
                        raise InvalidRequestError(f"key {key!r} in layer {layer!r} names no slot")
                    slot_list = tuple(check_slot(slot, spec, layer) for slot in raw_slots)
                    for slot in slot_list:
                        prev = owned.setdefault(slot, (src, key))
                        if prev[1] != key or prev[0] != src:
                            _conflict(layer, slot, prev, src, key)
                    old = per_layer.get(key, ())
                    per_layer[key] = old + tuple(s for s in slot_list if s not in old)
    return merged


def segment_offsets(items: Iterable[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets for segments of ``(block_nbytes, count)``; returns (offsets, payload end)."""
    offsets, off = [], 0
    for block_nbytes, count in items:
        off = align_up(off, SEGMENT_ALIGN)
        offsets.append(off)
        off += block_nbytes * count
    return offsets, off


def plan_batches(plan: SourcePlan, layout: CacheLayout, full_bytes: int) -> list[Batch]:
    """Pack one source's blocks greedily, in request order, into batches of at most
    ``full_bytes`` (a segment is cut where the slab is full and continues in the next
    batch)."""
    batches: list[Batch] = []
    segs: list[Segment] = []
    off = 0
    for layer, blocks in plan.items():
        bn = layout.layers[layer].block_nbytes
        if bn > full_bytes:
            raise InvalidRequestError(
                f"a block of layer {layer!r} ({bn} B) is larger than the full slab ({full_bytes} B)")
        n = len(blocks)
        start = align_up(off, SEGMENT_ALIGN)
        if start + n * bn <= full_bytes:  # the whole layer fits in this batch (common case)
            if n:
                segs.append(Segment(layer, tuple(blocks), start, bn, tuple(blocks.values())))
                off = start + n * bn
            continue
        keys = list(blocks)
        slots = list(blocks.values())
        i = 0
        while i < n:
            start = align_up(off, SEGMENT_ALIGN)
            room = (full_bytes - start) // bn if start < full_bytes else 0
            if room <= 0:  # this batch is full: start the next one
                batches.append(Batch(tuple(segs), off))
                segs, off = [], 0
                continue
            take = min(room, n - i)
            segs.append(Segment(layer, tuple(keys[i:i + take]), start, bn, tuple(slots[i:i + take])))
            off = start + take * bn
            i += take
    if segs:
        batches.append(Batch(tuple(segs), off))
    return batches


def segments_from_wire(wire: Sequence[Any], layout: CacheLayout) -> tuple[list[Segment], int]:
    """Rebuild a batch's segments on the source from ``Batch.wire()`` (same offsets)."""
    specs: list[tuple[LayerId, tuple[BlockKey, ...], int]] = []
    for item in wire:
        layer, keys = item
        if keys == 0:
            if not specs:
                raise InvalidRequestError("malformed batch: first segment repeats nothing")
            keys = specs[-1][1]
        spec = layout.layers.get(layer)
        if spec is None:
            raise InvalidRequestError(f"unknown layer {layer!r} on the source")
        specs.append((layer, tuple(keys), spec.block_nbytes))
    offsets, end = segment_offsets((bn, len(keys)) for _, keys, bn in specs)
    return [Segment(layer, keys, o, bn) for (layer, keys, bn), o in zip(specs, offsets)], end


# -- the cached planner -----------------------------------------------------------------------

class BatchShape(NamedTuple):
    """Where each segment of one batch comes from, for a request shape (made once, cached).

    Segment ``i`` is layer ``layers[i]``, key indices ``starts[i] .. starts[i] + counts[i]``
    of that layer's keys, at slab ``offsets[i]``."""

    layers: tuple[LayerId, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    block_nbytes: tuple[int, ...]
    nbytes: int
    useful: int
    #: ``Batch.wire()`` with every segment that repeats the previous keys already ``[layer, 0]``
    #: and the others ``None`` (filled per request)
    wire_template: tuple[Any, ...]
    #: segment indices whose keys must be filled in the wire
    fresh: tuple[int, ...]
    #: the layer ids packed for a :class:`~xavier_async.protocol.BlockLoad` when every
    #: segment takes every key and the layer ids are small ints (else None: a JSON Load)
    block_layers: bytes | None = None


def _single_shape(layer_ids: tuple[Any, ...], n: int, offsets: tuple[int, ...],
                  sizes: tuple[int, ...], end: int) -> BatchShape:
    """The shape of ``n`` keys in each of ``layer_ids`` that fit one batch: segment ``i``
    takes every key of layer ``i`` at ``offsets[i]``; every segment after the first
    repeats the first one's keys on the wire."""
    k = len(layer_ids)
    return BatchShape(layer_ids, (0,) * k, (n,) * k, offsets, sizes, end, n * sum(sizes),
                      (None,) + tuple([layer, 0] for layer in layer_ids[1:]), (0,),
                      pack_layers(layer_ids))


class PlannedBatch:
    """One batch of a planned load: what :class:`Batch` says, made without per-layer Python
    when the request is uniform (the same ``{key: slot}`` in every layer).

    ``keys``/``slots`` are the (uniform) key list and its single destination slot each;
    ``shape`` says which of them each segment takes. For other requests ``shape`` is None
    and :attr:`segments` comes from :func:`plan_batches`."""

    __slots__ = ("src", "shape", "keys", "slots", "nbytes", "_segments", "requested")

    def __init__(self, src: int, shape: BatchShape | None, keys: tuple[BlockKey, ...],
                 slots: tuple[int, ...], nbytes: int,
                 segments: tuple[Segment, ...] | None = None) -> None:
        self.src, self.shape, self.keys, self.slots, self.nbytes = src, shape, keys, slots, nbytes
        self._segments = segments
        #: the receiver has sent this batch's own request (a failure in another batch of
        #: its load then lets it finish: ``Receiver._pipelined``)
        self.requested = False

    @classmethod
    def of(cls, src: int, batch: Batch) -> PlannedBatch:
        return cls(src, None, (), (), batch.nbytes, batch.segments)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The segments as :class:`Segment` tuples (built on first use)."""
        segs = self._segments
        if segs is None:
            sh = self.shape
            if sh is None:  # (built either from a shape or with its segments)
                raise InternalError("a planned batch has neither segments nor a shape")
            keys, slots = self.keys, self.slots
            segs = self._segments = tuple(
                Segment(layer, keys[s:s + c], o, bn, tuple((x,) for x in slots[s:s + c]))
                for layer, s, c, o, bn in zip(sh.layers, sh.starts, sh.counts, sh.offsets,
                                              sh.block_nbytes))
        return segs

    @property
    def useful_bytes(self) -> int:
        if self.shape is not None:
            return self.shape.useful
        return sum(s.nbytes for s in self.segments)

    @property
    def blocks(self) -> int:
        """Block copies the batch carries (keys over all its segments)."""
        if self.shape is not None:
            return sum(self.shape.counts)
        return sum(len(s.keys) for s in self.segments)

    def batch(self) -> Batch:
        return Batch(self.segments, self.nbytes)

    def block_form(self) -> tuple[bytes, int, bytes, int] | None:
        """This batch as a :class:`~xavier_async.protocol.BlockLoad` names it: (packed
        layer ids, layer count, packed keys, key count); ``None`` unless every segment
        takes every key, the layers are small ints and the keys unsigned 64-bit ints."""
        sh = self.shape
        if sh is None or sh.block_layers is None:
            return None
        keys = packed_keys(self.keys)
        if keys is None:
            return None
        return sh.block_layers, len(sh.layers), keys, len(self.keys)

    def wire(self) -> list[Any]:
        """Exactly :meth:`Batch.wire` of this batch."""
        sh = self.shape
        if sh is None:
            return Batch(self.segments, self.nbytes).wire()
        out = list(sh.wire_template)
        keys = self.keys
        for i in sh.fresh:
            s = sh.starts[i]
            out[i] = [sh.layers[i], list(keys[s:s + sh.counts[i]])]
        return out

    def __repr__(self) -> str:
        return f"PlannedBatch(src={self.src}, nbytes={self.nbytes}, segments={len(self.segments)})"


_KEY_TYPES = frozenset((int, str, bytes))
#: the exact types of a layer id the shortcut accepts (bool, an int subclass, is not one)
_LAYER_TYPES = frozenset((int, str))


class Planner:
    """Plans loads for one layout and slab size. A uniform request, one source with the
    same ``{key: slot}`` for every layer it names (or :data:`ALL_LAYERS`), is planned from
    a cached :class:`BatchShape` per (layers, number of keys): its cost does not grow with
    the layer count beyond one C-level comparison per layer. Anything else goes through
    :func:`normalize` and :func:`plan_batches`. Both give exactly the same batches, and the
    same errors, before any byte moves."""

    def __init__(self, layout: CacheLayout, full_bytes: int, cache_size: int = 256) -> None:
        self.layout = layout
        self.full_bytes = full_bytes
        self.cache_size = cache_size
        self._all = tuple(layout.layers)
        self._shapes: dict[tuple[tuple[Any, ...], int], tuple[tuple[BatchShape, ...], int]] = {}
        #: every layer's (block size, slots) when all layers have the same ones (the usual
        #: case): a request for any subset of them is then shaped without a loop over layers
        specs = list(layout.layers.values())
        same = {(sp.block_nbytes, sp.num_slots) for sp in specs}
        self._same: tuple[int, int] | None = next(iter(same)) if len(same) == 1 else None
        self._layer_set = frozenset(layout.layers)
        self.hits = 0
        self.misses = 0

    def plan(self, requests: LoadRequest | Iterable[LoadRequest]) -> list[PlannedBatch]:
        """Validate and plan; batches in source order, each source's in request order."""
        if type(requests) is dict and len(requests) == 1:
            for src, layers in requests.items():
                fast = self._uniform(src, layers)
                if fast is not None:
                    return fast
        return self._general(requests)

    def _general(self, requests: LoadRequest | Iterable[LoadRequest]) -> list[PlannedBatch]:
        """:func:`normalize` and :func:`plan_batches`: every request, every error."""
        plans = normalize(requests, self.layout)
        return [PlannedBatch.of(src, b) for src, plan in plans.items()
                for b in plan_batches(plan, self.layout, self.full_bytes)]

    def plan_blocks(self, src: int, keys: Sequence[BlockKey], slots: Sequence[int],
                    layers: Iterable[LayerId] | None = None) -> list[PlannedBatch]:
        """:meth:`plan` of ``{src: {layer: {keys[i]: slots[i]}}}`` for every layer (or
        ``layers``), with one shared ``{key: slot}`` mapping: the same batches and errors
        as that request, without building or comparing a mapping per layer. A key named
        twice is refused (a mapping would keep only its last slot)."""
        if isinstance(keys, (str, bytes)) or isinstance(slots, (str, bytes)):
            raise InvalidRequestError("keys and slots must be sequences (of keys, of slot indices)")
        try:
            keys, slots = tuple(keys), tuple(slots)
        except TypeError:
            raise InvalidRequestError("keys and slots must be sequences (of keys, of slot "
                                      "indices)") from None
        if len(keys) != len(slots):
            raise InvalidRequestError(f"{len(keys)} keys but {len(slots)} slots")
        try:
            blocks = dict(zip(keys, slots))
        except TypeError:  # an unhashable key
            bad = next(k for k in keys if not isinstance(k, (int, str, bytes)))
            check_key(bad)
            raise
        if len(blocks) != len(keys):
            raise InvalidRequestError("a block key is named twice (each key names one slot; "
                                      "for one key in several slots use load())")
        if layers is None:
            request: dict[Any, Any] = {ALL_LAYERS: blocks}
        else:
            if isinstance(layers, (str, bytes)):
                raise InvalidRequestError(f"layers must be a collection of layer ids, got {layers!r}")
            request = {layer: blocks for layer in layers}
        fast = self._uniform(src, request)
        return fast if fast is not None else self._general({src: request})

    def _uniform(self, src: Any, layers: Any) -> list[PlannedBatch] | None:
        if type(src) is not int or src < 0 or type(layers) is not dict or not layers:
            return None
        if len(layers) == 1 and ALL_LAYERS in layers:
            layer_ids: tuple[Any, ...] = self._all
            first = layers[ALL_LAYERS]
        else:
            vals = list(layers.values())
            first = vals[0]
            if type(first) is not dict or vals.count(first) != len(vals):
                return None
            # equal is not enough (1 == True == 1.0): every key and slot must also have an
            # exact type, checked in C over all layers at once
            # (one pass over keys and slots: the first layer's are validated below, and a
            # bool, float or str equal to one of its ints has a type outside this set).
            # Layers that all name the very same dict need only the checks below.
            if not all(v is first for v in vals) and not _KEY_TYPES.issuperset(
                    map(type, chain(chain.from_iterable(vals), chain.from_iterable(map(dict.values, vals))))):
                return None
            layer_ids = tuple(layers)
        if type(first) is not dict or not first:
            return None
        keys = tuple(first)
        slots = tuple(first.values())
        n = len(keys)
        hit = self._shapes.get((layer_ids, n))
        if hit is None:
            hit = self._make_shapes(layer_ids, n)
            if hit is None:
                return None
        else:
            self.hits += 1
        shapes, nslots = hit
        for k in keys:
            tk = type(k)
            if tk is not int and tk is not str and tk is not bytes:
                return None
        for s in slots:
            if type(s) is not int or not 0 <= s < nslots:
                return None
        if n > 1 and len(set(slots)) != n:
            return None  # two keys aimed at one slot: the general path names the conflict
        return [PlannedBatch(src, sh, keys, slots, sh.nbytes) for sh in shapes]

    def _make_shapes(self, layer_ids: tuple[Any, ...], n: int,
                     ) -> tuple[tuple[BatchShape, ...], int] | None:
        same = self._same
        if same is not None and _LAYER_TYPES.issuperset(map(type, layer_ids)) \
                and self._layer_set.issuperset(layer_ids):
            # every layer has the same block size: segment i starts at i x the aligned
            # segment size, which is what _one_batch computes layer by layer
            bn, nslots = same
            k = len(layer_ids)
            stride = align_up(n * bn, SEGMENT_ALIGN)
            end = stride * (k - 1) + n * bn
            if end <= self.full_bytes:  # (so is every block)
                self.misses += 1
                shape = _single_shape(layer_ids, n, tuple(range(0, stride * k, stride)), (bn,) * k, end)
                return self._keep(layer_ids, n, (shape,), nslots)
        specs = self.layout.layers
        for layer in layer_ids:
            if layer is ALL_LAYERS or isinstance(layer, bool) or not isinstance(layer, (int, str)) \
                    or layer not in specs:
                return None  # the general path raises the right error
            if specs[layer].block_nbytes > self.full_bytes:
                return None
        if len(set(layer_ids)) != len(layer_ids):
            return None  # pragma: no cover - dict keys are unique
        self.misses += 1
        one = self._one_batch(layer_ids, n)
        if one is not None:
            return self._remember(layer_ids, n, (one,))
        dummy: SourcePlan = {layer: {i: (i,) for i in range(n)} for layer in layer_ids}
        shapes = []
        for b in plan_batches(dummy, self.layout, self.full_bytes):
            segs = b.segments
            template: list[Any] = []
            fresh: list[int] = []
            prev: tuple[Any, ...] | None = None
            for i, s in enumerate(segs):
                if s.keys == prev:
                    template.append([s.layer, 0])
                else:
                    template.append(None)
                    fresh.append(i)
                prev = s.keys
            shapes.append(BatchShape(
                tuple(s.layer for s in segs), tuple(int(s.keys[0]) for s in segs),
                tuple(len(s.keys) for s in segs), tuple(s.offset for s in segs),
                tuple(s.block_nbytes for s in segs), b.nbytes, b.useful_bytes,
                tuple(template), tuple(fresh)))
        return self._remember(layer_ids, n, tuple(shapes))

    def _one_batch(self, layer_ids: tuple[Any, ...], n: int) -> BatchShape | None:
        """The shape of ``n`` keys in each of ``layer_ids`` when they fit one batch (what
        :func:`plan_batches` gives then, without planning a dummy request): a request for
        a random subset of layers is a miss in the cache, and must not cost more."""
        specs = self.layout.layers
        offsets: list[int] = []
        sizes: list[int] = []
        off = 0
        for layer in layer_ids:
            bn = specs[layer].block_nbytes
            start = align_up(off, SEGMENT_ALIGN)
            offsets.append(start)
            sizes.append(bn)
            off = start + n * bn
        if off > self.full_bytes:
            return None
        return _single_shape(tuple(layer_ids), n, tuple(offsets), tuple(sizes), off)

    def _remember(self, layer_ids: tuple[Any, ...], n: int, shapes: tuple[BatchShape, ...],
                  ) -> tuple[tuple[BatchShape, ...], int]:
        specs = self.layout.layers
        return self._keep(layer_ids, n, shapes, min(specs[layer].num_slots for layer in layer_ids))

    def _keep(self, layer_ids: tuple[Any, ...], n: int, shapes: tuple[BatchShape, ...], nslots: int,
              ) -> tuple[tuple[BatchShape, ...], int]:
        if len(self._shapes) >= self.cache_size:
            self._shapes.pop(next(iter(self._shapes)))  # oldest first
        entry = (shapes, nslots)
        self._shapes[(layer_ids, n)] = entry
        return entry

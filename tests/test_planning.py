"""Request normalization, batch planning, layouts, slabs, wire messages and retry policy (pure core)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xavier_async import InvalidRequestError, LayoutMismatchError, RetryPolicy
from xavier_async import protocol
from xavier_async.layout import SEGMENT_ALIGN, CacheLayout, align_up
from xavier_async.planning import (Batch, normalize, plan_batches, segment_offsets,
                                   segments_from_wire)
from xavier_async.slabs import DEFAULT_SMALL_BYTES, allocate_slabs, slab_sizes


LAYOUT = CacheLayout.of({0: torch.zeros(8, 4, dtype=torch.float32),       # 16 B blocks
                         1: torch.zeros(8, 3, dtype=torch.float16),       # 6 B blocks
                         "v": torch.zeros(4, 2, 5, dtype=torch.int8)})    # 10 B blocks


# -- normalize ------------------------------------------------------------------------------

def test_normalize_merges_several_requests():
    plans = normalize([{1: {0: {"a": 0}}},
                       {1: {0: {"b": 1}, 1: {"a": 0}}, 2: {"v": {b"k": 3}}},
                       {1: {0: {"c": 2}}}], LAYOUT)
    assert plans == {1: {0: {"a": (0,), "b": (1,), "c": (2,)}, 1: {"a": (0,)}},
                     2: {"v": {b"k": (3,)}}}
    assert list(plans[1][0]) == ["a", "b", "c"]  # request order is kept


def test_normalize_accepts_a_single_mapping():
    assert normalize({3: {0: {7: 5}}}, LAYOUT) == {3: {0: {7: (5,)}}}


def test_one_key_to_several_slots():
    plans = normalize([{1: {0: {"a": [0, 3]}}}, {1: {0: {"a": (3, 5)}}}, {1: {0: {"a": 6}}}],
                      LAYOUT)
    assert plans == {1: {0: {"a": (0, 3, 5, 6)}}}


def test_same_key_same_slot_twice_is_fine():
    assert normalize([{1: {0: {"a": 2}}}, {1: {0: {"a": [2, 2]}}}], LAYOUT) == {1: {0: {"a": (2,)}}}


def test_same_slot_in_different_layers_is_fine():
    assert normalize({1: {0: {"a": 2}, 1: {"b": 2}}}, LAYOUT) == {1: {0: {"a": (2,)}, 1: {"b": (2,)}}}


@pytest.mark.parametrize("requests", [
    {1: {0: {"a": 0, "b": 0}}},                              # two keys, one slot
    {1: {0: {"a": [0, 1], "b": [2, 1]}}},                    # overlap inside slot lists
    [{1: {0: {"a": 0}}}, {1: {0: {"b": 0}}}],                # across requests
    {1: {0: {"a": 0}}, 2: {0: {"a": 0}}},                    # same key, two sources
    [{1: {0: {"a": 0}}}, {2: {0: {"z": [3, 0]}}}],           # across sources and requests
])
def test_conflicting_destinations_rejected(requests):
    with pytest.raises(InvalidRequestError, match="conflicting destinations"):
        normalize(requests, LAYOUT)


@pytest.mark.parametrize("requests, match", [
    ({1: {9: {"a": 0}}}, "unknown layer"),
    ({1: {"0": {"a": 0}}}, "unknown layer"),                 # "0" is not layer 0
    ({1: {0: {"a": 8}}}, "out of range"),
    ({1: {"v": {"a": 4}}}, "out of range"),
    ({1: {0: {"a": -1}}}, "out of range"),
    ({1: {0: {"a": True}}}, "must be an int"),
    ({1: {0: {"a": 1.0}}}, "must be an int"),
    ({1: {0: {"a": [1, 2.0]}}}, "must be an int"),
    ({1: {0: {"a": "1"}}}, "must be an int"),
    ({1: {0: {"a": None}}}, "must be an int"),
    ({1: {0: {"a": []}}}, "names no slot"),
    ({-1: {0: {"a": 0}}}, "source ranks"),
    ({True: {0: {"a": 0}}}, "source ranks"),
    ({"1": {0: {"a": 0}}}, "source ranks"),
    ({1.0: {0: {"a": 0}}}, "source ranks"),
    ({1: [0]}, "must map layer"),
    ({1: {0: ["a"]}}, "must map key"),
    ({1: {1.5: {"a": 0}}}, "layer ids"),
    ({1: {0: {(1, 2): 0}}}, "block keys"),
    ({1: {0: {True: 0}}}, "block keys"),
    ({1: {0: {None: 0}}}, "block keys"),
    ([{1: {0: {"a": 0}}}, [1]], "must be a mapping"),
])
def test_bad_requests_rejected(requests, match):
    with pytest.raises(InvalidRequestError, match=match):
        normalize(requests, LAYOUT)


# -- plan_batches ------------------------------------------------------------------------

def keys_in(batches: list[Batch]) -> list[tuple[object, object, tuple[int, ...]]]:
    return [(s.layer, k, slots) for b in batches for s in b.segments
            for k, slots in zip(s.keys, s.slots)]


def check_batches(batches: list[Batch], plan, layout: CacheLayout, full: int) -> None:
    """Structural invariants every plan must satisfy."""
    for b in batches:
        assert b.segments, "empty batch"
        assert 0 < b.nbytes <= full
        end = 0
        for s in b.segments:
            assert s.offset % SEGMENT_ALIGN == 0
            assert s.offset >= end                      # no overlap, in order
            assert s.block_nbytes == layout.layers[s.layer].block_nbytes
            assert len(s.slots) == len(s.keys)
            end = s.offset + s.nbytes
        assert end == b.nbytes
        assert b.useful_bytes == sum(s.nbytes for s in b.segments) <= b.nbytes
        # the source rebuilds the very same offsets from the keys alone
        segs, payload = segments_from_wire(protocol.decode(protocol.Load.of(1, b).to_wire()).batch,
                                           layout)
        assert payload == b.nbytes
        assert [(s.layer, s.keys, s.offset, s.block_nbytes) for s in segs] == \
               [(s.layer, s.keys, s.offset, s.block_nbytes) for s in b.segments]
    expected = [(layer, k, slots) for layer, blocks in plan.items() for k, slots in blocks.items()]
    assert keys_in(batches) == expected                 # every key once, in request order


def test_request_that_fits_is_one_batch():
    plan = normalize({1: {0: {i: i for i in range(8)}, 1: {i: i for i in range(8)}}}, LAYOUT)[1]
    need = align_up(8 * 16, SEGMENT_ALIGN) + 8 * 6
    batches = plan_batches(plan, LAYOUT, full_bytes=need)
    assert len(batches) == 1 and batches[0].nbytes == need
    check_batches(batches, plan, LAYOUT, need)
    # one byte less and it must split, but never into more pieces than needed
    batches = plan_batches(plan, LAYOUT, full_bytes=need - 1)
    assert len(batches) == 2
    check_batches(batches, plan, LAYOUT, need - 1)


def test_batches_never_exceed_full_and_fill_greedily():
    plan = normalize({1: {0: {i: i % 8 for i in range(8)}}}, LAYOUT)[1]
    batches = plan_batches(plan, LAYOUT, full_bytes=48)   # 3 blocks of 16 B per batch
    assert [len(b.segments[0].keys) for b in batches] == [3, 3, 2]
    assert [b.nbytes for b in batches] == [48, 48, 32]
    check_batches(batches, plan, LAYOUT, 48)


def test_segments_are_aligned_within_a_batch():
    plan = normalize({1: {1: {"a": 0}, 0: {"b": 0}, "v": {"c": 0}}}, LAYOUT)[1]
    (batch,) = plan_batches(plan, LAYOUT, full_bytes=1024)
    assert [s.offset for s in batch.segments] == [0, 16, 32]
    assert batch.nbytes == 42 and batch.useful_bytes == 6 + 16 + 10
    check_batches([batch], plan, LAYOUT, 1024)


def test_wire_repeats_keys_compactly():
    plan = normalize({1: {0: {"a": 0, "b": 1}, 1: {"a": 0, "b": 1}, "v": {"a": 1}}}, LAYOUT)[1]
    (batch,) = plan_batches(plan, LAYOUT, full_bytes=1024)
    assert batch.wire() == [[0, ["a", "b"]], [1, 0], ["v", ["a"]]]
    segs, end = segments_from_wire(batch.wire(), LAYOUT)
    assert [s.keys for s in segs] == [("a", "b"), ("a", "b"), ("a",)] and end == batch.nbytes


def test_block_larger_than_slab_rejected():
    plan = normalize({1: {0: {"a": 0}}}, LAYOUT)[1]
    with pytest.raises(InvalidRequestError, match="larger than the full slab"):
        plan_batches(plan, LAYOUT, full_bytes=15)
    assert len(plan_batches(plan, LAYOUT, full_bytes=16)) == 1


def test_segments_from_wire_rejects_malformed():
    with pytest.raises(InvalidRequestError):
        segments_from_wire([[0, 0]], LAYOUT)
    with pytest.raises(InvalidRequestError, match="unknown layer"):
        segments_from_wire([[42, ["a"]]], LAYOUT)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.float64,
          torch.int64]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_planning_properties(data):
    nlayers = data.draw(st.integers(1, 4), label="layers")
    layers = {}
    for i in range(nlayers):
        shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
        layers[i] = (16, shape, data.draw(st.sampled_from(DTYPES)))
    layout = CacheLayout.of({i: torch.zeros((n, *shape), dtype=dt)
                             for i, (n, shape, dt) in layers.items()})
    biggest = max(spec.block_nbytes for spec in layout.layers.values())
    full = data.draw(st.integers(biggest, 4 * biggest * 16), label="full")
    request = {}
    for layer in range(nlayers):
        slots = data.draw(st.lists(st.integers(0, 15), unique=True, max_size=16))
        request[layer] = {f"k{s}": s for s in slots}
    plan = normalize({1: request}, layout).get(1, {})
    batches = plan_batches(plan, layout, full)
    check_batches(batches, plan, layout, full)
    total = sum(b.useful_bytes for b in batches)
    assert total == sum(layout.layers[layer].block_nbytes * len(blocks)
                        for layer, blocks in plan.items())
    if total and plan:
        # what fits in one slab laid out end to end is never split
        _, packed_end = segment_offsets(
            (layout.layers[layer].block_nbytes, len(blocks)) for layer, blocks in plan.items()
            if blocks)
        if packed_end <= full:
            assert len(batches) == 1
        # greedy: a batch is only closed when the next block did not fit after it
        for b, nxt in zip(batches, batches[1:]):
            first = nxt.segments[0]
            pos = b.nbytes if b.segments[-1].layer == first.layer else align_up(b.nbytes, SEGMENT_ALIGN)
            assert pos + first.block_nbytes > full


# -- layouts ------------------------------------------------------------------------------

def test_layout_describes_caches():
    spec = LAYOUT.layers["v"]
    assert spec.block_shape == (2, 5) and spec.dtype == torch.int8 and spec.num_slots == 4
    assert spec.block_nbytes == 10
    assert LAYOUT.layers[1].block_nbytes == 6
    assert LAYOUT.device == torch.device("cpu")


@pytest.mark.parametrize("caches, match", [
    ({}, "non-empty"),
    ([torch.zeros(2, 2)], "non-empty"),
    ({0: torch.zeros(4)}, "num_slots"),
    ({0: torch.zeros(4, 6).t()}, "not contiguous"),
    ({0: torch.zeros(4, 4)[:, ::2]}, "not contiguous"),
    ({0: torch.zeros(0, 4)}, "empty"),
    ({0: torch.zeros(4, 0)}, "empty"),
    ({0: [[0.0]]}, "not a torch.Tensor"),
    ({1.5: torch.zeros(2, 2)}, "layer ids"),
    ({True: torch.zeros(2, 2)}, "layer ids"),
    ({0: torch.zeros(2, 2), 1: torch.empty(2, 2, device="meta")}, "one device"),
])
def test_layout_rejects_bad_caches(caches, match):
    with pytest.raises(InvalidRequestError, match=match):
        CacheLayout.of(caches)


def test_layout_compatibility():
    mine = CacheLayout.of({0: torch.zeros(4, 8, dtype=torch.bfloat16), 1: torch.zeros(4, 2)})
    same_but_more_slots = CacheLayout.of({0: torch.zeros(99, 8, dtype=torch.bfloat16)})
    mine.check_compatible(same_but_more_slots.wire(), "peer")
    other_only = CacheLayout.of({7: torch.zeros(2, 3)})
    mine.check_compatible(other_only.wire(), "peer")   # nothing shared, nothing to disagree on
    for bad in ({0: torch.zeros(4, 8, dtype=torch.float16)},
                {0: torch.zeros(4, 4, 2, dtype=torch.bfloat16)},
                {1: torch.zeros(4, 2, dtype=torch.float64)}):
        with pytest.raises(LayoutMismatchError):
            mine.check_compatible(CacheLayout.of(bad).wire(), "peer")


# -- slabs --------------------------------------------------------------------------------

def test_slab_views_share_storage_and_keep_identity():
    send, recv = allocate_slabs(4096, 256, torch.device("cpu"))
    for slab, direction in ((send, "send"), (recv, "recv")):
        assert slab.direction == direction
        assert slab.full.nbytes == 4096 and slab.small.nbytes == 256
        assert slab.small.data_ptr == slab.full.data_ptr == slab.tensor.data_ptr()
        assert slab.view(4096) is slab.full and slab.view(256) is slab.small
        assert slab.views == (slab.full, slab.small)
        slab.small.tensor[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
        assert slab.full.tensor[:3].tolist() == [1, 2, 3]   # one allocation
    assert send.tensor.data_ptr() != recv.tensor.data_ptr()


@pytest.mark.parametrize("nbytes", [0, 255, 257, 4095, 4097, 8192])
def test_slab_rejects_unknown_view_sizes(nbytes):
    send, _ = allocate_slabs(4096, 256, torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="unknown view size"):
        send.view(nbytes)


def test_slab_sizes_defaults_and_validation():
    assert slab_sizes(None, None) == (12 << 20, DEFAULT_SMALL_BYTES)
    assert slab_sizes(4096, None) == (4096, 4096)          # small = min(full, 256 KiB)
    assert slab_sizes(1 << 20, 1024) == (1 << 20, 1024)
    for full, small in ((0, None), (-1, None), (4096, 0), (4096, -5), (4096, 8192),
                        (True, None), (4096, True), (4096.0, None), (4096, 256.0), ("4096", None)):
        with pytest.raises(InvalidRequestError):
            slab_sizes(full, small)


# -- wire messages and retry ----------------------------------------------------------------------

def test_codec_round_trip_and_rejects_garbage():
    body = [7, [[0, ["a", b"\x00\xff", 3]], ["v", 0]]]
    out = protocol.decode(protocol.Load(body[0], body[1]).to_wire())
    assert out == protocol.Load(7, body[1])
    assert protocol.decode(protocol.Landed(1, 2).to_wire()) == protocol.Landed(1, 2)
    for garbage in (b"", b"X", b"XY{}", b"ZZL[]"):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(garbage)


def test_retry_policy_delays_and_validation():
    assert list(RetryPolicy(attempts=4, base_delay=0.01, multiplier=2, max_delay=0.025).delays()) \
        == [0.01, 0.02, 0.025]
    assert list(RetryPolicy(attempts=1).delays()) == []
    for kwargs in ({"attempts": 0}, {"attempts": -1}, {"attempts": 1.5}, {"attempts": True},
                   {"base_delay": -1}, {"multiplier": -2}, {"max_delay": "1"}):
        with pytest.raises(InvalidRequestError):
            RetryPolicy(**kwargs)


# -- the cached planner gives exactly the old planner's batches ---------------------------------

from xavier_async.layout import ALL_LAYERS  # noqa: E402
from xavier_async.planning import Planner  # noqa: E402


def _old(requests, layout, full):
    return [(src, b) for src, plan in normalize(requests, layout).items()
            for b in plan_batches(plan, layout, full)]


def _same_as_old(planner, requests, layout, full):
    try:
        old = _old(requests, layout, full)
    except InvalidRequestError as exc:
        with pytest.raises(InvalidRequestError) as new_exc:
            planner.plan(requests)
        assert str(new_exc.value) == str(exc)        # the same error, word for word
        return None
    new = planner.plan(requests)
    assert [(b.src, b.batch()) for b in new] == old
    assert [b.segments for b in new] == [b.segments for _, b in old]
    assert [b.wire() for b in new] == [b.wire() for _, b in old]
    assert [(b.nbytes, b.useful_bytes) for b in new] == [(b.nbytes, b.useful_bytes) for _, b in old]
    assert [b.blocks for b in new] == [sum(len(s.keys) for s in b.segments) for _, b in old]
    return new


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_cached_planner_equals_old_planner(data):
    nlayers = data.draw(st.integers(1, 5), label="layers")
    layout = CacheLayout.of({i: torch.zeros((16, *data.draw(st.lists(st.integers(1, 6), min_size=1,
                                                                       max_size=2))),
                                            dtype=data.draw(st.sampled_from(DTYPES)))
                             for i in range(nlayers)})
    biggest = max(spec.block_nbytes for spec in layout.layers.values())
    full = data.draw(st.integers(max(1, biggest - 8), 4 * biggest * 16), label="full")
    planner = Planner(layout, full, cache_size=data.draw(st.sampled_from([1, 256])))
    keys = data.draw(st.lists(st.one_of(st.integers(0, 40), st.text(max_size=3), st.binary(max_size=2)),
                              unique=True, min_size=1, max_size=12), label="keys")
    slots = data.draw(st.lists(st.integers(-1, 17), min_size=len(keys), max_size=len(keys)), label="slots")
    blocks = dict(zip(keys, slots))
    form = data.draw(st.sampled_from(["all", "explicit", "subset", "shared", "mixed", "two_sources",
                                      "list"]))
    layers = list(range(nlayers))
    if form == "all":
        req: Any = {3: {ALL_LAYERS: blocks}}
    elif form == "explicit":
        req = {3: {layer: dict(blocks) for layer in layers}}
    elif form == "subset":
        chosen = data.draw(st.lists(st.sampled_from(layers + [99]), unique=True, min_size=1))
        req = {3: {layer: dict(blocks) for layer in chosen}}
    elif form == "shared":  # every layer names the very same dict (its keys checked once)
        chosen = data.draw(st.lists(st.sampled_from(layers + [99]), unique=True, min_size=1))
        req = {3: {layer: blocks for layer in chosen}}
    elif form == "mixed":  # layers differ: the general path
        req = {3: {layer: dict(list(blocks.items())[: 1 + layer]) for layer in layers}}
    elif form == "two_sources":
        req = {3: {0: dict(blocks)}, 4: {0: {k: s + 1 for k, s in blocks.items()}}}
    else:
        req = [{3: {ALL_LAYERS: blocks}}]
    for _ in range(2):  # a miss, then a cache hit: same answer
        _same_as_old(planner, req, layout, full)


def test_cached_planner_reuses_shapes_and_stays_bounded():
    layout = CacheLayout.of({i: torch.zeros(64, 8) for i in range(24)})
    planner = Planner(layout, 1 << 20, cache_size=4)
    for slot in range(10):
        (b,) = planner.plan({1: {layer: {f"h{slot}": slot} for layer in range(24)}})
        assert b.shape is not None and b.keys == (f"h{slot}",) and b.slots == (slot,)
        assert b.wire()[0] == [0, [f"h{slot}"]] and b.wire()[1:] == [[layer, 0] for layer in range(1, 24)]
    assert (planner.misses, planner.hits) == (1, 9)
    for n in range(1, 10):  # more shapes than the cache holds: oldest evicted
        planner.plan({1: {ALL_LAYERS: {k: k for k in range(n)}}})
    assert len(planner._shapes) == 4


def test_a_request_that_fits_one_batch_is_planned_without_a_dummy_request():
    """A new subset of layers (a cache miss) that fits one batch gets its shape directly:
    the same batch as the general planner, and no call of plan_batches."""
    import xavier_async.planning as planning
    layout = CacheLayout.of({i: torch.zeros(64, 8) for i in range(24)})
    planner = Planner(layout, 1 << 20)
    calls = []
    real = planning.plan_batches
    planning.plan_batches = lambda *a: calls.append(a) or real(*a)  # type: ignore[assignment]
    try:
        for layers in ([0, 5, 7], [1, 2], list(range(24)), [23]):
            req = {1: {layer: {"h": 3, "g": 4} for layer in layers}}
            (b,) = planner.plan(req)
            assert b.batch() == _old(req, layout, 1 << 20)[0][1]
    finally:
        planning.plan_batches = real
    assert calls == [] and planner.misses == 4


def test_layers_of_one_block_size_are_shaped_without_a_loop_over_layers():
    """When every layer has the same block size and slot count, a new subset of layers is
    shaped arithmetically (no per-layer walk): the same batch as the general planner;
    layers of different sizes take the per-layer walk and agree too."""
    import xavier_async.planning as planning
    same = CacheLayout.of({i: torch.zeros(64, 8) for i in range(24)})
    mixed = CacheLayout.of({i: torch.zeros(64, 8 + 4 * (i % 2)) for i in range(24)})
    walked = []
    real = Planner._one_batch
    Planner._one_batch = lambda self, *a: walked.append(a) or real(self, *a)  # type: ignore[method-assign]
    try:
        for layout, walks in ((same, False), (mixed, True)):
            planner = Planner(layout, 1 << 20)
            walked.clear()
            for layers in ([0, 5, 7], [1, 2], list(range(24)), [23], ["x"]):
                req = {1: {layer: {"h": 3, "g": 4} for layer in layers}}
                if layers == ["x"]:  # an unknown layer: the general path names it
                    with pytest.raises(InvalidRequestError, match="layer"):
                        planner.plan(req)
                    continue
                (b,) = planner.plan(req)
                assert b.batch() == _old(req, layout, 1 << 20)[0][1]
            assert bool(walked) is walks and planner.misses == 4
    finally:
        Planner._one_batch = real  # type: ignore[method-assign]
    assert planning.Planner._one_batch is real


@pytest.mark.parametrize("req", [
    {1: {0: {"a": 0, "b": 0}}},                  # conflict
    {1: {0: {"a": 99}}},                         # out of range
    {1: {0: {"a": 1.0}}},                        # not an int
    {1: {ALL_LAYERS: {"a": -1}}},
    {1: {"0": {"a": 0}}},                        # unknown layer
    {True: {0: {"a": 0}}},
    {1: {0: {(1,): 0}}},
    {1: {0: {"a": 1}, 1: {"a": True}}},          # equal to the first layer's, but a bool
    {1: {0: {"a": 1}, 1: {"a": 1.0}}},
    {1: {0: {1: 1}, 1: {True: 1}}},              # a bool key equal to 1
    {1: {0: {1: 1}, 1: {1.0: 1}}},
    {1: dict.fromkeys([0, 1], {"a": True})},     # the same dict in every layer: a bool slot
    {1: dict.fromkeys([0, 1], {1.0: 1})},        # ... a float key
])
def test_cached_planner_rejects_what_the_old_one_rejects(req):
    with pytest.raises(InvalidRequestError) as old:
        _old(req, LAYOUT, 1024)
    with pytest.raises(InvalidRequestError) as new:
        Planner(LAYOUT, 1024).plan(req)
    assert str(new.value) == str(old.value)

"""Block loads (issue 24): the binary request for "these keys, in each of these layers",
``Endpoint.load_blocks``, and the source's serve of such a request without a pass over
its layers. Each fast form is held equal to the general one it replaces."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xavier_async import ALL_LAYERS, EndpointConfig, InvalidRequestError, RemoteError
from xavier_async.decision import BlockShapes, ParsedLoad, Refuse, parse_load, slots_of
from xavier_async.layout import CacheLayout
from xavier_async.planning import Planner
from xavier_async.protocol import (MAX_BLOCK_KEYS, BlockLoad, Landed, Load, ProtocolError, decode,
                                   load_wire, pack_layers, packed_keys)

from .conftest import assert_same_bytes, cluster, random_cache, zero_cache

FULL = 4096
LAYOUT = CacheLayout.of({0: torch.zeros(16, 4, dtype=torch.float32),       # 16 B blocks
                         1: torch.zeros(16, 2, 8, dtype=torch.bfloat16),   # 32 B blocks
                         2: torch.zeros(16, 4, dtype=torch.float32),
                         "v": torch.zeros(16, 4, dtype=torch.float32)})    # not an int id


# -- the wire ----------------------------------------------------------------------------------

@given(st.integers(-2**63, 2**63 - 1), st.lists(st.integers(-2**31, 2**31 - 1), max_size=8),
       st.lists(st.integers(0, 2**64 - 1), max_size=8), st.integers(0, 2**64 - 1),
       st.integers(0, 2**32 - 1), st.booleans())
def test_a_block_load_round_trips(req_id, layers, keys, epoch, slab, verify):
    msg = BlockLoad(req_id, tuple(layers), tuple(keys), epoch, slab, verify)
    assert decode(msg.to_wire()) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_after_a_binary_tag_are_a_message_or_a_protocol_error(data):
    for msg in (b"XAB" + data, b"XAD" + data):
        try:
            out = decode(msg)
        except ProtocolError:
            continue
        assert isinstance(out, (BlockLoad, Landed))
        assert decode(out.to_wire()) == out  # what parses is exactly what was sent


def test_a_block_load_whose_length_disagrees_with_its_header_is_refused():
    wire = BlockLoad(1, (0, 1), (5, 6), 0, 0, False).to_wire()
    for bad in (wire[:-1], wire + b"\0", wire[:10]):
        with pytest.raises(ProtocolError):
            decode(bad)
    with pytest.raises(ProtocolError):  # verify is 0 or 1
        decode(wire[:23] + b"\x02" + wire[24:])


def test_what_fits_a_block_load():
    assert pack_layers((0, 1, -5)) is not None
    assert pack_layers((0, "v")) is None and pack_layers((True,)) is None
    assert pack_layers((2**31,)) is None
    assert packed_keys((0, 2**64 - 1)) is not None
    for keys in ((-1,), (2**64,), ("a",), (b"a",), (True,), (1.0,)):
        assert packed_keys(keys) is None, keys
    assert packed_keys(range(MAX_BLOCK_KEYS + 1)) is None
    with pytest.raises(ProtocolError):
        BlockLoad(1, ("v",), (1,)).to_wire()
    with pytest.raises(ProtocolError):
        BlockLoad(1, (0,), ("k",)).to_wire()


# -- the receiver's choice and the source's parse -------------------------------------------

def _requests():
    """Uniform requests (one {key: slot} in every layer named) of int and other keys."""
    int_keys = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6, unique=True)
    other = st.lists(st.one_of(st.integers(-5, -1), st.text(max_size=3)), min_size=1,
                     max_size=3, unique=True)
    layers = st.one_of(st.just(None), st.lists(st.sampled_from([0, 1, 2, "v"]), min_size=1,
                                               max_size=4, unique=True))
    return st.tuples(st.one_of(int_keys, other), layers)


@settings(max_examples=200, deadline=None)
@given(_requests(), st.integers(1, 2**40), st.integers(0, 9), st.integers(0, 3), st.booleans())
def test_a_block_load_is_parsed_into_the_segments_its_json_form_gives(req, req_id, epoch, slab,
                                                                     verify):
    """Whatever form the receiver picks, the source rebuilds the same segments, payload
    and fields; the binary form is picked exactly when keys and layers fit it."""
    keys, layers = req
    planner = Planner(LAYOUT, FULL)
    shapes = BlockShapes(LAYOUT)
    for batch in planner.plan_blocks(1, keys, range(len(keys)), layers):
        wire = load_wire(req_id, batch, epoch, slab, verify)
        msg = decode(wire)
        json_msg = decode(Load.of(req_id, batch, epoch, slab, verify).to_wire())
        fits = (batch.shape is not None and batch.shape.block_layers is not None
                and packed_keys(batch.keys) is not None and batch.shape.fresh == (0,)
                and batch.shape.counts[0] == len(batch.keys))
        assert isinstance(msg, BlockLoad) is fits
        got = parse_load(msg, LAYOUT, FULL, shapes)
        want = parse_load(json_msg, LAYOUT, FULL)
        assert isinstance(got, ParsedLoad) and isinstance(want, ParsedLoad)
        assert got.segments == want.segments
        assert [s[:4] for s in got.segments] == [s[:4] for s in batch.segments]
        assert list(got.segment_items()) == [tuple(s) for s in want.segments]
        assert (got.req_id, got.payload, got.useful, got.epoch, got.slab, got.verify) == (
            want.req_id, want.payload, want.useful, want.epoch, want.slab, want.verify)
        assert got.payload == batch.nbytes


def test_a_block_load_the_source_cannot_serve_is_refused():
    shapes = BlockShapes(LAYOUT)
    for msg, match in ((BlockLoad(1, (0, 9), (1,)), "unknown layer 9"),
                       (BlockLoad(1, (0,), ()), "empty"),
                       (BlockLoad(1, (), (1,)), "empty"),
                       (BlockLoad(1, (0, 1, 2), tuple(range(200))), "exceeds the full slab")):
        out = parse_load(msg, LAYOUT, FULL, shapes)
        assert isinstance(out, Refuse) and match in str(out.error), (msg, out)


def test_block_shapes_are_computed_once_and_stay_bounded():
    shapes = BlockShapes(LAYOUT, size=4)
    first = shapes.shape((0, 1), 3)
    assert shapes.shape((0, 1), 3) is first
    for n in range(1, 10):
        shapes.shape((0,), n)
    assert len(shapes._shapes) == 4


def test_a_block_loads_lookup_equals_the_segment_lookup_and_names_what_is_missing():
    published = {0: {5: 3, 6: 4}, 1: {5: 7, 6: 8}, 2: {5: 1}}
    shapes = BlockShapes(LAYOUT)
    ok = shapes.parse(BlockLoad(1, (0, 1), (5, 6)), FULL)
    assert isinstance(ok, ParsedLoad) and ok.block is not None
    assert slots_of(ok, published) == [(3, 4), (7, 8)]
    assert slots_of(ok, published) == slots_of(ParsedLoad(1, ok.segments, ok.payload, ok.useful),
                                               published)
    missing = shapes.parse(BlockLoad(2, (0, 2), (5, 6)), FULL)
    out = slots_of(missing, published)
    assert isinstance(out, Refuse) and "[6]" in str(out.error) and "layer 2" in str(out.error)


@given(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True),
       st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True),
       st.dictionaries(st.integers(0, 9), st.integers(0, 63), max_size=10))
def test_the_uniform_lookup_of_a_store_equals_the_lookup_per_layer(layers, keys, table):
    """With a snapshot store every layer shares one table: a block load's keys are looked
    up once; the slots, and the refusal of a missing key, are the general lookup's."""
    shared = {layer: table for layer in LAYOUT.layers}
    parsed = BlockShapes(LAYOUT).parse(BlockLoad(1, tuple(layers), tuple(keys)), FULL)
    assert isinstance(parsed, ParsedLoad)
    fast, general = slots_of(parsed, shared, uniform=True), slots_of(parsed, shared)
    if isinstance(general, Refuse):
        assert isinstance(fast, Refuse) and type(fast.error) is type(general.error)
        assert all(str(k) in str(fast.error) for k in keys if k not in table)
    else:
        assert fast == general and len(fast) == len(layers)


# -- the planner's block form ------------------------------------------------------------------

def test_plan_blocks_plans_what_the_mapping_plans():
    planner = Planner(LAYOUT, FULL)
    keys, slots = [7, 3, 9], [0, 5, 2]
    for layers in (None, [0, 2], ["v", 1]):
        request = ({1: {ALL_LAYERS: dict(zip(keys, slots))}} if layers is None
                   else {1: {layer: dict(zip(keys, slots)) for layer in layers}})
        got, want = planner.plan_blocks(1, keys, slots, layers), planner.plan(request)
        assert [b.batch() for b in got] == [b.batch() for b in want]


@pytest.mark.parametrize("args, match", [
    ((1, [1, 2], [0]), "2 keys but 1 slots"),
    ((1, [1, 1], [0, 1]), "named twice"),
    ((1, [1, 2], [0, 0]), "conflicting destinations"),
    ((1, [1], [99]), "out of range"),
    ((1, [1.5], [0]), "block keys must be"),
    ((1, [[1]], [0]), "block keys must be"),
    ((1, "ab", [0, 1]), "sequences"),
    ((1, 5, [0]), "sequences"),
    ((-1, [1], [0]), "source ranks"),
])
def test_plan_blocks_refuses_what_load_refuses(args, match):
    with pytest.raises(InvalidRequestError, match=match):
        Planner(LAYOUT, FULL).plan_blocks(*args)


def test_plan_blocks_refuses_unknown_layers():
    with pytest.raises(InvalidRequestError, match="unknown layer"):
        Planner(LAYOUT, FULL).plan_blocks(1, [1], [0], layers=[0, 7])
    with pytest.raises(InvalidRequestError, match="layer ids"):
        Planner(LAYOUT, FULL).plan_blocks(1, [1], [0], layers="v")


# -- end to end (local transport; tests/test_nixl_process.py runs it over NIXL) ----------------

SLOTS = 32


def _caches(seed: int) -> dict[int, torch.Tensor]:
    return {layer: random_cache(SLOTS, (64,), torch.float32, seed * 10 + layer) for layer in range(4)}


def _zeros() -> dict[int, torch.Tensor]:
    return {layer: zero_cache(SLOTS, (64,), torch.float32) for layer in range(4)}


@pytest.mark.anyio
@pytest.mark.parametrize("store", [True, False])
async def test_load_blocks_lands_the_bytes_load_lands(store):
    cfg = EndpointConfig(full_bytes=16 * 1024, small_bytes=2 * 1024,
                         **({} if store else dict(snapshot_gpu_bytes=0, snapshot_cpu_bytes=0)))
    rng = random.Random(3)
    async with cluster([_zeros(), _caches(1)], cfg) as (a, b):
        await b.publish_blocks(list(range(100, 116)), list(range(16)))
        expected = _caches(1)
        for i in range(30):
            n = rng.randint(1, 6)
            keys = rng.sample(range(100, 116), n)
            dst = rng.sample(range(SLOTS), n)
            layers = None if i % 3 else rng.sample(range(4), rng.randint(1, 4))
            for t in a.caches.values():
                t.zero_()
            r = await a.load_blocks(1, keys, dst, layers=layers)
            assert r.blocks == n * (4 if layers is None else len(layers))
            for layer in (range(4) if layers is None else layers):
                for k, d in zip(keys, dst):
                    assert_same_bytes(a.caches[layer][d], expected[layer][k - 100])
            for layer in set(range(4)) - set(range(4) if layers is None else layers):
                assert not a.caches[layer].any()
        with pytest.raises(RemoteError, match="not published"):
            await a.load_blocks(1, [100, 999], [0, 1])
        with pytest.raises(InvalidRequestError, match="itself"):
            await a.load_blocks(0, [100], [0])
        await b.publish_blocks(["s1", b"b2"], [20, 21])  # keys that travel as a JSON Load
        await a.load_blocks(1, ["s1", b"b2"], [3, 4])
        for layer in range(4):
            assert_same_bytes(a.caches[layer][3], expected[layer][20])
            assert_same_bytes(a.caches[layer][4], expected[layer][21])


@pytest.mark.anyio
async def test_a_one_hash_serve_from_the_store_is_the_general_serve_in_one_run():
    """``SnapshotStore.serve`` of a one-hash block load over every layer in the store's
    order is one run (the store keeps a block's layers in that order); in any other order,
    or for several hashes, it is the general pass. Leases, tiers and bytes are the same."""
    cfg = EndpointConfig(full_bytes=16 * 1024, small_bytes=2 * 1024,
                         snapshot_gpu_bytes=6 * 4 * 256, snapshot_cpu_bytes=10 * 4 * 256)
    async with cluster([_caches(2)], cfg) as (a,):
        await a.publish_blocks(list(range(16)), list(range(16)))
        store, shapes = a._source.store, BlockShapes(a.layout)
        where = {k: store.index.slot(k) for k in range(16)}
        rng = random.Random(5)
        for i in range(60):
            keys = tuple(rng.sample(range(16), 1 if i % 3 else 2))
            layers = tuple(range(4)) if i % 2 else tuple(rng.sample(range(4), rng.randint(1, 4)))
            parsed = shapes.parse(BlockLoad(1, layers, keys), cfg.full_bytes)
            assert isinstance(parsed, ParsedLoad)
            slot_lists = [tuple(where[k] for k in keys) for _ in layers]
            fast_slab, slow_slab = (torch.zeros(16 * 1024, dtype=torch.uint8) for _ in range(2))
            fast = store.serve(fast_slab.data_ptr(), parsed.segment_items(), slot_lists, parsed.block)
            store.release(fast[0])
            slow = store.serve(slow_slab.data_ptr(), parsed.segments, slot_lists)
            store.release(slow[0])
            assert fast[:2] == slow[:2]
            if len(keys) == 1 and layers == tuple(range(4)):
                assert len(fast[2][2]) == 1  # one run
            store.run(fast[2], fast_slab)
            store.run(slow[2], slow_slab)
            assert torch.equal(fast_slab, slow_slab) and fast_slab.any()
        assert store.index.leased == 0

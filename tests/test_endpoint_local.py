"""Endpoints over the in-process transport: real bytes, checked everywhere."""

from __future__ import annotations

import random

import anyio
import pytest
import torch

from xavier_async.bench.raw import copy_raw
from xavier_async._internal import mapped_views

from xavier_async import (ChannelPolicy, EndpointConfig, InvalidRequestError, RemoteError,
                          UnknownPeerError)
from xavier_async.layout import SEGMENT_ALIGN, align_up

from .conftest import (KiB, SMALL_CFG, assert_caches_unchanged, assert_same_bytes, cluster,
                       random_cache, snapshot, zero_cache)

pytestmark = pytest.mark.anyio  # every test runs on asyncio and on trio


def publish_slots(ep, slots, prefix="k"):
    """Publish key ``f"{prefix}{slot}"`` at ``slot`` in every layer."""
    for s in slots:
        ep.publish(f"{prefix}{s}", s)


def check_loaded(dst, src, moves, untouched_before=None):
    """``moves``: {layer: [(dst_slot, src_slot)]}; other slots keep their old bytes."""
    for layer, pairs in moves.items():
        for d, s in pairs:
            assert_same_bytes(dst[layer][d], src[layer][s])
        if untouched_before is not None:
            targeted = {d for d, _ in pairs}
            for slot in range(dst[layer].shape[0]):
                if slot not in targeted:
                    assert_same_bytes(dst[layer][slot], untouched_before[layer][slot])


async def test_single_block_load_moves_exact_bytes():
    src = {0: random_cache(8, (16,), torch.float32, seed=1)}
    dst = {0: random_cache(8, (16,), torch.float32, seed=2)}
    before = snapshot(dst)
    async with cluster([dst, src]) as (a, b):
        b.publish("blk", 5)
        result = await a.load({1: {0: {"blk": 2}}})
    assert result.batches == 1 and result.blocks == 1 and result.useful_bytes == 64
    assert result.wire_bytes == SMALL_CFG.full_bytes          # first small batch: full slab
    check_loaded(dst, src, {0: [(2, 5)]}, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float16])
async def test_dtypes_and_multi_layer_layouts(dtype):
    shapes = {0: (4, 8), 1: (3,), "k": (2, 5, 3), "v": (2, 5, 3)}
    src = {layer: random_cache(32, shape, dtype, seed=i) for i, (layer, shape) in enumerate(shapes.items())}
    dst = {layer: random_cache(24, shape, dtype, seed=100 + i)
           for i, (layer, shape) in enumerate(shapes.items())}
    before = snapshot(dst)
    rng = random.Random(7)
    moves = {}
    request = {}
    for layer in shapes:
        src_slots = rng.sample(range(32), 12)
        dst_slots = rng.sample(range(24), 12)
        moves[layer] = list(zip(dst_slots, src_slots))
        request[layer] = {f"k{s}": d for d, s in moves[layer]}
    async with cluster([dst, src]) as (a, b):
        publish_slots(b, range(32))
        result = await a.load({1: request})
    assert result.blocks == 48
    check_loaded(dst, src, moves, before)


async def test_loads_both_ways_concurrently_do_not_deadlock():
    # 1 KiB + 8 B blocks: a 20-block request needs two batches of the 16 KiB slab
    ca = {0: random_cache(64, (512,), torch.float16, seed=1), 1: random_cache(64, (8,), torch.int8, seed=2)}
    cb = {0: random_cache(64, (512,), torch.float16, seed=3), 1: random_cache(64, (8,), torch.int8, seed=4)}
    orig_a, orig_b = snapshot(ca), snapshot(cb)
    async with cluster([ca, cb]) as (a, b):
        # each side serves its first 32 slots and loads into its last 32
        publish_slots(a, range(32))
        publish_slots(b, range(32))

        async def loader(ep, peer):
            for i in range(32):
                # alternate sizes: single blocks and multi-block (multi-batch) requests
                keys = [f"k{(i + j) % 32}" for j in range(1 if i % 3 else 20)]
                req = {layer: {k: 32 + int(k[1:]) for k in keys} for layer in (0, 1)}
                res = await ep.load({peer: req})
                assert res.batches == (1 if i % 3 else 2)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(loader, a, 1)
                tg.start_soon(loader, b, 0)
    for layer in (0, 1):
        assert_same_bytes(ca[layer][32:], orig_b[layer][:32])
        assert_same_bytes(cb[layer][32:], orig_a[layer][:32])
        assert_same_bytes(ca[layer][:32], orig_a[layer][:32])   # served side untouched
        assert_same_bytes(cb[layer][:32], orig_b[layer][:32])


async def test_many_concurrent_loaders_on_one_endpoint():
    src = {0: random_cache(64, (32,), torch.float32, seed=5)}
    dst = {0: zero_cache(64, (32,), torch.float32)}
    async with cluster([dst, src]) as (a, b):
        publish_slots(b, range(64))
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(a.load, {1: {0: {f"k{i}": 63 - i}}})
    assert_same_bytes(dst[0], src[0].flip(0))


async def test_multi_batch_load_larger_than_the_slab():
    # 2 layers x 40 blocks x 1 KiB = 80 KiB through a 16 KiB slab
    src = {0: random_cache(40, (256,), torch.float32, seed=1), 1: random_cache(40, (512,), torch.bfloat16, seed=2)}
    dst = {0: zero_cache(50, (256,), torch.float32), 1: zero_cache(50, (512,), torch.bfloat16)}
    before = snapshot(dst)
    async with cluster([dst, src]) as (a, b):
        publish_slots(b, range(40))
        req = {layer: {f"k{s}": s + 10 for s in range(40)} for layer in (0, 1)}
        result = await a.load({1: req})
        sent = b.metrics.peer(0)
    assert result.batches == 5 and result.blocks == 80
    assert result.useful_bytes == 80 * KiB
    assert sent.batches_sent == 5 and sent.useful_bytes == 80 * KiB
    assert sent.copies_full == 5 and sent.copies_small == 0   # no batch was split into small ones
    assert result.wire_bytes == 5 * SMALL_CFG.full_bytes
    check_loaded(dst, src, {layer: [(s + 10, s) for s in range(40)] for layer in (0, 1)}, before)


async def test_several_requests_and_sources_in_one_call():
    s1 = {0: random_cache(8, (4,), torch.float32, seed=1)}
    s2 = {0: random_cache(8, (4,), torch.float32, seed=2)}
    dst = {0: zero_cache(8, (4,), torch.float32)}
    before = snapshot(dst)
    async with cluster([dst, s1, s2]) as (a, b, c):
        b.publish("x", 1)
        c.publish("x", 2)       # the same key name on another source is another block
        c.publish(b"\x00raw", 7)
        c.publish(99, 3)
        result = await a.load([{1: {0: {"x": 0}}}, {2: {0: {"x": 4, b"\x00raw": 5}}}, {2: {0: {99: 6}}}])
    assert result.blocks == 4 and result.batches == 2
    assert_same_bytes(dst[0][0], s1[0][1])
    assert_same_bytes(dst[0][4], s2[0][2])
    assert_same_bytes(dst[0][5], s2[0][7])
    assert_same_bytes(dst[0][6], s2[0][3])
    for slot in (1, 2, 3, 7):
        assert_same_bytes(dst[0][slot], before[0][slot])


async def test_one_key_into_several_slots():
    src = {0: random_cache(4, (6,), torch.float16, seed=3), 1: random_cache(4, (2, 2), torch.int8, seed=4)}
    dst = {0: zero_cache(10, (6,), torch.float16), 1: zero_cache(10, (2, 2), torch.int8)}
    before = snapshot(dst)
    async with cluster([dst, src]) as (a, b):
        publish_slots(b, range(4))
        await a.load({1: {0: {"k1": [0, 3, 9], "k2": 4}, 1: {"k3": (2, 5), "k1": [6]}}})
    check_loaded(dst, src, {0: [(0, 1), (3, 1), (9, 1), (4, 2)], 1: [(2, 3), (5, 3), (6, 1)]}, before)


async def test_bf16_moves_all_65536_bit_patterns_exactly():
    expected = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    src = {0: expected.view(torch.bfloat16).reshape(256, 256).clone()}
    dst = {0: torch.zeros(256, 256, dtype=torch.bfloat16)}
    cfg = EndpointConfig(full_bytes=64 * KiB, small_bytes=2 * KiB)   # 512 B blocks, 2 batches
    async with cluster([dst, src], cfg) as (a, b):
        publish_slots(b, range(256))
        result = await a.load({1: {0: {f"k{s}": 255 - s for s in range(256)}}})
        assert result.batches == 2
        got = dst[0].flip(0).reshape(-1).view(torch.int16)
        assert torch.equal(got, expected)
        assert len(set(got.tolist())) == 65536
        # and again through the small view, a few blocks at a time, in place
        for s in range(0, 256, 4):
            res = await a.load({1: {0: {f"k{s + j}": s + j for j in range(4)}}})
            assert res.useful_bytes == 2 * KiB
        assert b.metrics.peer(0).copies_small == 63
    assert torch.equal(dst[0].reshape(-1).view(torch.int16), expected)


def expected_views(sizes, cfg):
    p = ChannelPolicy(cfg.full_bytes, cfg.small_bytes, cfg.streak)
    return [p.select(n) for n in sizes]


@pytest.mark.parametrize("streak", [1, 2, 3])
async def test_view_follows_the_machine_per_peer(streak):
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, streak=streak)
    src = {0: random_cache(64, (256,), torch.uint8, seed=1)}   # 256 B blocks
    dst = {0: zero_cache(64, (256,), torch.uint8)}
    # blocks per load: 1..4 blocks fit the small view (<= 1 KiB), 5+ do not
    pattern = [2, 1, 8, 1, 1, 4, 1, 30, 3, 3, 3, 1, 16, 1, 2]
    async with cluster([dst, src], cfg) as (a, b):
        publish_slots(b, range(64))
        wires, slot = [], 0
        for n in pattern:
            keys = [f"k{(slot + j) % 64}" for j in range(n)]
            res = await a.load({1: {0: {k: int(k[1:]) for k in keys}}})
            wires.append(res.wire_bytes)
            slot += n
        sent, received = b.metrics.peer(0), a.metrics.peer(1)
        want = expected_views([n * 256 for n in pattern], cfg)
        assert wires == want
        assert sent.copies_small == sum(v == cfg.small_bytes for v in want)
        assert sent.copies_full == sum(v == cfg.full_bytes for v in want)
        assert sent.wire_bytes == received.bytes_received == sum(want)
        assert sent.useful_bytes == 256 * sum(pattern)
        assert sent.batches_sent == received.batches_received == len(pattern)
        assert sent.view_switches == sum(x != y for x, y in zip(want, want[1:]))
        ref = ChannelPolicy(cfg.full_bytes, cfg.small_bytes, streak)
        for n in pattern:
            ref.select(n * 256)
        assert b.policy(0).state == ref.state
        assert a.policy(1).state == "full"     # a never wrote to b
    assert_same_bytes(dst[0], src[0])


async def test_channels_are_independent_per_peer():
    caches = [{0: random_cache(16, (64,), torch.int8, seed=i)} for i in range(3)]
    orig = [snapshot(c) for c in caches]
    async with cluster(caches) as (a, b, c):
        publish_slots(c, range(16))
        # a pulls sustained small traffic from c; b pulls one small block
        for s in range(3):
            await a.load({2: {0: {f"k{s}": s}}})
        await b.load({2: {0: {"k3": 3}}})
        assert c.policy(0).state == "small"
        assert c.policy(1).state == "streak_1"
        assert c.metrics.peer(0).copies_small == 2 and c.metrics.peer(1).copies_small == 0
        assert (await a.load({2: {0: {"k4": 4}}})).wire_bytes == SMALL_CFG.small_bytes
        assert (await b.load({2: {0: {"k5": 5}}})).wire_bytes == SMALL_CFG.small_bytes
    for s in (0, 1, 2, 4):
        assert_same_bytes(caches[0][0][s], orig[2][0][s])
    for s in (3, 5):
        assert_same_bytes(caches[1][0][s], orig[2][0][s])


async def test_padded_mode_copies_the_whole_view():
    src = {0: random_cache(8, (100,), torch.uint8, seed=9)}
    dst = {0: zero_cache(8, (100,), torch.uint8)}
    async with cluster([dst, src]) as (a, b):
        publish_slots(b, range(8))
        for s in range(3):
            a.recv_slab.tensor.fill_(0xAB)
            res = await a.load({1: {0: {f"k{s}": s}}})
            view = SMALL_CFG.full_bytes if s == 0 else SMALL_CFG.small_bytes
            assert res.wire_bytes == view
            # the whole view landed: the receive slab equals the sender's view byte for byte
            assert_same_bytes(a.recv_slab.tensor[:view], b.send_slab.tensor[:view])
            assert (a.recv_slab.tensor[view:] == 0xAB).all()
        assert b.metrics.peer(0).wire_bytes == SMALL_CFG.full_bytes + 2 * SMALL_CFG.small_bytes
        assert b.metrics.peer(0).useful_bytes == 300
    assert_same_bytes(dst[0][:3], src[0][:3])


@pytest.mark.parametrize("trim_align", [1, 64, 256])
async def test_trimmed_mode_moves_payload_rounded_up(trim_align):
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, trimmed=True, trim_align=trim_align)
    src = {0: random_cache(64, (100,), torch.uint8, seed=9), 1: random_cache(64, (7,), torch.float16, seed=10)}
    dst = {0: zero_cache(64, (100,), torch.uint8), 1: zero_cache(64, (7,), torch.float16)}
    before = snapshot(dst)
    ref = ChannelPolicy(cfg.full_bytes, cfg.small_bytes, cfg.streak)
    async with cluster([dst, src], cfg) as (a, b):
        publish_slots(b, range(64))
        total_wire = total_useful = 0
        for n in (1, 3, 2, 60, 5, 1, 1):
            req = {0: {f"k{s}": s for s in range(n)}, 1: {f"k{s}": 63 - s for s in range(n)}}
            a.recv_slab.tensor.fill_(0xAB)
            res = await a.load({1: req})
            payload = align_up(100 * n, SEGMENT_ALIGN) + 14 * n     # one batch each
            assert res.batches == 1 and res.useful_bytes == 114 * n
            view = ref.select(payload)
            assert res.wire_bytes == min(view, align_up(payload, trim_align))
            assert (a.recv_slab.tensor[res.wire_bytes:] == 0xAB).all()   # nothing beyond
            total_wire += res.wire_bytes
            total_useful += res.useful_bytes
        m = b.metrics.peer(0)
        assert m.wire_bytes == total_wire and m.useful_bytes == total_useful
        assert m.copies_small == 4 and m.copies_full == 3   # views still chosen by the machine
        assert b.policy(0).state == ref.state == "small"
    moves = {0: [(s, s) for s in range(60)], 1: [(63 - s, s) for s in range(60)]}
    check_loaded(dst, src, moves, before)


async def test_trimmed_wire_bytes_much_smaller_than_padded():
    src = {0: random_cache(16, (64,), torch.float32, seed=1)}
    results = {}
    for trimmed in (False, True):
        cfg = EndpointConfig(full_bytes=64 * KiB, small_bytes=4 * KiB, trimmed=trimmed)
        dst = {0: zero_cache(16, (64,), torch.float32)}
        async with cluster([dst, src], cfg) as (a, b):
            publish_slots(b, range(16))
            for s in range(16):
                await a.load({1: {0: {f"k{s}": s}}})
            results[trimmed] = b.metrics.peer(0).wire_bytes
        assert_same_bytes(dst[0], src[0])
    assert results[False] == 64 * KiB + 15 * 4 * KiB
    assert results[True] == 16 * 256


async def test_unpublished_key_is_refused_and_cache_untouched():
    src = {0: random_cache(8, (32,), torch.float32, seed=1)}
    dst = {0: random_cache(8, (32,), torch.float32, seed=2)}
    before = snapshot(dst)
    async with cluster([dst, src]) as (a, b):
        b.publish("yes", 1)
        with pytest.raises(RemoteError, match="not published"):
            await a.load({1: {0: {"yes": 0, "no": 1}}})
        assert_caches_unchanged(dst, before)
        b.publish("later", 2)
        b.unpublish("later")
        b.unpublish("never-there")
        with pytest.raises(RemoteError):
            await a.load({1: {0: {"later": 0}}})
        assert_caches_unchanged(dst, before)
        assert a.metrics.peer(1).load_errors == 2
        # layer-specific publishing
        b.publish("only0", 3, layers=[0])
        await a.load({1: {0: {"only0": 4, "yes": 5}}})
    assert_same_bytes(dst[0][4], src[0][3])
    assert_same_bytes(dst[0][5], src[0][1])
    for s in (0, 1, 2, 3, 6, 7):
        assert_same_bytes(dst[0][s], before[0][s])


async def test_unknown_peer_and_self_loads_rejected():
    src = {0: random_cache(4, (8,), torch.float32, seed=1)}
    dst = {0: random_cache(4, (8,), torch.float32, seed=2)}
    before = snapshot(dst)
    async with cluster([dst, src]) as (a, b):
        b.publish("k", 0)
        with pytest.raises(UnknownPeerError):
            await a.load({5: {0: {"k": 0}}})
        with pytest.raises(UnknownPeerError):
            await a.load([{1: {0: {"k": 1}}}, {7: {0: {"k": 0}}}])   # nothing moves from 1 either
        with pytest.raises(InvalidRequestError, match="itself"):
            await a.load({0: {0: {"k": 0}}})
        with pytest.raises(UnknownPeerError):
            a.channel(3)
        with pytest.raises(UnknownPeerError):
            await copy_raw(a, 3, 16)
        assert b.metrics.peer(0).batches_sent == 0
        assert_caches_unchanged(dst, before)
        assert a.peers == (1,) and b.peers == (0,)


async def test_publish_validation():
    async with cluster([{0: zero_cache(4, (8,), torch.float32)},
                        {0: zero_cache(4, (8,), torch.float32)}]) as (a, _):
        for key, slot, kw in (("k", 4, {}), ("k", -1, {}), ("k", True, {}), (1.5, 0, {}),
                              ("k", 0, {"layers": [1]}), ((1,), 0, {})):
            with pytest.raises(InvalidRequestError):
                a.publish(key, slot, **kw)


async def test_registrations_flat_after_warm_up():
    src = {0: random_cache(64, (128,), torch.float32, seed=1)}
    dst = {0: zero_cache(64, (128,), torch.float32)}
    expected = dst[0].clone()
    async with cluster([dst, src]) as (a, b):
        publish_slots(b, range(64))
        for s in range(3):   # full, then small: both views are now mapped
            await a.load({1: {0: {f"k{s}": s}}})
        sent = b.metrics.peer(0)
        assert sent.registrations == 2
        assert mapped_views(b.channel(0)) == (SMALL_CFG.small_bytes, SMALL_CFG.full_bytes)
        mem = b.transport.memory_registrations
        # every slab of both pools, and the snapshot store's two tiers, once
        slabs = SMALL_CFG.send_slabs + SMALL_CFG.receive_slabs + 2
        assert mem == slabs and a.transport.memory_registrations == slabs
        rng = random.Random(3)
        for i in range(200):
            n = rng.choice([1, 1, 2, 3, 20])     # alternating small and large batches
            start = rng.randrange(64)
            slots = [(start + j) % 64 for j in range(n)]
            await a.load({1: {0: {f"k{s}": s for s in slots}}})
            for s in slots:
                expected[s] = src[0][s]
        assert sent.registrations == 2
        assert b.transport.memory_registrations == mem
        assert a.recv_slab_stats["registered_since_start"] == 0
        assert sent.copies_small > 50 and sent.copies_full > 20 and sent.view_switches > 20
        assert sent.batches_sent == 203
        assert a.metrics.loads == 203
        snap = b.snapshot_metrics()
        assert snap["registrations"] == slabs + 2 and snap["peers"][0]["registrations"] == 2
        assert snap["total"]["batches_sent"] == 203
    assert_same_bytes(dst[0], expected)


async def test_copy_raw_follows_the_machine_and_moves_the_slab():
    cfg = EndpointConfig(full_bytes=8 * KiB, small_bytes=512)
    caches = [{0: zero_cache(2, (4,), torch.float32)} for _ in range(2)]
    async with cluster(caches, cfg, raw_copies=True) as (a, b):
        a.send_slab.tensor.copy_(torch.randint(0, 256, (8 * KiB,), dtype=torch.uint8,
                                               generator=torch.Generator().manual_seed(1)))
        views = [await copy_raw(a, 1, n) for n in (100, 100, 100, 5000, 512, 1)]
        assert views == [8 * KiB, 512, 512, 8 * KiB, 8 * KiB, 512]
        assert_same_bytes(b.recv_slab.tensor, a.send_slab.tensor)
        m = a.metrics.peer(1)
        assert m.registrations == 2 and m.copies_small == 3 and m.copies_full == 3
        assert m.useful_bytes == 100 * 3 + 5000 + 512 + 1
        for bad in (0, -1, 8 * KiB + 1, True, 1.0):
            with pytest.raises(InvalidRequestError):
                await copy_raw(a, 1, bad)


async def test_copy_raw_needs_the_peers_consent():
    caches = [{0: zero_cache(2, (4,), torch.float32)} for _ in range(2)]
    async with cluster(caches) as (a, b):
        before = b.recv_slab.tensor.clone()
        with pytest.raises(InvalidRequestError, match="raw copies"):
            await copy_raw(a, 1, 16)
        assert_same_bytes(b.recv_slab.tensor, before)


async def test_disconnect_drops_the_peer_on_both_ends_and_reconnecting_works():
    src = {0: random_cache(4, (8,), torch.float32, seed=3)}
    dst = {0: zero_cache(4, (8,), torch.float32)}
    async with cluster([src, dst]) as (a, b):
        a.publish("k", 2)
        await b.load({0: {0: {"k": 1}}})
        await b.disconnect(0)
        await b.disconnect(0)                          # idempotent
        assert b.peers == () and a.peers == ()
        with pytest.raises(UnknownPeerError):
            await b.load({0: {0: {"k": 3}}})
        assert await b.connect(a.address) == 0
        assert await b.connect(a.address) == 0         # already connected: its rank
        await b.load({0: {0: {"k": 3}}})
        assert_same_bytes(dst[0][1], src[0][2])
        assert_same_bytes(dst[0][3], src[0][2])
        for bad in (-1, True, "0"):
            with pytest.raises(InvalidRequestError):
                await b.disconnect(bad)
        for bad in (0, -1.0, True):
            with pytest.raises(InvalidRequestError):
                await b.connect(a.address, timeout=bad)


async def test_all_layers_loads_every_layer_and_numpy_or_torch_slots_are_ints():
    from xavier_async import ALL_LAYERS
    np = pytest.importorskip("numpy")
    src = {layer: random_cache(6, (8,), torch.bfloat16, seed=10 + layer) for layer in range(3)}
    dst = {layer: zero_cache(6, (8,), torch.bfloat16) for layer in range(3)}
    async with cluster([src, dst]) as (a, b):
        a.publish("k", np.int64(4))                  # published in every layer by default
        a.publish("j", torch.tensor(1))
        r = await b.load({0: {ALL_LAYERS: {"k": np.int32(2), "j": [torch.tensor(5)]}}})
        assert r.blocks == 6
        for layer in range(3):
            assert_same_bytes(dst[layer][2], src[layer][4])
            assert_same_bytes(dst[layer][5], src[layer][1])
        with pytest.raises(InvalidRequestError, match="conflicting"):
            await b.load({0: {ALL_LAYERS: {"k": 0}, 1: {"j": 0}}})
        for bad in (np.float32(1), torch.tensor(1.0), True):
            with pytest.raises(InvalidRequestError):
                await b.load({0: {ALL_LAYERS: {"k": bad}}})

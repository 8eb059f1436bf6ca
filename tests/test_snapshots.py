"""The snapshot store in an endpoint (:mod:`xavier_async.snapshots`): published blocks are
copied out of the engine's slots, so the engine may overwrite them at once; small budgets
force demotion and eviction, reported at publish time; leases pin what a copy reads; every
load's bytes are checked against what was published, never against the live slots."""

from __future__ import annotations

import random

import anyio
import pytest
import torch

from xavier_async import (EndpointConfig, InvalidRequestError, LocalFabric, LocalTransport,
                          PeerLostError, PublishResult, RemoteError)
from xavier_async.testing import FaultyTransport

from .conftest import assert_same_bytes, cluster, random_cache, zero_cache

pytestmark = pytest.mark.anyio

KiB = 1024
SLOTS, LAYERS = 32, 3
BLOCK = 256 * 4                              # [256] float32: 1 KiB a layer, 3 KiB a block


def _caches(seed: int) -> dict[int, torch.Tensor]:
    return {layer: random_cache(SLOTS, (256,), torch.float32, seed * 10 + layer) for layer in range(LAYERS)}


def _zeros() -> dict[int, torch.Tensor]:
    return {layer: zero_cache(SLOTS, (256,), torch.float32) for layer in range(LAYERS)}


def _cfg(device_blocks: int, host_blocks: int, **kw) -> EndpointConfig:
    return EndpointConfig(full_bytes=16 * KiB, small_bytes=2 * KiB,
                          snapshot_gpu_bytes=device_blocks * LAYERS * BLOCK,
                          snapshot_cpu_bytes=host_blocks * LAYERS * BLOCK, **kw)


def _all_layers(key, slot: int) -> dict[int, dict]:
    return {layer: {key: slot} for layer in range(LAYERS)}


async def _idle(ep) -> None:
    """Once the source's last reply has gone out (its task ends after the loader got it),
    nothing may be lent, leased or awaited."""
    with anyio.fail_after(5):
        while ep.recv_slab_stats["sends_in_use"] or ep._source.store.index.leased:
            await anyio.sleep(0.005)
    ep.check_invariants(idle=True)


def _expect(published: dict, key, slot: int, dst: dict[int, torch.Tensor]) -> None:
    for layer in range(LAYERS):
        assert_same_bytes(dst[layer][slot], published[key][layer])


async def test_the_engine_may_overwrite_a_published_slot_at_once():
    """The slot-reuse contract: once publish_blocks returns the engine's slots are free;
    loads return the bytes as published, not what the slots hold now."""
    src = _caches(1)
    async with cluster([_zeros(), src], _cfg(8, 8)) as (a, b):
        snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in range(4)}
        result = await b.publish_blocks(list(range(4)), list(range(4)))
        assert result == PublishResult(available=(0, 1, 2, 3))
        for t in src.values():
            t[:4].copy_(torch.randn(4, 256))               # the engine reuses the slots
        out = await a.load({1: {layer: {k: 10 + k for k in range(4)} for layer in range(LAYERS)}})
        for k in range(4):
            _expect(snap, k, 10 + k, a.caches)
        assert out.device_tier_blocks == 4 * LAYERS and out.host_tier_blocks == 0


async def test_without_a_store_blocks_are_served_from_the_live_slots():
    src = _caches(2)
    cfg = _cfg(0, 0)
    async with cluster([_zeros(), src], cfg) as (a, b):
        b.publish(5, 5)
        src[0][5].fill_(7.0)                               # served from the slot itself
        out = await a.load({1: {0: {5: 1}}})
        assert_same_bytes(a.caches[0][1], torch.full((256,), 7.0))
        assert out.device_tier_blocks == out.host_tier_blocks == 0
        assert b.recv_slab_stats["snapshot_tiers"] == 0


async def test_small_budgets_demote_evict_and_skip_and_say_so():
    """Two device slots and two host slots: a third block demotes the least recently used;
    a fifth drops one (evicted, reported); loads of demoted blocks come from the host tier;
    an evicted key is refused, nothing written; with every slot leased (a copy reads all
    four blocks) a new block finds no room: skipped and said so, by ``publish_blocks`` and
    ``publish`` alike, counted, not loadable, and nothing stored moved."""
    src = _caches(3)
    wrap = {1: lambda f: FaultyTransport(LocalTransport(f))}
    async with cluster([_zeros(), src], _cfg(2, 2), wrap=wrap) as (a, b):
        snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in range(6)}
        r1 = await b.publish_blocks([0, 1], [0, 1])
        await a.load({1: _all_layers(0, 20)})              # 0 used: 1 is the LRU now
        r2 = await b.publish_blocks([2], [2])
        assert r1.available == (0, 1) and r2.demoted == (1,) and r2.evicted == ()
        r3 = await b.publish_blocks([3, 4], [3, 4])
        assert set(r3.demoted) <= {0, 2} and len(r3.evicted) == 1 and r3.available == (3, 4)
        out = await a.load({1: _all_layers(1, 21)})        # 1 lives in the host tier
        _expect(snap, 1, 21, a.caches)
        assert out.host_tier_blocks == LAYERS and out.device_tier_blocks == 0
        gone = r3.evicted[0]
        with pytest.raises(RemoteError, match="not published"):
            await a.load({1: _all_layers(gone, 22)})
        assert not a.caches[0][22].any()
        for k in (3, 4) + tuple(k for k in (0, 2) if k != gone):
            await a.load({1: _all_layers(k, 23)})
            _expect(snap, k, 23, a.caches)
        stats = b.snapshot_metrics()["snapshot"]
        assert stats["device_used"] == 2 and stats["host_used"] == 2 and stats["evicted"] == 1
        assert stats["skipped"] == 0 and all(r.skipped == () for r in (r1, r2, r3))
        # every slot leased: one copy reads all four stored blocks and is held in flight
        stored = [k for k in range(5) if k != gone]
        index = b._source.store.index
        held = b.transport
        held.hold_next_writes(1)
        all_four = {1: {layer: {k: 24 + i for i, k in enumerate(stored)} for layer in range(LAYERS)}}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.load, all_four)
                try:
                    await held.wait_stalled(1)
                    assert index.leased == index.device_slots + index.host_slots == 4
                    where = {k: index.slot(k) for k in stored}
                    r5 = await b.publish_blocks([5], [5])
                    assert r5.skipped == (5,) and r5.available == r5.evicted == r5.demoted == ()
                    r6 = b.publish(6, 5)
                    assert r6.skipped == (6,) and r6.available == r6.evicted == r6.demoted == ()
                    assert {k: index.slot(k) for k in stored} == where  # nothing stored moved
                finally:
                    held.release_held()                     # a failed check must not hang
        for i, k in enumerate(stored):                              # the held copy landed
            _expect(snap, k, 24 + i, a.caches)
        for skipped in (5, 6):
            with pytest.raises(RemoteError, match="not published"):
                await a.load({1: _all_layers(skipped, 28)})
            assert not a.caches[0][28].any()
        stats = b.snapshot_metrics()["snapshot"]
        assert stats["skipped"] == 2 and stats["evicted"] == 1, stats
        await _idle(b)


async def test_a_block_being_served_is_never_evicted_nor_demoted():
    """A copy reading block 0 is held in flight: publishing past both budgets moves every
    other block but not that one; it lands exactly, and once its copy is terminal it may
    go."""
    src = _caches(4)
    wrap = {1: lambda f: FaultyTransport(LocalTransport(f))}
    async with cluster([_zeros(), src], _cfg(1, 1), wrap=wrap) as (a, b):
        held = b.transport
        snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in range(4)}
        await b.publish_blocks([0], [0])
        held.hold_next_writes(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.load, {1: _all_layers(0, 10)})
            await held.wait_stalled(1)                     # the copy of block 0 is in flight
            r = await b.publish_blocks([1, 2], [1, 2])     # 0 leased: only the host tier moves
            assert 0 not in r.evicted and 0 not in r.demoted
            assert b._source.store.index.slot(0) == 0
            held.release_held()
        _expect(snap, 0, 10, a.caches)
        assert b._source.store.index.leased == 0           # released with the copy
        r = await b.publish_blocks([3], [3])               # now block 0 may move
        assert 0 in r.demoted + r.evicted
        await _idle(b)


async def test_publish_checks_everything_before_anything_moves():
    src = _caches(5)
    async with cluster([_zeros(), src], _cfg(4, 4)) as (a, b):
        for keys, slots in (([0, 1], [0]), ([0, 0], [1, 2]), ([0, [1]], [1, 2]), ([0, 1], [1, 99]),
                            ([0, 1], [1, -1]), ([0, 1.5], [1, 2])):
            with pytest.raises(InvalidRequestError):
                await b.publish_blocks(keys, slots)
        assert b.snapshot_metrics()["snapshot"]["stored"] == 0
        with pytest.raises(InvalidRequestError, match="whole blocks"):
            b.publish(7, 7, layers=[0])
        with pytest.raises(InvalidRequestError, match="whole blocks"):
            b.unpublish(7, layers=[0])
        assert b.publish(7, 7).available == (7,)
        b.unpublish(7)
        with pytest.raises(RemoteError):
            await a.load({1: {0: {7: 1}}})


async def test_publishing_before_start_and_a_single_block_at_a_time():
    src = _caches(6)
    fabric = LocalFabric()
    from xavier_async import Endpoint
    b = Endpoint(1, src, fabric.transport(), _cfg(2, 2))
    assert b.publish(3, 3).available == (3,)               # before async with: staged now
    snap = {layer: src[layer][3].clone() for layer in range(LAYERS)}
    for t in src.values():
        t[3].zero_()
    async with Endpoint(0, _zeros(), fabric.transport(), _cfg(2, 2)) as a, b:
        await a.connect(b.address)
        await a.load({1: _all_layers(3, 4)})
        _expect({3: snap}, 3, 4, a.caches)


async def test_a_flood_of_publishes_past_both_budgets_while_peers_load():
    """Two loaders load while the source publishes 4x more blocks than its tiers hold (the
    engine rewriting its slots after every publish, as a serving engine does). Every load
    that succeeds holds exactly the bytes published under its key; a load of an evicted
    key is refused and writes nothing."""
    rng = random.Random(11)
    src = _caches(7)
    published: dict[int, dict[int, torch.Tensor]] = {}
    outcomes = {"ok": 0, "refused": 0}
    async with cluster([_zeros(), src, _zeros()], _cfg(4, 4)) as (a, b, c):
        live: list[int] = []

        async def publisher() -> None:
            for key in range(32):
                slot = key % 8
                for layer in range(LAYERS):                # the engine writes this block
                    src[layer][slot].copy_(torch.randn(256, generator=torch.Generator().manual_seed(key * 7 + layer)))
                published[key] = {layer: src[layer][slot].clone() for layer in range(LAYERS)}
                r = await b.publish_blocks([key], [slot])
                live.extend(r.available)
                for gone in r.evicted:
                    live.remove(gone)
                await anyio.sleep(0)

        async def loader(ep, base: int) -> None:
            for i in range(60):
                if not live:
                    await anyio.sleep(0.001)
                    continue
                key, dst = rng.choice(live), base + i % 10
                for t in ep.caches.values():
                    t[dst].zero_()
                try:
                    await ep.load({1: _all_layers(key, dst)})
                except RemoteError:
                    outcomes["refused"] += 1
                    assert not any(ep.caches[layer][dst].any() for layer in range(LAYERS))
                    continue
                _expect(published, key, dst, ep.caches)
                outcomes["ok"] += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher)
            tg.start_soon(loader, a, 0)
            tg.start_soon(loader, c, 10)
        stats = b.snapshot_metrics()["snapshot"]
        assert stats["evicted"] > 0 and stats["demoted"] > 0, stats
        assert outcomes["ok"] > 0, outcomes
        await _idle(b)


async def test_close_waits_for_the_copies_that_read_the_store():
    src = _caches(8)
    wrap = {1: lambda f: FaultyTransport(LocalTransport(f))}
    async with cluster([_zeros(), src], _cfg(2, 2), wrap=wrap) as (a, b):
        held = b.transport
        await b.publish_blocks([0], [0])
        held.hold_next_writes(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.load, {1: _all_layers(0, 1)})
            await held.wait_stalled(1)
            assert b._source.store.index.leased == 1
            tg.start_soon(b.aclose)                        # drains: the copy finishes first
            await anyio.sleep(0.01)
            assert b._source.store.index.leased == 1
            held.release_held()
        assert b._source.store.index.leased == 0


async def test_a_staging_failure_drops_only_the_blocks_it_concerns(monkeypatch):
    """The copy of block 2 fails (injected): its one-pass staging is retried block by
    block; 2 is reported failed and not published, the others are, with their bytes."""
    from xavier_async.snapshots import SnapshotStore
    src = _caches(9)
    async with cluster([_zeros(), src], _cfg(8, 8)) as (a, b):
        bad = {src[layer][2].data_ptr() for layer in range(LAYERS)}
        real = SnapshotStore._copy

        async def flaky(self, table):
            if bad & set(table[1]):
                raise RuntimeError("device copy failed (injected)")
            await real(self, table)

        monkeypatch.setattr(SnapshotStore, "_copy", flaky)
        snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in range(4)}
        r = await b.publish_blocks([0, 1, 2, 3], [0, 1, 2, 3])
        assert r.available == (0, 1, 3) and r.failed == (2,)
        for k in (0, 1, 3):
            await a.load({1: _all_layers(k, 10 + k)})
            _expect(snap, k, 10 + k, a.caches)
        with pytest.raises(RemoteError):
            await a.load({1: _all_layers(2, 12)})
        await _idle(b)


async def test_a_peer_lost_mid_serve_releases_its_leases():
    src = _caches(10)
    wrap = {1: lambda f: FaultyTransport(LocalTransport(f))}
    async with cluster([_zeros(), src], _cfg(2, 2, request_timeout=5.0), wrap=wrap) as (a, b):
        held = b.transport
        await b.publish_blocks([0], [0])
        held.hold_next_writes(1)
        async with anyio.create_task_group() as tg:
            async def load() -> None:
                with pytest.raises(PeerLostError):
                    await a.load({1: _all_layers(0, 1)})
            tg.start_soon(load)
            await held.wait_stalled(1)
            assert b._source.store.index.leased == 1
            held.lose_peer(0)                               # the loader is gone mid-copy
            held.release_held()
        await _idle(b)


async def test_one_block_over_every_layer_is_written_straight_from_the_store():
    """One block hash over every layer is one region of the store: it is written straight
    into the peer's receive slab, no gather; two hashes are gathered (layer-major in the
    slab); with direct_write_regions=0 everything is gathered. Bytes exact every time."""
    src = _caches(11)
    for regions, expect_direct in ((1, [1, 1, 0]), (0, [0, 0, 0])):
        async with cluster([_zeros(), src], _cfg(8, 8, direct_write_regions=regions)) as (a, b):
            snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in range(4)}
            await b.publish_blocks([0, 1, 2, 3], [0, 1, 2, 3])
            seen = []
            for req, checks in (({1: _all_layers(0, 10)}, [(0, 10)]),
                                ({1: {0: {1: 11}}}, []),                      # one layer, one key
                                ({1: {layer: {2: 12, 3: 13} for layer in range(LAYERS)}},
                                 [(2, 12), (3, 13)])):
                before = b._source.direct_writes
                await a.load(req)
                seen.append(b._source.direct_writes - before)
                for key, slot in checks:
                    _expect(snap, key, slot, a.caches)
            assert_same_bytes(a.caches[0][11], snap[1][0])
            assert seen == expect_direct, seen


async def test_a_serves_single_pass_matches_the_store_table_and_the_tiers():
    """``SnapshotStore.serve`` (the source's one pass per serve) leases exactly the slots
    read, counts each tier's (layer, key) pairs, and gathers through the same runs as
    ``StoreTable.pack_table``, for random batches over both tiers."""
    from xavier_async.planning import Segment

    rng = random.Random(7)
    async with cluster([_caches(1)], _cfg(device_blocks=6, host_blocks=10)) as (a,):
        await a.publish_blocks(list(range(16)), list(range(16)))
        store = a._source.store
        where = {k: store.index.slot(k) for k in range(16)}
        assert any(s < store.index.device_slots for s in where.values())
        assert any(s >= store.index.device_slots for s in where.values())
        for i in range(200):
            keys = tuple(rng.sample(range(16), 16 if i % 10 == 0 else rng.randint(1, 5)))
            layers = rng.sample(range(LAYERS), rng.randint(1, LAYERS))
            segs, off = [], 0
            for layer in layers:
                segs.append(Segment(layer, keys, off, 1024))
                off += 1024 * len(keys)
            slot_lists = [[where[k] for k in keys] for _ in layers]
            leased, tiers, table = store.serve(1 << 20, segs, slot_lists)
            try:
                assert sorted(leased) == sorted({where[k] for k in keys})
                assert all(store.index.is_leased(s) for s in leased)
                host = sum(1 for k in keys if where[k] >= store.index.device_slots) * len(layers)
                assert tiers == (len(keys) * len(layers) - host, host)
                runs = store.table.pack_table(1 << 20, segs, slot_lists)
                if len(keys) < store.VECTOR_FROM:
                    assert table == runs
                else:  # laid out by numpy: one run per block, the same bytes
                    assert sorted(zip(*(list(map(int, x)) for x in table))) == sorted(
                        (d + k * 1024, s + k * 1024, 1024) for d, s, n in zip(*runs)
                        for k in range(n // 1024))
                assert sum(map(int, table[2])) == off
            finally:
                store.release(leased)
        assert store.index.leased == 0


@pytest.mark.parametrize("tiers", [(16, 0), (0, 16), (6, 10)])
async def test_a_host_gather_of_many_rows_moves_the_bytes_memmoves_would(tiers):
    """On the CPU a gather of many equal runs from one tier is one ``index_select``
    (``SnapshotStore._gather_rows``); its slab bytes equal the memmove path's, and a table
    over both tiers, or too short, falls back to memmoves."""
    from xavier_async.packing import run_host
    from xavier_async.planning import Segment

    async with cluster([_caches(2)], _cfg(device_blocks=tiers[0], host_blocks=tiers[1])) as (a,):
        await a.publish_blocks(list(range(16)), list(range(16)))
        store = a._source.store
        keys = tuple(range(16))
        segs = [Segment(layer, keys, layer * 16 * 1024, 1024) for layer in range(LAYERS)]
        slot_lists = [[store.index.slot(k) for k in keys] for _ in range(LAYERS)]
        fast, slow = (torch.zeros(LAYERS * 16 * 1024 + 4096, dtype=torch.uint8) for _ in range(2))
        leased, _, table = store.serve(fast.data_ptr() + 4096 - 1024 * 4, segs, slot_lists)
        store.release(leased)
        table_slow = store.table.pack_table(slow.data_ptr() + 4096 - 1024 * 4, segs, slot_lists)
        one_tier = 0 in tiers
        assert store._gather_rows(table, fast) is one_tier
        if not one_tier:
            store.run(table, fast)  # the memmoves, from the numpy table
        run_host(table_slow)
        assert torch.equal(fast, slow) and fast.any()
        assert store._gather_rows((table[0][:8], table[1][:8], table[2][:8]), fast) is False


@pytest.mark.parametrize("tiers", [(16, 0), (6, 10)])
@pytest.mark.parametrize("parts", [1, 2, 3])
async def test_a_host_gather_cut_into_parts_moves_the_bytes_the_whole_does(tiers, parts):
    """``SnapshotStore.gathers``: at most ``parts`` copies (row ranges of the one
    ``index_select``, or pieces of the memmoves over both tiers) that together write the
    slab as one :meth:`~SnapshotStore.run` does."""
    from xavier_async.planning import Segment

    async with cluster([_caches(2)], _cfg(device_blocks=tiers[0], host_blocks=tiers[1])) as (a,):
        await a.publish_blocks(list(range(16)), list(range(16)))
        store = a._source.store
        keys = tuple(range(16))
        segs = [Segment(layer, keys, layer * 16 * 1024, 1024) for layer in range(LAYERS)]
        slot_lists = [[store.index.slot(k) for k in keys] for _ in range(LAYERS)]
        cut, whole = (torch.zeros(LAYERS * 16 * 1024, dtype=torch.uint8) for _ in range(2))
        out = []
        for slab in (cut, whole):
            leased, _, table = store.serve(slab.data_ptr(), segs, slot_lists)
            store.release(leased)
            out.append(table)
        copies = store.gathers(out[0], cut, parts)
        assert len(copies) == parts
        if parts > 1:  # one tier: row ranges of one index_select; both tiers: memmoves
            assert all((c.func is torch.index_select) is (0 in tiers) for c in copies)
        for copy in reversed(copies):  # in any order: the parts are disjoint
            copy()
        store.run(out[1], whole)
        assert torch.equal(cut, whole) and cut.any()


async def test_a_large_batch_under_a_high_direct_write_cap_lands_exactly():
    """A batch of 16 hashes (one copy: the slab holds all 48 KiB) is laid out by numpy,
    one run per block and layer (48): with ``direct_write_regions`` above that it is
    written straight from the store, and with it below, gathered; the bytes are the
    published ones both ways."""
    src = _caches(12)
    keys = list(range(16))
    for regions, direct in ((64, 1), (8, 0)):
        cfg = EndpointConfig(full_bytes=64 * KiB, small_bytes=2 * KiB, direct_write_regions=regions,
                             snapshot_gpu_bytes=16 * LAYERS * BLOCK, snapshot_cpu_bytes=0)
        async with cluster([_zeros(), src], cfg) as (a, b):
            snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in keys}
            await b.publish_blocks(keys, keys)
            before = b._source.direct_writes
            await a.load({1: {layer: {k: k + 16 for k in keys} for layer in range(LAYERS)}})
            assert b._source.direct_writes - before == direct
            for k in keys:
                _expect(snap, k, k + 16, a.caches)


async def test_direct_write_regions_defaults_by_the_caches_memory():
    """Left to the default, a source on host memory always gathers (a direct write loses
    there at one region), one on a GPU writes up to GPU_DIRECT_WRITE_REGIONS regions
    straight from the store; a value given is used as given, and a bad one refused."""
    from xavier_async.config import GPU_DIRECT_WRITE_REGIONS, direct_write_regions_for

    assert EndpointConfig().direct_write_regions is None
    assert direct_write_regions_for(None, "cpu") == 0
    assert direct_write_regions_for(None, "cuda") == GPU_DIRECT_WRITE_REGIONS == 2
    assert direct_write_regions_for(5, "cpu") == direct_write_regions_for(5, "cuda") == 5
    with pytest.raises(InvalidRequestError):
        EndpointConfig(direct_write_regions=-1)
    src = _caches(13)
    async with cluster([_zeros(), src], _cfg(8, 8)) as (a, b):   # the default, on the CPU
        await b.publish_blocks([0], [0])
        await a.load({1: _all_layers(0, 10)})
        assert b._source.direct_writes == 0
        _expect({0: {layer: src[layer][0] for layer in range(LAYERS)}}, 0, 10, a.caches)


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of ``t``'s memory, by ``mincore(2)``."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    n = (t.data_ptr() + t.numel() * t.element_size() - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), n


def _trim_heap() -> None:
    import ctypes
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@pytest.mark.parametrize("prefault", [False, True])
async def test_snapshot_prefault_touches_the_tiers_at_start_and_keeps_the_bytes(prefault):
    """``snapshot_prefault``: both tiers' pages are resident before any publish (no
    first-touch page fault in a publish); without it the untouched tiers stay mostly
    unbacked. Loads still return the published bytes."""
    src = _caches(3)
    big = 16384   # blocks a tier: 48 MiB
    caches, cfg = [_zeros(), src], _cfg(big, big, snapshot_prefault=prefault)
    # glibc serves a large request from free heap memory when it has that much, touched
    # by earlier tests (their frees raise its mmap and trim thresholds): hand that memory
    # back first (malloc_trim drops free pages), so that an untouched tier is unbacked.
    _trim_heap()
    async with cluster(caches, cfg) as (a, b):
        store = b._source.store
        for pool in (store.device_pool, store.host_pool):
            resident, total = _resident_pages(pool)
            if prefault:
                assert resident == total
            else:
                assert resident < total // 2
        snap = {k: {layer: src[layer][k].clone() for layer in range(LAYERS)} for k in range(4)}
        await b.publish_blocks(list(range(4)), list(range(4)))
        await a.load({1: {layer: {k: 20 + k for k in range(4)} for layer in range(LAYERS)}})
        for k in range(4):
            _expect(snap, k, 20 + k, a.caches)


def test_snapshot_prefault_must_be_a_bool():
    with pytest.raises(InvalidRequestError, match="snapshot_prefault"):
        EndpointConfig(snapshot_prefault="yes")

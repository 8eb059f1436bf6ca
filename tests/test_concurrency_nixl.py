"""Many loads in flight over real NIXL: a loader and two source processes (issue 11).
Every load's bytes are checked; no endpoint's background task may crash, and no load may
fail with ``InternalError`` (a library bug, however well contained)."""

from __future__ import annotations

import os
import random

import anyio
import pytest
import torch

pytest.importorskip("nixl")

from xavier_async import Endpoint, EndpointConfig, InternalError, XavierError  # noqa: E402
from xavier_async.testing.invariants import task_crashes  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec,  # noqa: E402
                                               check_loaded, pattern_caches, zero_slots)
from xavier_async.testing.devices import peer_device  # noqa: E402
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

from .conftest import KiB  # noqa: E402

K, S = 4, 4   # the default pools
T = 2         # the snapshot store's tiers, registered once at start

#: XAVIER_TEST_DEVICE=cuda: the loader on GPU 0, both sources on GPU 1 (as in test_nixl_process;
#: with one GPU all on it: testing.devices.peer_device)
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and torch.cuda.device_count() < 1:
    pytest.skip("XAVIER_TEST_DEVICE=cuda needs a GPU", allow_module_level=True)
HERE, THERE = peer_device(0, DEVICE).device, peer_device(1, DEVICE).device
SPEC = LayoutSpec(layers=2, num_slots=64, block_shape=(4, 64), dtype="bfloat16")  # 512 B blocks
NCFG = dict(full_bytes=16 * KiB, small_bytes=1 * KiB)
SEED = 13


@pytest.mark.asyncio
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "one_small_round_trip"])
async def test_nixl_many_loads_in_flight_from_two_processes(capped):
    """16 concurrent loads (small and large) at a time from two source processes, whose
    writes are slowed so that copies overlap (and batches that wait for a slab are
    merged); every block checked; S + K (+ the store's tiers) registrations on every endpoint and none after
    the warm-up. Capped (``small_round_trips=1``): never more than one small round trip
    per source in flight, and the waiting small batches merge."""
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2)}
    local = {layer: t.zero_() for layer, t in pattern_caches(SPEC, 0, SEED, HERE).items()}
    slow = {"write_stall_rate": 1.0, "stall_seconds": 0.02}
    procs = [PeerProcess(PeerSpec(rank=r, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1,
                                  faults=slow, device=THERE)) for r in (1, 2)]
    try:
        cfg = EndpointConfig(**NCFG, small_round_trips=1 if capped else None)
        async with Endpoint(0, local, NixlTransport(), cfg) as ep:
            for p in procs:
                await ep.connect(p.address)
            assert ep.transport.memory_registrations == S + K + T
            rng = random.Random(3)
            peak = lanes_peak = 0

            async def one(i: int) -> None:
                src = 1 + i % 2
                n = rng.choice([1, 2, 4])           # 512 B, 1 KiB: small; 4 KiB: large
                keys = rng.sample(range(SPEC.num_slots), n)
                layers = range(SPEC.layers) if n == 4 else [0]
                request = {src: {layer: {k: 4 * i + j for j, k in enumerate(keys)} for layer in layers}}
                zero_slots(ep.caches, request)
                await ep.load(request)
                assert check_loaded(ep.caches, request, expected) > 0

            async def watch() -> None:
                nonlocal peak, lanes_peak
                while True:
                    peak = max(peak, ep.recv_slab_stats["in_use"])
                    lanes_peak = max([lanes_peak, *(lanes.held for lanes in ep._receiver.scheduler.lanes.values())])
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as outer:
                outer.start_soon(watch)
                for _ in range(4):
                    async with anyio.create_task_group() as tg:
                        for i in range(16):
                            tg.start_soon(one, i)
                outer.cancel_scope.cancel()
            assert peak >= 2, peak                  # loads really were in flight together
            assert lanes_peak == (1 if capped else 0), lanes_peak   # the cap, held to
            assert ep.transport.memory_registrations == S + K + T
            merged = 0
            for p in procs:
                m = await anyio.to_thread.run_sync(p.call, "metrics", None)
                assert m["memory_registrations"] == S + K + T
                mine = ep.metrics.peer(p.spec.rank)
                # 32 batches from each source: each its own copy, or merged into another's
                assert m["total"]["batches_sent"] == mine.batches_received
                assert mine.batches_received + mine.batches_merged == 32
                merged += mine.batches_merged
                assert await anyio.to_thread.run_sync(p.task_crashes) == 0
            assert merged > 0                       # batches that waited went out together
        assert task_crashes(ep) == 0
    finally:
        for p in procs:
            p.close()


def _untouched(caches, request) -> bool:
    """Every destination slot of ``request`` still holds zeros."""
    return all(not caches[layer][slot].any() for layers in request.values()
               for layer, blocks in layers.items() for slot in blocks.values())


@pytest.mark.asyncio
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "one_small_round_trip"])
async def test_nixl_concurrent_loads_under_injected_faults_never_write_a_wrong_byte(capped):
    """Rounds of 16 concurrent loads from two source processes whose transports fail and
    stall writes at random, with some loads cancelled after a random short delay, so that
    merged groups meet failures and cancellations. Every load that returns has exactly the
    source's bytes; every load that fails left its slots untouched; a cancelled load either
    left them untouched or completed (never a mix, never a wrong byte). Capped
    (``small_round_trips=1``), loads also wait for, and are cancelled while waiting for,
    their source's small round trip; afterwards no round trip is left held or queued."""
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2)}
    local = {layer: t.zero_() for layer, t in pattern_caches(SPEC, 0, SEED, HERE).items()}
    cfg = dict(full_bytes=16 * KiB, small_bytes=4 * KiB)   # a small group: up to 8 blocks
    faults = {"write_failure_rate": 0.15, "write_stall_rate": 0.2, "stall_seconds": 0.005}
    procs = {r: PeerProcess(PeerSpec(rank=r, layout=SPEC, seed=SEED, config=cfg, torch_threads=1,
                                     faults={**faults, "seed": r}, device=THERE)) for r in (1, 2)}
    outcomes = {"ok": 0, "failed": 0, "cancelled": 0}
    try:
        async with Endpoint(0, local, NixlTransport(),
                            EndpointConfig(**cfg, request_timeout=10.0,
                                           small_round_trips=1 if capped else None)) as ep:
            rng = random.Random(7)

            async def one(i: int, request: dict) -> None:
                try:
                    if i % 5 == 4:
                        with anyio.move_on_after(rng.uniform(0, 0.003)) as scope:
                            await ep.load(request)
                        if scope.cancelled_caught:
                            outcomes["cancelled"] += 1
                            if not _untouched(ep.caches, request):   # all or nothing
                                check_loaded(ep.caches, request, expected)
                            return
                    else:
                        await ep.load(request)
                except Exception as exc:  # an injected failure: nothing written
                    assert isinstance(exc, XavierError), exc
                    assert not isinstance(exc, InternalError), f"a library bug: {exc!r}"
                    outcomes["failed"] += 1
                    assert _untouched(ep.caches, request), f"a failed load wrote its slots: {exc!r}"
                    return
                assert check_loaded(ep.caches, request, expected) > 0
                outcomes["ok"] += 1

            with anyio.fail_after(120):
                for _ in range(6):
                    for r, p in procs.items():  # a peer lost to a fault: connect it again
                        if r not in ep.peers:
                            await ep.connect(p.address)
                    requests = []
                    for i in range(16):
                        src = 1 + i % 2
                        keys = rng.sample(range(SPEC.num_slots), rng.choice([1, 2, 4]))
                        layers = [0] if len(keys) < 4 else list(range(SPEC.layers))
                        requests.append({src: {layer: {k: 4 * i + j for j, k in enumerate(keys)}
                                               for layer in layers}})
                    for request in requests:
                        zero_slots(ep.caches, request)
                    async with anyio.create_task_group() as tg:
                        for i, request in enumerate(requests):
                            tg.start_soon(one, i, request)
            merged = sum(ep.metrics.peer(r).batches_merged for r in procs)
            assert bool(ep._receiver.scheduler.lanes) is capped
            stats = ep.recv_slab_stats                       # over every source's lanes
            assert stats["lanes_held"] == stats["lanes_waiting"] == 0
            for p in procs.values():   # the injected faults crashed no task of the sources
                assert await anyio.to_thread.run_sync(p.task_crashes) == 0, p.spec.rank
        assert task_crashes(ep) == 0   # nor of the loader (its close included)
        assert outcomes["ok"] > 0 and outcomes["failed"] > 0, outcomes   # faults really hit
        assert merged > 0, "no batch was merged: the faults met no group"
    finally:
        for p in procs.values():
            p.close()

"""Many loads in flight over real NIXL: a loader and two source processes (issue 11).
Every load's bytes are checked."""

from __future__ import annotations

import os
import random

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async import Endpoint, EndpointConfig  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec,  # noqa: E402
                                               check_loaded, pattern_caches, zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

from .conftest import KiB  # noqa: E402

K, S = 4, 4   # the default pools

#: XAVIER_TEST_DEVICE=cuda: the loader on GPU 0, both sources on GPU 1 (as in test_nixl_process)
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
HERE, THERE = ("cuda:0", "cuda:1") if DEVICE == "cuda" else ("cpu", "cpu")
SPEC = LayoutSpec(layers=2, num_slots=64, block_shape=(4, 64), dtype="bfloat16")  # 512 B blocks
NCFG = dict(full_bytes=16 * KiB, small_bytes=1 * KiB)
SEED = 13


@pytest.mark.asyncio
async def test_nixl_many_loads_in_flight_from_two_processes():
    """16 concurrent loads (small and large) at a time from two source processes, whose
    writes are slowed so that copies overlap (and batches that wait for a slab are
    merged); every block checked; S + K registrations on every endpoint and none after
    the warm-up."""
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2)}
    local = {layer: t.zero_() for layer, t in pattern_caches(SPEC, 0, SEED, HERE).items()}
    slow = {"write_stall_rate": 1.0, "stall_seconds": 0.02}
    procs = [PeerProcess(PeerSpec(rank=r, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1,
                                  faults=slow, device=THERE)) for r in (1, 2)]
    try:
        async with Endpoint(0, local, NixlTransport(), EndpointConfig(**NCFG)) as ep:
            for p in procs:
                await ep.connect(p.address)
            assert ep.transport.memory_registrations == S + K
            rng = random.Random(3)
            peak = 0

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
                nonlocal peak
                while True:
                    peak = max(peak, ep.recv_slab_stats["in_use"])
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as outer:
                outer.start_soon(watch)
                for _ in range(4):
                    async with anyio.create_task_group() as tg:
                        for i in range(16):
                            tg.start_soon(one, i)
                outer.cancel_scope.cancel()
            assert peak >= 2, peak                  # loads really were in flight together
            assert ep.transport.memory_registrations == S + K
            merged = 0
            for p in procs:
                m = await anyio.to_thread.run_sync(p.call, "metrics", None)
                assert m["memory_registrations"] == S + K
                mine = ep.metrics.peer(p.spec.rank)
                # 32 batches from each source: each its own copy, or merged into another's
                assert m["total"]["batches_sent"] == mine.batches_received
                assert mine.batches_received + mine.batches_merged == 32
                merged += mine.batches_merged
            assert merged > 0                       # batches that waited went out together
    finally:
        for p in procs:
            p.close()

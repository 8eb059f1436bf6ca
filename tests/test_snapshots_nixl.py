"""The snapshot store over real NIXL between processes (DRAM tiers here; VRAM and pinned
DRAM with XAVIER_TEST_DEVICE=cuda): a source whose tiers hold 16 blocks publishes 96 while
a loader loads concurrently, zeroing its own slots after each publish (the engine reuses
them: keys k and k + 64 are published from one slot, each with its own bytes). Every load
that succeeds holds exactly the bytes published under its key; one of
an evicted key is refused and writes nothing; blocks are demoted, evicted, and written
straight from the store (one hash over every layer); registrations stay flat."""

from __future__ import annotations

import os
import random

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async import Endpoint, EndpointConfig, RemoteError  # noqa: E402
from xavier_async.testing.devices import peer_device  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec,  # noqa: E402
                                               check_loaded, pattern_caches, zero_caches,
                                               zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

KiB = 1024
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
HERE, THERE = peer_device(0, DEVICE).device, peer_device(1, DEVICE).device
SPEC = LayoutSpec(layers=2, num_slots=64, block_shape=(4, 64), dtype="bfloat16")  # 512 B blocks
BLOCK = SPEC.layers * SPEC.block_nbytes                                            # 1 KiB a hash
SEED = 21
SLABS = dict(full_bytes=32 * KiB, small_bytes=4 * KiB)
SOURCE = dict(SLABS, snapshot_gpu_bytes=8 * BLOCK, snapshot_cpu_bytes=8 * BLOCK,
              direct_write_regions=1)
S, K, T = 4, 4, 2


def _seed(key: int) -> int:
    """The pattern seed of ``key``'s block: every key its own bytes."""
    return SEED * 1000 + key


@pytest.mark.asyncio
async def test_a_publish_flood_through_small_tiers_while_a_peer_loads():
    expected = {key: {1: pattern_caches(SPEC, 1, _seed(key))} for key in range(1000, 1096)}
    src = PeerProcess(PeerSpec(rank=1, layout=SPEC, seed=SEED, config=SOURCE, torch_threads=1,
                               device=THERE, published=1))   # publishes slot 0 only at start
    rng = random.Random(5)
    outcomes = {"ok": 0, "refused": 0}
    try:
        caches = zero_caches(SPEC, HERE)
        async with Endpoint(0, caches, NixlTransport(), EndpointConfig(**SLABS)) as ep:
            await ep.connect(src.address)
            live: list[int] = []

            async def flood() -> None:
                for batch in range(24):                      # 96 keys, 4 at a time
                    keys = [1000 + 4 * batch + i for i in range(4)]
                    slots = [(k - 1000) % SPEC.num_slots for k in keys]
                    r = await anyio.to_thread.run_sync(src.call, "publish_blocks",
                                                       {"keys": keys, "slots": slots,
                                                        "seeds": [_seed(k) for k in keys]})
                    live.extend(r["available"])
                    for gone in r["evicted"]:
                        live.remove(gone)

            async def loader() -> None:
                for i in range(120):
                    if not live:
                        await anyio.sleep(0.002)
                        continue
                    key = rng.choice(live)
                    slot = (key - 1000) % SPEC.num_slots
                    one_hash = i % 2 == 0                      # every layer of one key: direct
                    layers = range(SPEC.layers) if one_hash else [0]
                    request = {1: {layer: {key: 8 + i % 48} for layer in layers}}
                    zero_slots(ep.caches, request)
                    try:
                        await ep.load(request)
                    except RemoteError:                       # evicted meanwhile: nothing written
                        outcomes["refused"] += 1
                        assert all(not ep.caches[layer][8 + i % 48].any() for layer in layers)
                        continue
                    # the bytes published under this key: its own pattern, in its source slot
                    check_loaded(ep.caches, {1: {layer: {slot: 8 + i % 48} for layer in layers}},
                                 expected[key])
                    outcomes["ok"] += 1

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(flood)
                    tg.start_soon(loader)
            m = await anyio.to_thread.run_sync(src.call, "metrics", None)
            snap = m["snapshot"]
            assert snap["demoted"] > 0 and snap["evicted"] > 0, snap
            assert snap["direct_writes"] > 0, snap               # one hash: straight from the store
            assert m["memory_registrations"] == S + K + T        # the tiers once, nothing after
            assert ep.transport.memory_registrations == S + K + T
            assert outcomes["ok"] > 40, outcomes
    finally:
        src.close()

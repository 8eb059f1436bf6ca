"""Real NIXL between OS processes on loopback (DRAM over UCX): bytes, views, registrations,
a killed peer, and handshake errors. Each child process is one endpoint
(xavier_async.testing.peer_process); the parent is another."""

from __future__ import annotations

import os
import time

import anyio
import pytest
import torch

pytest.importorskip("nixl")

from xavier_async import (Endpoint, EndpointConfig, HandshakeError, LayoutMismatchError,  # noqa: E402
                          PeerLostError)
from xavier_async.protocol import PROTOCOL_VERSION  # noqa: E402
from xavier_async.testing.devices import peer_device  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec,  # noqa: E402
                                       all_bf16_patterns, check_loaded, pattern_caches,
                                       zero_caches, zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL processes: asyncio (pytest-asyncio)

#: XAVIER_TEST_DEVICE=cuda runs the same tests VRAM to VRAM, one process per GPU (the parent
#: on GPU 0, each child on GPU 1; every process sees both GPUs, as CUDA IPC needs; with one
#: GPU all of them on it: testing.devices.peer_device); the default is DRAM.
DEVICE = os.environ.get("XAVIER_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and torch.cuda.device_count() < 1:
    pytest.skip("XAVIER_TEST_DEVICE=cuda needs a GPU", allow_module_level=True)
HERE = peer_device(0, DEVICE).device
CHILD = dict(device=peer_device(1, DEVICE).device)

SPEC = LayoutSpec(layers=3, num_slots=48, block_shape=(2, 16, 8, 64), dtype="bfloat16")  # 32 KiB blocks
FULL, SMALL = 1 << 20, 64 << 10
# the channel's views are what these tests count: no direct writes from the snapshot store
# (on a GPU they are on by default and bypass the views; tests/test_snapshots_nixl.py has them)
CFG = dict(full_bytes=FULL, small_bytes=SMALL, direct_write_regions=0)
SEED = 11
PARENT_RANK = 0


DEST = 30  # slots below hold the published pattern; loads land at DEST and above


def _req(src: int, keys: list[int], slot0: int = DEST) -> dict:
    """Load ``keys`` (source slots) of every layer into local slots slot0, slot0+1, ..."""
    return {src: {layer: {k: slot0 + i for i, k in enumerate(keys)} for layer in range(SPEC.layers)}}


LARGE_KEYS = list(range(5, 15))     # 10 blocks x 3 layers = 960 KiB: the full slab
SMALL_KEYS = [7]                  # 1 block x 1 layer = 32 KiB: fits the small view


def _small_req(src: int) -> dict:
    return {src: {0: {k: DEST + 10 + i for i, k in enumerate(SMALL_KEYS)}}}


@pytest.fixture(scope="module")
def child():
    with PeerProcess(PeerSpec(rank=1, layout=SPEC, seed=SEED, config=CFG, **CHILD)) as p:
        yield p


async def _parent(streak: int = 2) -> Endpoint:
    caches = pattern_caches(SPEC, PARENT_RANK, SEED, HERE)
    ep = Endpoint(PARENT_RANK, caches, NixlTransport(), EndpointConfig(**CFG, streak=streak))
    for slot in range(SPEC.num_slots):
        ep.publish(slot, slot)
    return ep


async def _load_checked(ep: Endpoint, req: dict) -> None:
    zero_slots(ep.caches, req)
    await ep.load(req)
    expected = {src: pattern_caches(SPEC, src, SEED) for src in req}
    assert check_loaded(ep.caches, req, expected) > 0


async def _child_call(child: PeerProcess, cmd: str, arg=None):
    return await anyio.to_thread.run_sync(child.call, cmd, arg)


async def test_loads_both_ways_bf16_bytes_and_views(child):
    async with await _parent() as ep:
        rank = await ep.connect(child.address)
        assert rank == 1 and ep.peers == (1,)
        # parent loads from the child: large batch (full slab), then small ones (streak -> small view)
        await _load_checked(ep, _req(1, LARGE_KEYS))
        for _ in range(3):
            await _load_checked(ep, _small_req(1))
        m = (await _child_call(child, "metrics"))["peers"][PARENT_RANK]
        assert m["copies_full"] >= 2 and m["copies_small"] >= 2
        assert m["useful_bytes"] == (len(LARGE_KEYS) * SPEC.layers + 3) * SPEC.block_nbytes
        assert m["wire_bytes"] == m["copies_full"] * FULL + m["copies_small"] * SMALL
        # the child loads from the parent at the same time as the parent loads from the child
        async with anyio.create_task_group() as tg:
            tg.start_soon(_child_call, child, "load", (_req(PARENT_RANK, [1, 2, 3]), SEED))
            for _ in range(5):
                await _load_checked(ep, _req(1, [20, 21]))
        result, checked = await _child_call(child, "load", (_req(PARENT_RANK, LARGE_KEYS), SEED))
        assert checked == len(LARGE_KEYS) * SPEC.layers and result["batches"] == 1


async def test_bf16_every_bit_pattern_crosses_processes():
    """All 65,536 BF16 bit patterns, held by a child process, loaded bit-exactly."""
    spec = LayoutSpec(**{**SPEC.__dict__, "all_bf16_patterns": True})
    with PeerProcess(PeerSpec(rank=3, layout=spec, seed=SEED, config=CFG, **CHILD)) as src:
        async with Endpoint(0, zero_caches(spec, HERE), NixlTransport(), EndpointConfig(**CFG)) as ep:
            await ep.connect(src.address)
            blocks = 65536 // (spec.block_nbytes // 2)
            req = {3: {0: {k: DEST + k for k in range(blocks)}}}
            await ep.load(req)
            got = ep.caches[0][DEST:DEST + blocks].reshape(-1)[:65536].cpu().view(torch.int16)
            assert torch.equal(got, all_bf16_patterns().view(torch.int16))
            assert check_loaded(ep.caches, req, {3: pattern_caches(spec, 3, SEED)}) == blocks


async def test_four_seed_cases_zero_registrations_after_warmup(child):
    """Always full / alternating size-only / alternating streak / sustained small: after
    warm-up neither end registers anything, whatever the mix of views."""
    def regs(m: dict) -> int:
        return m["registrations"]

    # the child writes (it is the source) with the streak machine (streak=2)
    async with await _parent(streak=1) as ep:
        await ep.connect(child.address)
        cases = {
            "always_full": [LARGE_KEYS] * 12,
            "alternating_streak": [LARGE_KEYS, SMALL_KEYS] * 6,
            "sustained_small": [SMALL_KEYS] * 12,
        }
        for name, seq in cases.items():
            # warm-up: both views mapped
            await _load_checked(ep, _req(1, LARGE_KEYS))
            for _ in range(2):
                await _load_checked(ep, _small_req(1))
            before_child = regs(await _child_call(child, "metrics"))
            before_parent = ep.snapshot_metrics()["registrations"]
            m0 = (await _child_call(child, "metrics"))["peers"][PARENT_RANK]
            for keys in seq:
                await _load_checked(ep, _req(1, keys) if keys is LARGE_KEYS else _small_req(1))
            m1 = (await _child_call(child, "metrics"))["peers"][PARENT_RANK]
            assert regs(await _child_call(child, "metrics")) == before_child, name
            assert ep.snapshot_metrics()["registrations"] == before_parent, name
            small = m1["copies_small"] - m0["copies_small"]
            if name == "alternating_streak":
                assert small == 0, "streak machine keeps alternating traffic on the full slab"
            elif name == "sustained_small":
                assert small == 12
            else:
                assert small == 0
        # the parent writes (the child loads from it) with size-only selection (streak=1):
        # alternating traffic switches views every batch, still with no new registration
        await _child_call(child, "load", (_req(PARENT_RANK, LARGE_KEYS), SEED))
        await _child_call(child, "load", ({PARENT_RANK: {0: {7: DEST + 10}}}, SEED))
        before = ep.snapshot_metrics()
        for _ in range(6):
            await _child_call(child, "load", (_req(PARENT_RANK, LARGE_KEYS), SEED))
            await _child_call(child, "load", ({PARENT_RANK: {0: {7: DEST + 10}}}, SEED))
        after = ep.snapshot_metrics()
        assert after["registrations"] == before["registrations"]
        p0, p1 = before["peers"][1], after["peers"][1]
        assert p1["copies_small"] - p0["copies_small"] == 6
        assert p1["view_switches"] - p0["view_switches"] == 12


async def test_killed_peer_fails_fast_others_keep_working_restart_reconnects(child):
    spec = PeerSpec(rank=2, layout=SPEC, seed=SEED, config=CFG, **CHILD)
    victim = await anyio.to_thread.run_sync(PeerProcess, spec)
    try:
        async with await _parent() as ep:
            await ep.connect(child.address)
            await ep.connect(victim.address)
            await _load_checked(ep, _req(2, LARGE_KEYS))

            caught: list[BaseException] = []
            done = 0

            async def stream_of_loads() -> None:
                nonlocal done
                try:
                    while True:
                        await _load_checked(ep, _req(2, [1, 2, 3]))
                        done += 1
                except PeerLostError as exc:
                    caught.append(exc)

            with anyio.fail_after(15):  # bounded: no hang
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream_of_loads)
                    await anyio.sleep(0.3)
                    victim.kill()
                    t_kill = time.monotonic()
            assert caught and done > 0, "the stream was running and ended with PeerLostError"
            assert time.monotonic() - t_kill < 10
            assert 2 not in ep.peers
            # the other peer is unaffected
            await _load_checked(ep, _req(1, LARGE_KEYS))
            # a restarted rank 2 reconnects and serves again
            victim = await anyio.to_thread.run_sync(PeerProcess, spec)
            assert await ep.connect(victim.address) == 2
            await _load_checked(ep, _req(2, LARGE_KEYS))
            await _load_checked(ep, _req(2, [4]))
    finally:
        victim.close()


async def test_bad_address_and_mismatches_give_clear_errors(child, monkeypatch):
    async with await _parent() as ep:
        with pytest.raises(HandshakeError, match="host:port"):
            await ep.connect("not-an-address")
        with pytest.raises(HandshakeError, match="cannot reach"):
            await ep.connect("127.0.0.1:1")
    other = LayoutSpec(layers=3, num_slots=48, block_shape=(2, 16, 8, 64), dtype="float16")
    async with Endpoint(0, zero_caches(other, HERE), NixlTransport(), EndpointConfig(**CFG)) as ep:
        with pytest.raises(LayoutMismatchError, match="layout mismatch"):
            await ep.connect(child.address)
    async with Endpoint(0, zero_caches(SPEC, HERE), NixlTransport(),
                        EndpointConfig(full_bytes=2 * FULL, small_bytes=SMALL)) as ep:
        with pytest.raises(HandshakeError, match="slab size mismatch"):
            await ep.connect(child.address)
    monkeypatch.setattr("xavier_async.protocol.PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    async with await _parent() as ep:
        with pytest.raises(HandshakeError, match="version"):
            await ep.connect(child.address)


async def test_close_deregisters_and_peer_notices(child):
    ep = await _parent()
    async with ep:
        await ep.connect(child.address)
        await _load_checked(ep, _req(1, [3]))
        t = ep.transport
        cfg = ep.config  # every slab of both pools and the snapshot tiers, registered once
        assert isinstance(t, NixlTransport) and len(t._reg) == cfg.send_slabs + cfg.receive_slabs + ep.recv_slab_stats["snapshot_tiers"]
    assert t._reg == [] and t._peers == {}
    # the child dropped us: a new parent with the same rank can connect again
    async with await _parent() as ep2:
        assert await ep2.connect(child.address) == 1
        await _load_checked(ep2, _req(1, [4, 5]))


async def test_stream_ordered_unpack_reuses_the_slab_only_after_the_unpack(child):
    """Back-to-back loads with stream_ordered_unpack: each batch overwrites the receive
    slab, so an unpack still reading it when the next copy lands would corrupt blocks (on
    CUDA; on the CPU the unpack is synchronous either way)."""
    caches = pattern_caches(SPEC, PARENT_RANK, SEED, HERE)
    cfg = EndpointConfig(**CFG, stream_ordered_unpack=True)
    async with Endpoint(PARENT_RANK, caches, NixlTransport(), cfg) as ep:
        await ep.connect(child.address)
        reqs = [_req(1, [k, k + 1, k + 2], DEST + k) for k in range(0, 18, 3)]
        for req in reqs:
            zero_slots(ep.caches, req)
        for req in reqs:  # no host sync in between: only the library orders slab reuse
            await ep.load(req)
        expected = {1: pattern_caches(SPEC, 1, SEED)}
        assert sum(check_loaded(ep.caches, req, expected) for req in reqs) == 6 * 9

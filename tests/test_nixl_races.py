"""Both ends connecting at once, over real NIXL: in one process and across processes, many
times, always exactly one connection, and loads work both ways with the bytes checked."""

from __future__ import annotations

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async import Endpoint, EndpointConfig  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec, check_loaded,  # noqa: E402
                                       pattern_caches, zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL processes: asyncio (pytest-asyncio)

SPEC = LayoutSpec(layers=2, num_slots=16, block_shape=(2, 8, 64), dtype="bfloat16")  # 2 KiB blocks
CFG = dict(full_bytes=64 << 10, small_bytes=8 << 10)
SEED = 5
REPS = 20


def _req(src: int, keys: list[int], slot0: int = 10) -> dict:
    return {src: {layer: {k: slot0 + i for i, k in enumerate(keys)} for layer in range(SPEC.layers)}}


def _endpoint(rank: int) -> Endpoint:
    ep = Endpoint(rank, pattern_caches(SPEC, rank, SEED), NixlTransport(), EndpointConfig(**CFG))
    for slot in range(8):
        ep.publish(slot, slot)
    return ep


async def _load_checked(ep: Endpoint, req: dict) -> None:
    zero_slots(ep.caches, req)
    await ep.load(req)
    assert check_loaded(ep.caches, req, {src: pattern_caches(SPEC, src, SEED) for src in req}) > 0


def _one_connection(t: NixlTransport, peer: int, other_local: tuple) -> None:
    p = t._peers[peer]
    assert list(t._peers) == [peer] and not p.lost and t._peering.claims == {}
    assert p.fs.stream.extra(anyio.abc.SocketAttribute.remote_address) == other_local


async def test_simultaneous_connects_in_one_process():
    async with _endpoint(0) as a, _endpoint(1) as b:
        ta, tb = a.transport, b.transport
        assert isinstance(ta, NixlTransport) and isinstance(tb, NixlTransport)
        for rep in range(REPS):
            got = {}

            async def dial(name: str, ep: Endpoint, address: str) -> None:
                got[name] = await ep.connect(address)

            async with anyio.create_task_group() as tg:
                tg.start_soon(dial, "a", a, b.address)
                tg.start_soon(dial, "b", b, a.address)
            assert got == {"a": 1, "b": 0}, rep
            assert a.peers == (1,) and b.peers == (0,)
            _one_connection(ta, 1, tb._peers[0].fs.stream.extra(anyio.abc.SocketAttribute.local_address))
            _one_connection(tb, 0, ta._peers[1].fs.stream.extra(anyio.abc.SocketAttribute.local_address))
            await _load_checked(a, _req(1, [1, 2, 3]))
            await _load_checked(b, _req(0, [4, 5]))
            assert await a.connect(b.address) == 1  # idempotent
            # hang up from one end; the other end forgets us, then the next round
            await ta.disconnect(1)
            with anyio.fail_after(10):
                while b.peers:
                    await anyio.sleep(0.005)


async def test_simultaneous_connects_across_processes():
    spec = PeerSpec(rank=1, layout=SPEC, seed=SEED, config=CFG)
    with PeerProcess(spec) as child:
        async with _endpoint(0) as ep:
            t = ep.transport
            assert isinstance(t, NixlTransport)
            for rep in range(REPS):
                got = {}

                async def child_dials() -> None:
                    got["child"] = await anyio.to_thread.run_sync(child.call, "connect", ep.address)

                async def parent_dials() -> None:
                    got["parent"] = await ep.connect(child.address)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(child_dials)
                    tg.start_soon(parent_dials)
                assert got == {"child": 0, "parent": 1}, rep
                assert ep.peers == (1,) and await anyio.to_thread.run_sync(child.call, "peers") == [0]
                assert list(t._peers) == [1] and t._peering.claims == {}
                await _load_checked(ep, _req(1, [1, 2]))
                _, checked = await anyio.to_thread.run_sync(child.call, "load", (_req(0, [3, 4]), SEED))
                assert checked == 2 * SPEC.layers
                await t.disconnect(1)
                with anyio.fail_after(10):
                    while await anyio.to_thread.run_sync(child.call, "peers"):
                        await anyio.sleep(0.005)

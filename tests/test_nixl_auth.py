"""Peer authentication over real NIXL processes: the right secret connects and loads; a
wrong or missing one is refused before the listener sends anything about itself (checked
on the bytes it sent); a flood of bogus connections leaves loads correct and the
listener's file descriptors and memory flat."""

from __future__ import annotations

import json
import os
import struct

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async import Endpoint, EndpointConfig, HandshakeError  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec, check_loaded,  # noqa: E402
                                       pattern_caches, zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

from .conftest import raw_exchange  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL processes: asyncio (pytest-asyncio)

SPEC = LayoutSpec(layers=2, num_slots=16, block_shape=(2, 8, 64), dtype="bfloat16")
CFG = dict(full_bytes=64 << 10, small_bytes=8 << 10)
SEED = 9
SECRET = "auth-test-secret-0123456789"


def _req(src: int, keys: list[int]) -> dict:
    return {src: {layer: {k: 10 + i for i, k in enumerate(keys)} for layer in range(SPEC.layers)}}


def _endpoint(**transport) -> Endpoint:
    ep = Endpoint(0, pattern_caches(SPEC, 0, SEED), NixlTransport(**transport), EndpointConfig(**CFG))
    for slot in range(8):
        ep.publish(slot, slot)
    return ep


async def _load_checked(ep: Endpoint, keys: list[int]) -> None:
    req = _req(1, keys)
    zero_slots(ep.caches, req)
    await ep.load(req)
    assert check_loaded(ep.caches, req, {1: pattern_caches(SPEC, 1, SEED)}) == len(keys) * SPEC.layers


@pytest.fixture(scope="module")
def child():
    with PeerProcess(PeerSpec(rank=1, layout=SPEC, seed=SEED, config=CFG,
                              transport={"secret": SECRET})) as p:
        yield p


async def _peers(child: PeerProcess) -> list[int]:
    return await anyio.to_thread.run_sync(child.call, "peers")


async def test_the_right_secret_connects_and_loads_both_ways(child):
    async with _endpoint(secret=SECRET) as ep:
        assert await ep.connect(child.address) == 1
        await _load_checked(ep, [1, 2, 3])
        _, n = await anyio.to_thread.run_sync(child.call, "load", (_req(0, [4, 5]), SEED))
        assert n == 2 * SPEC.layers


async def test_a_wrong_or_missing_secret_is_refused_on_both_sides(child):
    for transport, match in [({"secret": "not-the-secret-0123456789"}, "same secret"),
                             ({}, "has no secret")]:
        async with _endpoint(**transport) as ep:
            with pytest.raises(HandshakeError, match=match):
                await ep.connect(child.address)
            assert ep.peers == () and ep.transport._peers == {}
        assert await _peers(child) == []
    # the child dialling a parent that holds another secret fails there too
    async with _endpoint(secret="not-the-secret-0123456789") as ep:
        with pytest.raises(RuntimeError, match="HandshakeError.*authentication failed"):
            await anyio.to_thread.run_sync(child.call, "connect", ep.address)
        assert ep.peers == ()


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


GREET = {"xa": "xavier-async-handshake/2", "nonce": "cd" * 32}
SECRETS = (b"meta", b"recv_ptr", b"layout", b"agent", b"hello", b"rank")


async def test_nothing_about_the_listener_leaves_before_authentication(child):
    async with _endpoint() as ep:  # a real hello to replay, from a peer without the secret
        hello = ep.transport._my_hello()
        cases = [
            [_frame({**GREET, "auth": False}), _frame(hello)],          # no secret
            [_frame({**GREET, "auth": True}), _frame({"proof": "00" * 32}), _frame(hello)],  # wrong proof
            [_frame({**GREET, "auth": True}), _frame(hello)],           # skips the proof
            [_frame(hello)],                                            # straight to the hello
            [b"GET / HTTP/1.1\r\n\r\n"],
            [],                                                         # silence
        ]
        for payloads in cases:
            raw = await raw_exchange(child.address, payloads, timeout=30)
            assert b"error" in raw, raw
            for word in SECRETS:
                assert word not in raw, (word, raw)
            assert f"xa-1-{child.proc.pid}".encode() not in raw
        assert await _peers(child) == []
        # control: a listener without a secret does send its hello to the same replay
        with PeerProcess(PeerSpec(rank=2, layout=SPEC, seed=SEED, config=CFG)) as open_child:
            raw = await raw_exchange(open_child.address,
                                     [_frame({**GREET, "auth": False}), _frame(hello)], timeout=30)
            assert b"meta" in raw and b"recv_ptr" in raw


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_a_connection_flood_leaves_loads_correct_and_the_listener_flat(child):
    host, port = child.address.rsplit(":", 1)
    bogus = [b"", b"\x00\x00\x00\x05nope!", struct.pack("!I", 1 << 30), _frame({"pad": "x" * 5000}),
             _frame({**GREET, "auth": True}) + _frame({"proof": "11" * 32}), b"\xff" * 64]
    async with _endpoint(secret=SECRET) as ep:
        await ep.connect(child.address)
        await _load_checked(ep, [1])
        pid = child.proc.pid
        fds0, rss0 = _fds(pid), _rss_kib(pid)
        sent = loads = 0
        flooding = True

        async def one(i: int) -> None:
            nonlocal sent
            try:
                async with await anyio.connect_tcp(host, int(port)) as s:
                    sent += 1
                    if bogus[i % len(bogus)]:
                        await s.send(bogus[i % len(bogus)])
                    with anyio.move_on_after(0.05):
                        await s.receive()
            except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
                pass

        async def flood() -> None:
            nonlocal flooding
            for wave in range(20):
                async with anyio.create_task_group() as tg:
                    for i in range(150):
                        tg.start_soon(one, wave * 150 + i)
            flooding = False

        async def load_meanwhile() -> None:
            nonlocal loads
            while flooding:
                await _load_checked(ep, [loads % 8, (loads + 3) % 8])
                loads += 1

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(flood)
                tg.start_soon(load_meanwhile)
        assert sent >= 2000 and loads > 0
        with anyio.fail_after(30):  # every bogus connection is closed again
            while _fds(pid) > fds0:
                await anyio.sleep(0.05)
        assert _rss_kib(pid) - rss0 < 32 * 1024
        await _load_checked(ep, [2, 3])
        assert await _peers(child) == [0]

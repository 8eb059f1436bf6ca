"""NixlTransport without NIXL: a fake agent (tests/fake_nixl.py) stands in for NIXL while
the handshake runs over real loopback TCP. Covers the handle cache (LRU of exact-length
handles), deferred release of a handle whose copy is still posted, connect races, and the
handshake's refusals. Real NIXL between processes: tests/test_nixl_process.py."""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from xavier_async.errors import HandshakeError, InvalidRequestError
from xavier_async.slabs import allocate_slabs
from xavier_async.transports.nixl import NixlTransport
from xavier_async.transports.nixl_copies import _Mapping, _Pending

from .fake_nixl import FakeAgent, FakeFabric

from .conftest import raw_exchange  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL processes: asyncio (pytest-asyncio)

FULL, SMALL = 64 << 10, 4 << 10
VERSION = 7


class StubHost:
    """The endpoint side of the transport contract, recording what it is told."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.joined: list[int] = []
        self.delivered: list[tuple[int, bytes]] = []
        self.lost: list[int] = []

    def hello(self) -> dict[str, Any]:
        return {"version": VERSION, "rank": self.rank}

    def check_hello(self, hello: dict[str, Any]) -> None:
        if hello.get("version") != VERSION:
            raise HandshakeError(f"protocol version mismatch: peer {hello.get('version')!r}")
        if hello.get("rank") == self.rank:
            raise HandshakeError("same rank")

    def peer_joined(self, peer: int, hello: dict[str, Any]) -> None:
        self.joined.append(peer)

    def deliver(self, peer: int, msg: bytes, inline: bool = False) -> None:
        self.delivered.append((peer, msg))

    def peer_lost(self, peer: int, exc: BaseException) -> None:
        self.lost.append(peer)


class Node:
    def __init__(self, t: NixlTransport, host: StubHost, send: Any, recv: Any) -> None:
        self.t, self.host, self.send, self.recv = t, host, send, recv

    @property
    def agent(self) -> FakeAgent:
        assert isinstance(self.t.agent, FakeAgent)
        return self.t.agent


@asynccontextmanager
async def nodes(n: int, fabric: FakeFabric | None = None, **kw: Any) -> AsyncIterator[list[Node]]:
    fabric = fabric or FakeFabric()
    kw.setdefault("bulk_bytes", 0)  # the same on every host (its default depends on the cores)
    out: list[Node] = []
    async with anyio.create_task_group() as tg:
        for rank in range(n):
            host = StubHost(rank)
            send, recv = allocate_slabs(FULL, SMALL, torch.device("cpu"))
            t = NixlTransport(agent_factory=fabric.factory, **kw)
            await t.start(host, send, recv, tg)
            out.append(Node(t, host, send, recv))
        try:
            yield out
        finally:
            for node in out:
                await node.t.aclose()
            tg.cancel_scope.cancel()
    for node in out:
        assert node.agent.errors == []


def fill(node: Node, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    node.send.tensor.copy_(torch.randint(0, 256, (FULL,), generator=g, dtype=torch.uint8))
    return node.send.tensor.clone()


async def test_handshake_copy_and_notification_with_a_fake_agent():
    async with nodes(2) as (a, b):
        assert await a.t.connect(b.t.address) == (1, {"version": VERSION, "rank": 1})
        assert a.host.joined == [1] and b.host.joined == [0]
        want = fill(a, 1)
        m = await a.t.map_view(1, a.send.full)
        assert a.t.post(1, m, FULL, b"landed") is None
        assert torch.equal(b.recv.tensor, want)
        with anyio.fail_after(5):
            while not b.host.delivered:
                await anyio.sleep(0.001)
        assert b.host.delivered == [(0, b"landed")]
        # a token of another kind is refused, not misread
        with pytest.raises(InvalidRequestError):
            a.t.post(1, object(), FULL, None)


async def test_exact_length_handles_are_an_lru_and_the_view_handle_stays():
    async with nodes(2, trim_handles=2) as (a, b):
        await a.t.connect(b.t.address)
        m = await a.t.map_view(1, a.send.full)
        assert isinstance(m, _Mapping)
        view_handle = m.by_len[FULL]
        for i, n in enumerate([100, 200, 300, 200, 400, 500]):
            want = fill(a, 10 + i)
            b.recv.tensor.zero_()
            assert a.t.post(1, m, n, b"landed") is None
            assert torch.equal(b.recv.tensor[:n], want[:n]) and not b.recv.tensor[n:].any()
        # 100 went first (oldest), then 300 (200 was used again, so it is younger)
        assert [h.local[0][1] for h in a.agent.released] == [100, 300, 200]
        assert list(m.by_len) == [FULL, 400, 500] and m.by_len[FULL] is view_handle
        await a.t.forget(1)  # the channel is reset: every handle goes, the view one too
        assert {h.local[0][1] for h in a.agent.released} == {100, 200, 300, 400, 500, FULL}
        assert a.agent.live == set()


async def test_a_copy_without_a_notification_never_re_sends_an_earlier_one():
    """NIXL re-sends a handle's last notification when it is re-posted with an empty one
    (NIXL 1.5.1, measured; the fake does the same): a bare copy after a load through the
    same view goes through a handle of its own, and exact lengths are an LRU there too."""
    async with nodes(2, trim_handles=1) as (a, b):
        await a.t.connect(b.t.address)
        m = await a.t.map_view(1, a.send.full)
        assert isinstance(m, _Mapping)
        for i, (n, notify) in enumerate([(FULL, b"landed"), (FULL, None), (100, None),
                                         (200, None), (100, b"short")]):
            want = fill(a, 30 + i)
            b.recv.tensor.zero_()
            assert a.t.post(1, m, n, notify) is None
            assert torch.equal(b.recv.tensor[:n], want[:n]) and not b.recv.tensor[n:].any()
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert b.host.delivered == [(0, b"landed"), (0, b"short")]
        assert list(m.silent) == [FULL, 200] and list(m.by_len) == [FULL, 100]
        await a.t.forget(1)
        assert a.agent.live == set() and a.agent.errors == []


async def test_a_handle_with_a_copy_posted_is_released_only_after_the_copy():
    fabric = FakeFabric()
    async with nodes(2, fabric) as (a, b):
        await a.t.connect(b.t.address)
        m = await a.t.map_view(1, a.send.full)
        want = fill(a, 3)
        fabric.hold_copies = True
        pending = a.t.post(1, m, FULL, None)
        assert isinstance(pending, _Pending)
        handle = pending.handle
        await a.t.forget(1)  # would release the handle: it is still posted, so later
        assert handle not in a.agent.released and a.agent.errors == []
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.t.wait, pending)
            await anyio.sleep(0.01)
            assert handle not in a.agent.released  # still waiting for the copy
            a.agent.finish()
        assert handle in a.agent.released and a.agent.errors == []
        assert torch.equal(b.recv.tensor, want)


# -- refusals ----------------------------------------------------------------------------
def frame(obj: Any) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


def frames(raw: bytes) -> list[dict[str, Any]]:
    out = []
    while raw:
        (n,) = struct.unpack("!I", raw[:4])
        out.append(json.loads(raw[4:4 + n]))
        raw = raw[4 + n:]
    return out


GREET = {"xa": "xavier-async-handshake/2", "nonce": "ab" * 32, "auth": False}


@pytest.mark.parametrize("payload, reason", [
    (struct.pack("!I", 5) + b"nope!", "not JSON"),
    (frame([1, 2, 3]), "not a JSON object"),
    (struct.pack("!I", 1 << 30), "too large"),
    (frame({"pad": "x" * 2000}), "too large"),  # small limit before authentication
    (frame({**GREET, "xa": "xavier-async-handshake/1"}), "version mismatch"),
    (frame({**GREET, "nonce": 5}), "nonce"),
    (frame(GREET) + frame({"hello": {"version": VERSION + 1, "rank": 5}, "agent": "x", "meta": "",
                           "recv_ptr": 0}), "protocol version"),
    (frame(GREET) + frame({"hello": {"version": VERSION, "rank": 5}}), "malformed"),
])
async def test_bad_handshakes_are_refused_and_nothing_is_added(payload, reason):
    async with nodes(2) as (a, b):
        raw = await raw_exchange(b.t.address, [payload])
        got = frames(raw)
        assert reason in got[-1]["error"], got
        assert all("meta" not in f and "hello" not in f for f in got)
        assert b.t._peers == {} and b.agent.added == [] and b.host.joined == []
        # the listener still serves real peers
        assert (await a.t.connect(b.t.address))[0] == 1


async def test_a_silent_connection_is_dropped_after_the_first_frame_deadline():
    async with nodes(1, first_frame_timeout=0.1, handshake_timeout=600) as (b,):
        got = frames(await raw_exchange(b.t.address, [], timeout=60))
        assert len(got) == 1 and "no handshake frame within" in got[0]["error"]
        assert b.t._admission.pending == 0


SECRET = "s3cret-" + "x" * 16


async def test_secret_both_ways_and_refusals_add_nothing():
    fabric = FakeFabric()
    async with nodes(1, fabric, secret=SECRET) as (a,), nodes(1, fabric, secret=SECRET) as (b,):
        b.host.rank = 1
        assert (await a.t.connect(b.t.address))[0] == 1
        await copy_checked(a, b, 1)
    for mine, theirs, match in [(SECRET, "other-" + "y" * 16, "does not hold the same secret"),
                                (None, SECRET, "has no secret"), (SECRET, None, "has none")]:
        fabric = FakeFabric()
        async with nodes(1, fabric, secret=mine) as (a,), nodes(1, fabric, secret=theirs) as (b,):
            b.host.rank = 1
            with pytest.raises(HandshakeError, match=match):
                await a.t.connect(b.t.address)
            assert a.t._peers == b.t._peers == {} and a.agent.added == b.agent.added == []


def test_listening_beyond_loopback_needs_a_secret_or_insecure(monkeypatch):
    monkeypatch.delenv("XAVIER_ASYNC_SECRET", raising=False)
    monkeypatch.delenv("XAVIER_ASYNC_INSECURE", raising=False)
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(InvalidRequestError, match="without a secret"):
            NixlTransport(host)
        NixlTransport(host, insecure=True)
        NixlTransport(host, secret=SECRET)
    for host in ("127.0.0.1", "localhost", "::1"):
        NixlTransport(host)
    monkeypatch.setenv("XAVIER_ASYNC_INSECURE", "1")
    NixlTransport("0.0.0.0")
    monkeypatch.setenv("XAVIER_ASYNC_INSECURE", "0")
    monkeypatch.setenv("XAVIER_ASYNC_SECRET", SECRET)
    assert NixlTransport("0.0.0.0")._peering.secret == SECRET.encode()
    with pytest.raises(InvalidRequestError, match="at least 16"):
        NixlTransport(secret="short")


async def test_a_rank_lost_without_a_clean_close_is_reserved_for_its_agent():
    fabric = FakeFabric()
    async with nodes(2, fabric, rank_grace=600) as (a, b):
        await a.t.connect(b.t.address)
        old_agent = b.t.agent_name
        # rank 1's connection times out (a partition): not a confirmed death
        a.t._liveness.peer_gone(a.t._peers[1], confirmed=False)
        await a.t.disconnect(1)
        await b.t.disconnect(0)
        async with nodes(1, fabric) as (imposter,):
            imposter.host.rank = 1
            with pytest.raises(HandshakeError, match="without a clean close"):
                await imposter.t.connect(a.t.address)
            assert list(a.t._peers) == [] and imposter.t.agent_name not in a.agent.added
        # the old agent itself may come back
        assert (await b.t.connect(a.t.address))[0] == 0
        assert a.t._peers[1].agent == old_agent and 1 not in a.t._liveness.gone


async def test_a_connected_rank_cannot_be_claimed_by_another_agent():
    fabric = FakeFabric()
    async with nodes(2, fabric) as (a, b), nodes(1, fabric) as (imposter,):
        imposter.host.rank = 1
        await b.t.connect(a.t.address)
        with pytest.raises(HandshakeError, match="connected to another agent"):
            await imposter.t.connect(a.t.address)
        assert a.t._peers[1].agent == b.t.agent_name
        await copy_checked(a, b, 9)


# -- connect races -----------------------------------------------------------------------
def one_connection(a: Node, b: Node) -> None:
    """Both ends hold exactly one peer entry, and it is the same TCP connection."""
    pa, pb = a.t._peers[b.host.rank], b.t._peers[a.host.rank]
    sa = pa.fs.stream.extra(anyio.abc.SocketAttribute.local_address)
    sb = pb.fs.stream.extra(anyio.abc.SocketAttribute.remote_address)
    assert sa == sb and not pa.lost and not pb.lost
    assert list(a.t._peers) == [b.host.rank] and list(b.t._peers) == [a.host.rank]
    assert a.t._peering.claims == {} and b.t._peering.claims == {}


async def copy_checked(src: Node, dst: Node, seed: int) -> None:
    want = fill(src, seed)
    dst.recv.tensor.zero_()
    m = await src.t.map_view(dst.host.rank, src.send.full)
    assert src.t.post(dst.host.rank, m, FULL, None) is None
    assert torch.equal(dst.recv.tensor, want)


async def test_simultaneous_connects_end_with_exactly_one_connection():
    import random
    rng = random.Random(5)
    async with nodes(2) as (a, b):
        for rep in range(20):
            got: dict[str, int] = {}

            async def dial(name: str, src: Node, dst: Node, delay: float) -> None:
                await anyio.sleep(delay)
                got[name] = (await src.t.connect(dst.t.address))[0]

            joined = (len(a.host.joined), len(b.host.joined))
            async with anyio.create_task_group() as tg:
                tg.start_soon(dial, "a", a, b, rng.random() * 0.002)
                tg.start_soon(dial, "b", b, a, rng.random() * 0.002)
            assert got == {"a": 1, "b": 0}, rep
            one_connection(a, b)
            # each end learned of its peer exactly once
            assert (len(a.host.joined), len(b.host.joined)) == (joined[0] + 1, joined[1] + 1)
            await copy_checked(a, b, rep)
            await copy_checked(b, a, 100 + rep)
            # connect to a connected peer is idempotent, from either end
            assert (await a.t.connect(b.t.address))[0] == 1
            assert (await b.t.connect(a.t.address))[0] == 0
            one_connection(a, b)
            assert (len(a.host.joined), len(b.host.joined)) == (joined[0] + 1, joined[1] + 1)
            # hang up and wait until the other end noticed, for the next round
            lost = len(b.host.lost)
            await a.t.disconnect(1)
            with anyio.fail_after(5):
                while len(b.host.lost) == lost:
                    await anyio.sleep(0.001)
            await b.t.disconnect(0)


async def test_connect_timeout_per_call():
    async with nodes(1, handshake_timeout=600) as (a,):
        # a listener that accepts and never answers
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as silent:
            port = silent.extra(anyio.abc.SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                tg.start_soon(silent.serve, lambda s: anyio.sleep_forever())
                t0 = anyio.current_time()
                with pytest.raises(HandshakeError, match="handshake with"):
                    await a.t.connect(f"127.0.0.1:{port}", timeout=0.2)
                assert anyio.current_time() - t0 < a.t.handshake_timeout
                tg.cancel_scope.cancel()
        with pytest.raises(InvalidRequestError, match="timeout"):
            await a.t.connect("127.0.0.1:1", timeout=-1)


async def test_a_timed_out_copy_keeps_its_handle_until_it_is_terminal():
    """A copy that outlives write_timeout may still be posted: resetting the channel must
    not release its handle (the poller releases it once NIXL reports a terminal state)."""
    from xavier_async import Endpoint, EndpointConfig, TransferError

    fabric = FakeFabric()
    cfg = EndpointConfig(full_bytes=16 * 1024, small_bytes=1024, request_timeout=10.0)
    src = {0: torch.arange(8 * 64, dtype=torch.float32).view(8, 64)}
    dst = {0: torch.zeros(8, 64)}
    ta = NixlTransport(agent_factory=fabric.factory, write_timeout=0.2)
    tb = NixlTransport(agent_factory=fabric.factory, write_timeout=0.2)
    async with Endpoint(0, src, ta, cfg) as a, Endpoint(1, dst, tb, cfg) as b:
        await b.connect(a.address)
        a.publish("k", 3)
        await b.load({0: {0: {"k": 5}}})
        fabric.hold_copies = True
        with pytest.raises(TransferError, match="did not finish"):
            await b.load({0: {0: {"k": 6}}})
        stuck = [h for _, h in ta._stuck.values()]
        assert len(stuck) == 1 and not stuck[0].released and ta.agent.errors == []
        fabric.hold_copies = False
        ta.agent.finish()                       # the copy finally lands
        with anyio.fail_after(5):
            while ta._stuck:
                await anyio.sleep(0.01)         # the poller sees it terminal
        assert ta.agent.released.count(stuck[0]) == 1 and ta.agent.errors == []
        await b.load({0: {0: {"k": 7}}})
        assert torch.equal(dst[0][7], src[0][3])

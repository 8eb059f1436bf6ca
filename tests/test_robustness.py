"""Regressions from review: hostile control messages, a state-machine reset during a
registration, serving from inside another call stack without blocking it, and a key
unpublished while its serve waits."""

from __future__ import annotations

import anyio
import pytest
import torch

from xavier_async import (Endpoint, EndpointConfig, LocalFabric, LocalTransport, RemoteError,
                          TransferError, protocol)
from xavier_async._internal import prepare_bare_copy
from xavier_async.testing import FaultyTransport

from .conftest import assert_same_bytes, random_cache, zero_cache

pytestmark = pytest.mark.anyio  # every test runs on asyncio and on trio

CFG = EndpointConfig(full_bytes=4096, small_bytes=1024)


@pytest.mark.parametrize("msg", [
    b'XAD{"b":5}',              # bytes.fromhex(5): TypeError inside the JSON decoder
    b"XAD[7,1e999]",            # int(inf): OverflowError
    b"XAD" + b"[" * 100000,     # RecursionError
    b"XAE[1]",                  # an ERROR without kind and text
    b"XAD[[1],2]",              # an unhashable request id
    b"XAL[1,[[0,[[1]]]]]",      # a LOAD with an unhashable key
    b"\xff\xfe",                # not ours at all
])
async def test_hostile_control_messages_are_dropped_and_the_endpoint_keeps_working(msg):
    fabric = LocalFabric()
    src = {0: random_cache(8, (16,), torch.float32, 1)}
    dst = {0: zero_cache(8, (16,), torch.float32)}
    async with Endpoint(0, src, fabric.transport(), CFG) as a, \
            Endpoint(1, dst, fabric.transport(), CFG) as b:
        await b.connect(a.address)
        a.publish("k", 2)
        for inline in (False, True):
            a._host.deliver(1, msg, inline)
            b._host.deliver(0, msg, inline)
        await anyio.wait_all_tasks_blocked()   # every reply or refusal has been handled
        await b.load({0: {0: {"k": 5}}})
        assert_same_bytes(dst[0][5], src[0][2])


def test_codec_turns_every_malformed_body_into_value_error():
    for msg in (b'XAD{"b":5}', b"XAD[7,1e999]x", b"XAD" + b"[" * 100000, b"XAD\xff"):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(msg)


class _SlowMapTransport(LocalTransport):
    """map_view waits for a go signal, so the test can act during a registration."""

    def __init__(self, fabric: LocalFabric) -> None:
        super().__init__(fabric)
        self.entered = anyio.Event()
        self.go = anyio.Event()

    async def map_view(self, peer, view, slab=0):
        self.entered.set()
        await self.go.wait()
        return await super().map_view(peer, view, slab)


async def test_a_reset_during_registration_makes_the_channel_choose_again():
    fabric = LocalFabric()
    t = _SlowMapTransport(fabric)
    async with Endpoint(0, {0: random_cache(4, (64,), torch.uint8, 1)}, t, CFG) as a, \
            Endpoint(1, {0: zero_cache(4, (64,), torch.uint8)}, fabric.transport(), CFG) as b:
        await a.connect(b.address)
        ch = a.channel(1)
        t.go.set()
        await ch.mapping("full")                # the full view is mapped
        ch.policy.select(100)                   # now in streak_1: the next small batch wants the small view
        t.go = anyio.Event()
        t.entered = anyio.Event()
        plans = []

        async def prepare() -> None:
            plans.append(await prepare_bare_copy(ch, 100))

        async with anyio.create_task_group() as tg:
            tg.start_soon(prepare)
            await t.entered.wait()              # registering the small view...
            ch.policy.reset()                   # ...when something resets the machine
            t.go.set()
        (plan,) = plans
        assert plan.view_bytes == 4096 and ch.policy.state == "streak_1"


class _InlineLocal(LocalTransport):
    """Delivers with inline=True, as the NIXL poller does, from inside the sender's call."""

    async def send(self, peer: int, msg: bytes) -> None:
        other = self._peer(peer)
        assert other.host is not None and self.host is not None
        other.host.deliver(self.host.rank, msg, True)
        await anyio.lowlevel.checkpoint()


async def test_inline_serving_never_blocks_the_caller_on_a_slow_copy():
    fabric = LocalFabric()
    src = {0: random_cache(8, (256,), torch.uint8, 3)}
    dst = {0: zero_cache(8, (256,), torch.uint8)}
    slow = FaultyTransport(LocalTransport(fabric))
    async with Endpoint(0, src, slow, CFG) as a, \
            Endpoint(1, dst, _InlineLocal(fabric), CFG) as b:
        await b.connect(a.address)
        a.publish("k", 4)
        await b.load({0: {0: {"k": 0}}})        # maps the view: later serves can be inline
        slow.hold_next_writes(1)               # the serve's copy is held until released
        b_send = b.transport.send
        sent = anyio.Event()

        async def noted_send(peer, msg):
            await b_send(peer, msg)
            sent.set()

        b.transport.send = noted_send  # type: ignore[method-assign]
        done = []

        async def load():
            await b.load({0: {0: {"k": 1}}})
            done.append(1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            try:
                # a send that waited for the copy would never return: the copy is held
                with anyio.fail_after(30):     # a hang guard
                    await sent.wait()          # the request was handed over...
                    await slow.wait_stalled(1)  # ...and its copy is posted and held
                assert not done                # the load waits for that copy
            finally:
                slow.release_held()            # (a failed check must not hang the load)
        assert done
        assert_same_bytes(dst[0][1], src[0][4])


async def test_a_key_unpublished_while_its_serve_waits_is_not_served():
    fabric = LocalFabric()
    t = _SlowMapTransport(fabric)
    src = {0: random_cache(8, (64,), torch.uint8, 5)}
    dst = {0: zero_cache(8, (64,), torch.uint8)}
    async with Endpoint(0, src, t, CFG) as a, Endpoint(1, dst, fabric.transport(), CFG) as b:
        await b.connect(a.address)
        a.publish("k", 3)
        out: list[BaseException] = []

        async def load() -> None:
            try:
                await b.load({0: {0: {"k": 6}}})
            except RemoteError as exc:
                out.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            await t.entered.wait()              # the source is mapping its view
            a.unpublish("k")                    # the block's slot is handed to another request
            src[0][3].fill_(0xEE)
            t.go.set()
        assert out and "not published" in str(out[0])
        assert torch.equal(dst[0][6], torch.zeros(64, dtype=torch.uint8))


@pytest.mark.parametrize("store", [True, False], ids=["snapshot_store", "live_slots"])
@pytest.mark.parametrize("inline", [False, True], ids=["queued", "inline"])
async def test_a_pack_failure_is_a_transfer_error_and_the_source_keeps_serving(monkeypatch, inline,
                                                                               store):
    """Anything raised while packing (a CUDA out-of-memory, a kernel error) after the
    machine advanced, from the snapshot store or from the live slots: the loader gets a
    TransferError at once (not a timeout), the channel starts over with no stale
    mapping, and the next loads are served."""
    import xavier_async.source as endpoint_module
    from xavier_async.snapshots import SnapshotStore
    owner, name = (SnapshotStore, "run") if store else (endpoint_module, "pack")
    real_pack = getattr(owner, name)
    calls = {"n": 0}

    def flaky_pack(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device out of memory (injected)")
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky_pack)
    fabric = LocalFabric()
    src = {0: random_cache(8, (16,), torch.float32, 1)}
    dst = {0: zero_cache(8, (16,), torch.float32)}
    cfg = EndpointConfig(full_bytes=4096, small_bytes=1024, request_timeout=30.0,
                         **({} if store else {"snapshot_gpu_bytes": 0, "snapshot_cpu_bytes": 0}))
    make = _InlineLocal if inline else LocalTransport
    async with Endpoint(0, src, make(fabric), cfg) as a, Endpoint(1, dst, make(fabric), cfg) as b:
        await b.connect(a.address)
        a.publish("k", 2)
        await b.load({0: {0: {"k": 1}}})                # maps the full view
        with anyio.fail_after(5):                         # an error reply, not a request timeout
            with pytest.raises(TransferError, match="packing"):
                await b.load({0: {0: {"k": 5}}})
        await anyio.wait_all_tasks_blocked()
        assert a.channel(1).mapped == {}                  # no mapping the transport dropped
        assert not a.transport._mappings.get(1)
        for slot in (3, 4, 6):                            # served again, through fresh mappings
            await b.load({0: {0: {"k": slot}}})
            assert_same_bytes(dst[0][slot], src[0][2])
        assert a.metrics.peer(1).failures == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_during_the_request_send_sends_it_once():
    """A Task.cancel() that gets through the shield while the request is being sent: the
    request is not sent a second time (a second copy could land after the first resolved)."""
    import asyncio
    sent = []

    class CancelDuringSend(LocalTransport):
        cancel_once = False

        async def send(self, peer: int, msg: bytes) -> None:
            if msg[:3] == b"XAL":
                sent.append(msg)
            other = self._peer(peer)
            assert other.host is not None and self.host is not None
            other.host.deliver(self.host.rank, msg)
            if self.cancel_once:
                self.cancel_once = False
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
            await anyio.lowlevel.checkpoint()

    fabric = LocalFabric()
    src = {0: random_cache(8, (16,), torch.float32, 1)}
    dst = {0: zero_cache(8, (16,), torch.float32)}
    cfg = EndpointConfig(full_bytes=4096, small_bytes=1024)
    tb = CancelDuringSend(fabric)
    async with Endpoint(0, src, LocalTransport(fabric), cfg) as a, Endpoint(1, dst, tb, cfg) as b:
        await b.connect(a.address)
        a.publish("k", 2)
        tb.cancel_once = True
        with pytest.raises(asyncio.CancelledError):
            await b.load({0: {0: {"k": 5}}})
        await anyio.wait_all_tasks_blocked()
        assert len(sent) == 1 and a.metrics.peer(1).batches_sent == 1
        await b.load({0: {0: {"k": 6}}})
        assert_same_bytes(dst[0][6], src[0][2])

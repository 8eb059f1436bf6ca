"""Cancellation and close (BRIEF section 5): a started copy is never abandoned, the caller
still sees its cancellation, close drains, rejects new work, is idempotent and safe to
cancel.

Timing checks here are only lower bounds ("did not return before the stall ended"), with
margins. A cancellation meant for a started copy comes once the copy is seen stalled (or
its registration seen begun), never on a timer; a load that never started is shown not to
wait by ending while the copy it queued behind is still held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

from xavier_async.bench.raw import copy_raw
from xavier_async._internal import mapped_views

from xavier_async import EndpointClosedError, EndpointConfig

from .conftest import (asyncio_only, KiB, CountingTransport, assert_caches_unchanged, assert_same_bytes,
                       cluster, faulty, lifecycle_phase, random_cache, snapshot)

pytestmark = pytest.mark.anyio  # every test runs on asyncio and on trio

STALL = 0.3
EARLY = 0.05          # when the caller gets cancelled, well inside the stall
MARGIN = 0.9          # lower bounds use 90% of the stall


def cfg(**kw) -> EndpointConfig:
    return EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, **kw)


def caches(n=3, seed=0):
    return [{0: random_cache(16, (64,), torch.float32, seed=seed + i),
             "v": random_cache(16, (3, 5), torch.bfloat16, seed=seed + 10 + i)} for i in range(n)]


def publish(ep):
    for s in range(16):
        ep.publish(f"k{s}", s)


def req(src, pairs):
    """{src: {layer: {key: dst}}} for (src_slot, dst_slot) pairs, both layers."""
    return {src: {layer: {f"k{s}": d for s, d in pairs} for layer in (0, "v")}}


def check(dst, src, pairs):
    for layer in (0, "v"):
        for s, d in pairs:
            assert_same_bytes(dst[layer][d], src[layer][s])


def untouched(cs, orig, slot):
    """Endpoint 0's ``slot`` still holds its own bytes, in both layers."""
    for layer in (0, "v"):
        assert_same_bytes(cs[0][layer][slot], orig[0][layer][slot])


@asynccontextmanager
async def stalled(n=2, stall=STALL, **kw) -> AsyncIterator[tuple[list, list, list]]:
    """The setup of most tests here: ``n`` endpoints (``caches(n)``, ``cfg(**kw)``), the
    others publishing ``k0..k15`` to endpoint 0, and endpoint 1's next write stalled for
    ``stall`` seconds (a FaultyTransport). Yields (caches, their bytes before, endpoints)."""
    cs = caches(n)
    orig = [snapshot(c) for c in cs]
    async with cluster(cs, cfg(**kw), wrap={1: faulty()}) as eps:
        for ep in eps[1:]:
            publish(ep)
        eps[1].transport.stall_next_writes(1, stall)
        yield cs, orig, eps


@asynccontextmanager
async def copying(a, b, request) -> AsyncIterator[dict]:
    """Run ``a.load(request)`` in a task; enter once ``b``'s copy for it has started (and
    stalled), leave once the load has ended. The dict gets the load's ``result`` and
    ``done`` (its ``time.monotonic()``) when it returns."""
    out: dict = {}

    async def load():
        out["result"] = await a.load(request)
        out["done"] = time.monotonic()

    async with anyio.create_task_group() as tg:
        tg.start_soon(load)
        await b.transport.wait_stalled()               # the copy has started
        yield out


async def loads_again(a, cs, orig, pairs):
    """Endpoint 0 is fine afterwards: a load of ``pairs`` from rank 1 lands the right bytes."""
    await a.load(req(1, pairs))
    check(cs[0], orig[1], pairs)


async def not_unpacked_then_loads(a, cs, orig, pairs):
    """The cancelled load's copy was not unpacked (endpoint 0's caches are as before), and
    the next load (``pairs`` from rank 1) is right."""
    assert_caches_unchanged(cs[0], orig[0])
    await loads_again(a, cs, orig, pairs)


@asynccontextmanager
async def stalled_raw_copy() -> AsyncIterator[list]:
    """Two endpoints accepting bare copies: 0's channel to 1 is mapped and warm (one copy
    made), the send slab then holds other bytes, and 0's next write stalls ``STALL`` s."""
    async with cluster(caches(2), cfg(), raw_copies=True, wrap={0: faulty()}) as eps:
        a = eps[0]
        a.send_slab.tensor.copy_(torch.arange(16 * KiB) % 241)
        await copy_raw(a, 1, 16 * KiB)                  # mapped, warm
        a.send_slab.tensor.copy_(torch.arange(16 * KiB) % 239)
        a.transport.stall_next_writes(1, STALL)
        yield eps


async def test_cancelled_loader_waits_for_its_started_copy():
    async with stalled() as (cs, orig, (a, b)):
        reached_after_load = False
        t0 = time.monotonic()
        scope = anyio.CancelScope()

        async def cancel_once_started():
            await b.transport.wait_stalled()           # the copy has started
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_started)
            with scope:
                await a.load(req(1, [(3, 4)]))
                reached_after_load = True
        elapsed = time.monotonic() - t0
        assert scope.cancel_called and scope.cancelled_caught     # the caller saw it
        assert not reached_after_load
        assert elapsed >= STALL * MARGIN                          # waited for the copy
        assert b.transport.injected.writes_stalled == 1
        assert b.metrics.peer(0).batches_sent == 1                # the copy did complete
        assert_caches_unchanged(cs[0], orig[0])                   # ... and was not unpacked
        # the receive slab is free again and the next load is correct
        await loads_again(a, cs, orig, [(5, 6)])
        assert_same_bytes(cs[0][0][4], orig[0][0][4])


async def test_receive_slab_not_reused_before_the_cancelled_copy_ends():
    """With one receive slab, the next load waits for the cancelled copy's slab (with a
    pool, the slab stays lent instead: test_concurrency.py)."""
    async with stalled(3, receive_slabs=1) as (cs, orig, (a, b, c)):
        done = {}
        t0 = time.monotonic()

        scope = anyio.CancelScope()

        async def cancelled_load():
            with scope:
                await a.load(req(1, [(1, 1)]))
            done["cancelled"] = (time.monotonic() - t0, scope.cancelled_caught)

        async def next_load():
            await a.load(req(2, [(2, 2), (3, 3)]))
            done["next"] = time.monotonic() - t0

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancelled_load)
                await b.transport.wait_stalled()   # the copy has started
                scope.cancel()
                tg.start_soon(next_load)           # after the cancellation
        assert done["cancelled"][1]
        assert done["cancelled"][0] >= STALL * MARGIN
        assert done["next"] >= STALL * MARGIN      # waited for the slab, did not overtake
        check(cs[0], orig[2], [(2, 2), (3, 3)])
        untouched(cs, orig, 1)


@pytest.mark.parametrize("how", ["nested", "twice"])
async def test_cancel_twice(how):
    async with stalled() as (cs, orig, (a, b)):
        after = []
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as outer:
                with anyio.CancelScope() as inner:
                    async def canceller():
                        await b.transport.wait_stalled()   # the copy has started
                        inner.cancel()
                        await anyio.lowlevel.checkpoint()
                        (outer if how == "nested" else inner).cancel()
                    tg.start_soon(canceller)
                    await a.load(req(1, [(7, 8)]))
                    after.append("inner")
                after.append("outer")
        elapsed = time.monotonic() - t0
        assert elapsed >= STALL * MARGIN
        assert inner.cancel_called
        if how == "nested":
            assert outer.cancel_called and outer.cancelled_caught and after == []
        else:
            assert inner.cancelled_caught and after == ["outer"]
        await not_unpacked_then_loads(a, cs, orig, [(9, 10)])


@asyncio_only
async def test_native_asyncio_cancel_waits_for_the_copy():
    async with stalled() as (cs, orig, (a, b)):
        t0 = time.monotonic()
        task = asyncio.ensure_future(a.load(req(1, [(2, 3)])))
        await b.transport.wait_stalled()               # the copy has started
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()                                  # and once more
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 >= STALL * MARGIN
        assert task.cancelled()
        assert b.metrics.peer(0).batches_sent == 1
        await not_unpacked_then_loads(a, cs, orig, [(4, 5)])


@asyncio_only
async def test_asyncio_timeout_around_a_stalled_load():
    async with stalled() as (cs, orig, (a, b)):
        t0 = time.monotonic()
        timeout = asyncio.timeout(None)                # expires once the copy has started

        async def expire_once_started():
            await b.transport.wait_stalled()
            timeout.reschedule(asyncio.get_running_loop().time())

        expiry = asyncio.ensure_future(expire_once_started())
        with pytest.raises(TimeoutError):
            async with timeout:
                await a.load(req(1, [(2, 3)]))
        await expiry
        assert time.monotonic() - t0 >= STALL * MARGIN
        await not_unpacked_then_loads(a, cs, orig, [(2, 3)])


async def test_a_load_that_never_started_is_cancelled_at_once():
    """A load waiting for the (only) receive slab is cancelled at once, nothing sent: it
    ends while the first load's copy is still held (no clock)."""
    async with stalled(3, receive_slabs=1) as (cs, orig, (a, b, c)):
        b.transport.hold_next_writes(1)                # the first copy: held, not stalled
        res = {}
        scope = anyio.CancelScope()

        async def first():
            await a.load(req(1, [(0, 0)]))

        async def queued():
            with scope:
                await a.load(req(2, [(1, 1)]))      # waits for the receive slab
            res["queued"] = scope.cancelled_caught

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            try:
                with anyio.fail_after(30):             # a hang guard
                    await b.transport.wait_stalled()   # the first load's copy has started
                    tg.start_soon(queued)
                    while a.recv_slab_stats["waiting"] < 1:   # the queued load waits
                        await anyio.sleep(0.005)
                    scope.cancel()
                    while "queued" not in res:         # ...and ends, though the copy is held
                        await anyio.sleep(0.005)
                assert b.metrics.peer(0).batches_sent == 0   # the first copy has not ended
            finally:
                b.transport.release_held()
        assert res["queued"]
        assert c.metrics.peer(0).batches_sent == 0   # nothing was sent for it
        check(cs[0], orig[1], [(0, 0)])
        untouched(cs, orig, 1)


async def test_cancelled_registration_is_not_cached():
    cs = caches(2)
    async with cluster(cs, cfg(), raw_copies=True,
                       wrap={0: lambda f: CountingTransport(f, map_delay=STALL)}) as (a, b):
        a.send_slab.tensor.copy_(torch.arange(16 * KiB) % 253)
        scope = anyio.CancelScope()

        async def cancel_while_mapping():
            with anyio.fail_after(30):                 # a hang guard
                while a.transport.map_calls < 1:       # the registration has begun
                    await anyio.sleep(0.001)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_while_mapping)
            with scope:
                await copy_raw(a, 1, 100)
        assert scope.cancelled_caught and a.transport.map_done == 0   # cancelled mid-mapping
        ch = a.channel(1)
        assert mapped_views(ch) == () and ch.policy.state == "full"
        assert a.metrics.peer(1).batches_sent == 0
        assert await copy_raw(a, 1, 100) == 16 * KiB
        assert a.transport.map_calls == 2 and a.transport.map_done == 1
        assert_same_bytes(b.recv_slab.tensor, a.send_slab.tensor)


async def test_cancelled_raw_copy_waits_for_the_write():
    async with stalled_raw_copy() as (a, b):
        t0 = time.monotonic()
        scope = anyio.CancelScope()

        async def cancel_once_started():
            await a.transport.wait_stalled()           # the write has started
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_started)
            with scope:
                await copy_raw(a, 1, 16 * KiB)
        assert scope.cancelled_caught and time.monotonic() - t0 >= STALL * MARGIN
        assert_same_bytes(b.recv_slab.tensor, a.send_slab.tensor)   # the copy completed
        assert a.metrics.peer(1).batches_sent == 2


@asyncio_only
async def test_native_cancel_of_a_raw_copy_waits_for_the_write():
    async with stalled_raw_copy() as (a, b):
        t0 = time.monotonic()
        task = asyncio.ensure_future(copy_raw(a, 1, 16 * KiB))
        await a.transport.wait_stalled()               # the copy has started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - t0 >= STALL * MARGIN
        assert_same_bytes(b.recv_slab.tensor, a.send_slab.tensor)   # the copy completed
        assert a.metrics.peer(1).batches_sent == 2 and a.metrics.peer(1).failures == 0


# -- close --------------------------------------------------------------------------------

async def test_close_drains_in_flight_loads_then_rejects_new_work():
    async with stalled() as (cs, orig, (a, b)):
        t0 = time.monotonic()
        with anyio.fail_after(10):
            async with copying(a, b, req(1, [(6, 7), (8, 9)])) as out:
                await a.aclose()
                closed = time.monotonic() - t0
        assert out["result"].blocks == 4
        assert closed >= out["done"] - t0 >= STALL * MARGIN
        check(cs[0], orig[1], [(6, 7), (8, 9)])
        assert a.closed
        with pytest.raises(EndpointClosedError):
            await a.load(req(1, [(1, 1)]))
        with pytest.raises(EndpointClosedError):
            await a.connect(b.address)
        for _ in range(3):
            await a.aclose()                           # idempotent
        assert a.closed
        assert b.peers == ()                           # b saw a go
        assert_same_bytes(cs[0][0][1], orig[0][0][1])


async def test_source_close_drains_the_copy_it_is_serving():
    async with stalled() as (cs, orig, (a, b)):
        async with copying(a, b, req(1, [(2, 2)])) as out:
            t0 = time.monotonic()
            await b.aclose()
            assert time.monotonic() - t0 >= (STALL - EARLY) * MARGIN
        assert out["result"].blocks == 2
        check(cs[0], orig[1], [(2, 2)])
        assert a.peers == ()


async def test_concurrent_closes_all_wait_for_the_drain():
    async with stalled() as (cs, orig, (a, b)):
        ends = []
        t0 = time.monotonic()

        async def close():
            await a.aclose()
            ends.append(time.monotonic() - t0)

        async with copying(a, b, req(1, [(3, 3)])), anyio.create_task_group() as closers:
            for _ in range(3):
                closers.start_soon(close)
        assert len(ends) == 3 and min(ends) >= STALL * MARGIN
        check(cs[0], orig[1], [(3, 3)])


async def test_cancelled_close_still_finishes_cleanup():
    async with stalled() as (cs, orig, (a, b)):
        async with copying(a, b, req(1, [(4, 4)])) as out:
            t0 = time.monotonic()
            with anyio.move_on_after(EARLY) as scope:
                await a.aclose()
            assert scope.cancel_called
            assert time.monotonic() - t0 >= (STALL - EARLY) * MARGIN
            assert a.closed and lifecycle_phase(a).value == "closed"
        assert out["result"].blocks == 2
        check(cs[0], orig[1], [(4, 4)])
        assert b.peers == ()                            # the transport was released
        with pytest.raises(EndpointClosedError):
            await a.load(req(1, [(5, 5)]))
        await a.aclose()


@asyncio_only
async def test_native_cancel_of_close_still_finishes_cleanup():
    async with stalled() as (cs, orig, (a, b)):
        load = asyncio.ensure_future(a.load(req(1, [(4, 4)])))
        await b.transport.wait_stalled()               # the copy has started
        t0 = time.monotonic()
        closing = asyncio.ensure_future(a.aclose())
        await asyncio.sleep(0)                         # the close is draining
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert time.monotonic() - t0 >= (STALL - EARLY) * MARGIN
        assert a.closed and lifecycle_phase(a).value == "closed" and b.peers == ()
        assert (await load).blocks == 2
        check(cs[0], orig[1], [(4, 4)])


async def test_close_inside_the_context_does_not_cancel_the_caller():
    cs = caches(2)
    orig = [snapshot(c) for c in cs]
    reached = []
    async with cluster(cs, cfg()) as (a, b):
        publish(b)
        await a.load(req(1, [(1, 2)]))
        await a.aclose()
        await anyio.sleep(0)          # a checkpoint after close: the caller is not cancelled
        reached.append(1)
        with pytest.raises(EndpointClosedError):
            await a.load(req(1, [(1, 2)]))
        reached.append(2)
    assert reached == [1, 2]
    check(cs[0], orig[1], [(1, 2)])


async def test_close_before_enter_and_exit_after_close():
    from xavier_async import Endpoint, LocalTransport
    ep = Endpoint(0, caches(1)[0], LocalTransport(), cfg())
    await ep.aclose()
    await ep.aclose()
    assert ep.closed
    with pytest.raises(EndpointClosedError):
        async with ep:
            pass

"""The failure model of BRIEF section 5, driven by the fault-injecting transport."""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from xavier_async import (EndpointConfig, PeerLostError, RegistrationError, RetryPolicy,
                          TransferError, UnknownPeerError)
from xavier_async._internal import mapped_views
from xavier_async.bench.raw import copy_raw
from xavier_async.testing import FaultPlan, FaultyTransport

from .conftest import (KiB, CountingTransport, assert_caches_unchanged, assert_same_bytes,
                       cluster, faulty, random_cache, snapshot, zero_cache)

pytestmark = pytest.mark.anyio  # every test runs on asyncio and on trio

FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.001, multiplier=2.0, max_delay=0.004)


def cfg(**kw) -> EndpointConfig:
    kw.setdefault("retry", FAST_RETRY)
    return EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, **kw)


def three(seed: int = 0):
    """A receiver and two sources, each cache 32 slots of 64 float32 (256 B)."""
    return [{0: random_cache(32, (64,), torch.float32, seed=seed + i)} for i in range(3)]


def publish(ep, n=32):
    for s in range(n):
        ep.publish(f"k{s}", s)


def faulty_counting(map_delay: float = 0.0, **plan):
    def make(fabric):
        return FaultyTransport(CountingTransport(fabric, map_delay), FaultPlan(**plan))
    return make


# -- registration -------------------------------------------------------------------------

async def test_registration_failures_are_retried_with_backoff():
    retry = RetryPolicy(attempts=4, base_delay=0.02, multiplier=2.0, max_delay=1.0)
    caches = three()
    src = snapshot(caches[1])
    async with cluster(caches[:2], cfg(retry=retry), wrap={1: faulty_counting()}) as (a, b):
        publish(b)
        b.transport.fail_next_registrations(3)
        t0 = time.monotonic()
        await a.load({1: {0: {"k5": 0}}})
        elapsed = time.monotonic() - t0
        m = b.metrics.peer(0)
        assert m.retries == 3 and m.registrations == 1 and m.failures == 0
        assert b.transport.injected.registrations_failed == 3
        assert b.transport.inner.map_done == 1
        assert elapsed >= 0.02 + 0.04 + 0.08 - 0.005     # it backed off between attempts
    assert_same_bytes(caches[0][0][0], src[0][5])


async def test_registration_failure_beyond_budget_is_not_cached():
    caches = three()
    dst_before, src = snapshot(caches[0]), snapshot(caches[1])
    async with cluster(caches[:2], cfg(), wrap={1: faulty_counting()}) as (a, b):
        publish(b)
        b.transport.fail_next_registrations(FAST_RETRY.attempts)
        with pytest.raises(RegistrationError, match="after 3 attempt"):
            await a.load({1: {0: {"k1": 2}}})
        assert_caches_unchanged(caches[0], dst_before)
        ch = b.channel(0)
        assert mapped_views(ch) == ()                     # the failure was not cached
        assert ch.policy.state == "full"                 # and the machine did not move
        m = b.metrics.peer(0)
        assert m.failures == 1 and m.retries == 2 and m.registrations == 0
        assert a.metrics.peer(1).load_errors == 1
        # the next caller tries again and succeeds
        await a.load({1: {0: {"k1": 2}}})
        assert mapped_views(ch) == (16 * KiB,) and m.registrations == 1
        assert b.transport.inner.map_done == 1
    assert_same_bytes(caches[0][0][2], src[0][1])


async def test_registration_failure_through_copy_raw():
    async with cluster([{0: zero_cache(2, (4,), torch.float32)}] * 2,
                       cfg(), raw_copies=True, wrap={0: faulty()}) as (a, b):
        a.send_slab.tensor.copy_(torch.arange(16 * KiB) % 251)
        a.transport.fail_next_registrations(3)
        with pytest.raises(RegistrationError):
            await copy_raw(a, 1, 100)
        assert mapped_views(a.channel(1)) == ()
        assert await copy_raw(a, 1, 100) == 16 * KiB
        assert_same_bytes(b.recv_slab.tensor, a.send_slab.tensor)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_registration_failures_are_deterministic_and_recovered(seed):
    outcomes = []
    for _ in range(2):   # the same seed gives the same faults
        caches = three(seed)
        src = snapshot(caches[1])
        retry = RetryPolicy(attempts=12, base_delay=0.0, max_delay=0.0)
        async with cluster(caches[:2], cfg(retry=retry),
                           wrap={1: faulty(seed=seed, registration_failure_rate=0.6)}) as (a, b):
            publish(b)
            for s in range(6):
                await a.load({1: {0: {f"k{s}": s}}})
            # a reset drops the mappings: they are registered again, through the faults
            await b.channel(0).reset()
            for s in range(6, 10):
                await a.load({1: {0: {f"k{s}": s}}})
            outcomes.append((b.transport.injected.registrations_failed, b.metrics.peer(0).retries,
                             b.metrics.peer(0).registrations))
        assert_same_bytes(caches[0][0][:10], src[0][:10])
    assert outcomes[0] == outcomes[1]
    failed, retries, registrations = outcomes[0]
    assert registrations == 4 and retries == failed


async def test_concurrent_callers_share_one_in_flight_registration():
    async with cluster(three()[:2], cfg(), wrap={1: lambda f: CountingTransport(f, map_delay=0.05)}) as (a, b):
        ch = b.channel(0)
        results = {}

        async def get(i, view):
            results[i] = await ch.mapping(view)

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(get, i, "full" if i % 2 else "small")
        assert b.transport.map_calls == 2                  # one per view, not one per caller
        assert b.metrics.peer(0).registrations == 2
        full = {id(m) for i, m in results.items() if i % 2}
        small = {id(m) for i, m in results.items() if not i % 2}
        assert len(full) == 1 and len(small) == 1 and full != small
        assert await ch.mapping("full") is results[1]    # cached from now on
        assert b.transport.map_calls == 2


async def test_waiters_retry_after_the_leader_fails():
    retry = RetryPolicy(attempts=1)
    async with cluster(three()[:2], cfg(retry=retry), wrap={1: faulty_counting(map_delay=0.02)}) as (a, b):
        ch = b.channel(0)
        b.transport.fail_next_registrations(1)
        outcomes = []

        async def get():
            try:
                outcomes.append(await ch.mapping("full"))
            except RegistrationError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(get)
        errors = [o for o in outcomes if isinstance(o, RegistrationError)]
        mappings = {id(o) for o in outcomes if not isinstance(o, RegistrationError)}
        assert len(errors) == 1 and len(mappings) == 1      # the next caller retried, once
        assert b.transport.inner.map_calls == 1
        assert mapped_views(ch) == (16 * KiB,)


async def test_concurrent_loads_on_a_fresh_channel_register_once():
    caches = [{0: random_cache(32, (1024,), torch.float32, seed=i)} for i in range(2)]  # 4 KiB blocks
    dst_before, src = snapshot(caches[0]), snapshot(caches[1])
    # one slab each way: one mapping serves everything (a pool maps each slab pair once)
    async with cluster(caches, cfg(receive_slabs=1, send_slabs=1), raw_copies=True,
                       wrap={1: lambda f: CountingTransport(f, map_delay=0.02)}) as (a, b):
        publish(b)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for s in range(16):
                    tg.start_soon(a.load, {1: {0: {f"k{s}": s}}})
                for _ in range(8):
                    tg.start_soon(copy_raw, b, 0, 8 * KiB)
        assert b.transport.map_calls == 1                 # every batch was large: full view only
        assert b.metrics.peer(0).registrations == 1
        # 8 bare copies and 16 loads, some of them merged into one copy while they waited
        got = a.metrics.peer(1)
        assert got.batches_received + got.batches_merged == 16
        assert b.metrics.peer(0).batches_sent == 8 + got.batches_received
    assert_same_bytes(caches[0][0][:16], src[0][:16])
    assert_same_bytes(caches[0][0][16:], dst_before[0][16:])


# -- write failures -----------------------------------------------------------------------

@pytest.mark.parametrize("after_stall", [False, True])
async def test_write_failure_resets_only_that_peers_channel(after_stall):
    caches = three()
    orig = [snapshot(c) for c in caches]
    async with cluster(caches, cfg(), wrap={1: faulty()}) as (a, b, c):
        publish(b)
        for s in range(3):                  # both loaders reach the small view on b
            await a.load({1: {0: {f"k{s}": s}}})
            await c.load({1: {0: {f"k{s}": s}}})
        assert b.policy(0).state == b.policy(2).state == "small"
        assert mapped_views(b.channel(0)) == mapped_views(b.channel(2)) == (1 * KiB, 16 * KiB)
        b.transport.fail_next_writes(1)
        if after_stall:
            b.transport.stall_next_writes(1, 0.02)
        with pytest.raises(TransferError, match="rank 0"):
            await a.load({1: {0: {"k10": 10}}})
        assert_same_bytes(caches[0][0][10], orig[0][0][10])       # not unpacked
        ch = b.channel(0)
        assert ch.policy.state == "full" and mapped_views(ch) == ()
        m = b.metrics.peer(0)
        assert m.resets == 1 and m.failures == 1
        assert a.metrics.peer(1).load_errors == 1
        # the other peer is untouched: same state, same mappings, still the small view
        assert b.policy(2).state == "small" and mapped_views(b.channel(2)) == (1 * KiB, 16 * KiB)
        assert b.metrics.peer(2).resets == 0
        res = await c.load({1: {0: {"k11": 11}}})
        assert res.wire_bytes == 1 * KiB
        # and the failed peer recovers: registers again, starts from full
        res = await a.load({1: {0: {"k10": 10}}})
        assert res.wire_bytes == 16 * KiB
        assert m.registrations == 3 and b.metrics.peer(2).registrations == 2
    for s in (0, 1, 2, 10):
        assert_same_bytes(caches[0][0][s], orig[1][0][s])
    for s in (0, 1, 2, 11):
        assert_same_bytes(caches[2][0][s], orig[1][0][s])


@pytest.mark.parametrize("seed", [11, 12])
async def test_random_write_faults_never_corrupt(seed):
    counts = []
    for _ in range(2):
        caches = three(seed)
        orig = [snapshot(c) for c in caches]
        plan = dict(seed=seed, write_failure_rate=0.3, write_stall_rate=0.2, stall_seconds=0.002)
        async with cluster(caches, cfg(), wrap={1: faulty(**plan)}) as (a, b, c):
            publish(b)
            failed = set()
            for i in range(40):
                n = 1 + (i % 5) * 3
                slots = [(i + j) % 32 for j in range(n)]
                try:
                    await a.load({1: {0: {f"k{s}": s for s in slots}}})
                except TransferError:
                    failed.update(slots)
                else:
                    failed.difference_update(slots)
                    for s in slots:
                        assert_same_bytes(caches[0][0][s], orig[1][0][s])
            # every slot holds either its original bytes or the source's, never a mix
            for s in range(32):
                row = caches[0][0][s]
                assert torch.equal(row.view(torch.uint8), orig[1][0][s].view(torch.uint8)) or \
                    torch.equal(row.view(torch.uint8), orig[0][0][s].view(torch.uint8))
            inj = b.transport.injected
            assert b.metrics.peer(0).failures == inj.writes_failed == b.metrics.peer(0).resets
            assert a.metrics.peer(1).load_errors == inj.writes_failed
            counts.append((inj.writes_failed, inj.writes_stalled))
    assert counts[0] == counts[1] and counts[0][0] > 0 and counts[0][1] > 0


async def test_stalled_write_still_completes_with_correct_bytes():
    caches = three()
    src = snapshot(caches[1])
    async with cluster(caches[:2], cfg(), wrap={1: faulty()}) as (a, b):
        publish(b)
        b.transport.stall_next_writes(2, 0.1)
        t0 = time.monotonic()
        res = await a.load({1: {0: {"k3": 4, "k4": 3}}})
        assert time.monotonic() - t0 >= 0.095
        assert res.blocks == 2
        t0 = time.monotonic()
        await a.load({1: {0: {"k5": 5}}})
        assert time.monotonic() - t0 >= 0.095
        assert b.transport.injected.writes_stalled == 2
        assert b.metrics.peer(0).failures == 0
    assert_same_bytes(caches[0][0][4], src[0][3])
    assert_same_bytes(caches[0][0][3], src[0][4])
    assert_same_bytes(caches[0][0][5], src[0][5])


# -- lost peers ---------------------------------------------------------------------------

async def test_lost_peer_fails_pending_loads_promptly_and_others_keep_working():
    caches = three()
    orig = [snapshot(c) for c in caches]
    async with cluster(caches, cfg(), wrap={0: faulty(), 1: faulty()}) as (a, b, c):
        publish(b)
        publish(c)
        b.transport.hold_next_writes(1)                   # held until released: no clock
        try:
            with anyio.fail_after(30):                    # a hang guard only
                async with anyio.create_task_group() as tg:
                    async def doomed():
                        with pytest.raises(PeerLostError) as info:
                            await a.load({1: {0: {"k7": 7}}})
                        # failed by the loss (request_timeout is 60 s, past the guard)
                        assert "did not complete" not in str(info.value), info.value
                    tg.start_soon(doomed)
                    await b.transport.wait_stalled()      # the copy has started
                    a.transport.lose_peer(1)
            # the load failed while b's copy is still held: it did not wait for it
            assert b.transport.unsettled() == {0} and b.metrics.peer(0).failures == 0
            assert_same_bytes(caches[0][0][7], orig[0][0][7])
            assert a.peers == (2,)
            with pytest.raises(PeerLostError, match="was lost"):
                await a.load({1: {0: {"k8": 8}}})
            # the other source keeps working, during and after b's stalled copy
            await a.load({2: {0: {f"k{s}": s for s in range(16, 20)}}})
        finally:
            b.transport.release_held()
        with anyio.fail_after(5):
            while b.transport.injected.writes_stalled and b.metrics.peer(0).failures == 0:
                await anyio.sleep(0.02)                   # b's stalled copy has ended (failed)
        slab = a.recv_slab.tensor.clone()
        await anyio.sleep(0.05)
        assert torch.equal(a.recv_slab.tensor, slab)      # b wrote nothing into a's slab late
        await a.load({2: {0: {f"k{s}": s for s in range(20, 24)}}})
        # b and c still talk to each other
        await c.load({1: {0: {"k9": 9}}})
    assert_same_bytes(caches[0][0][16:24], orig[2][0][16:24])
    assert_same_bytes(caches[0][0][7:9], orig[0][0][7:9])
    assert_same_bytes(caches[2][0][9], orig[1][0][9])


async def test_peer_lost_after_n_writes_and_reconnect():
    caches = three()
    orig = [snapshot(c) for c in caches]
    async with cluster(caches, cfg(), wrap={1: faulty(lose_peer_after_writes={0: 3})}) as (a, b, c):
        publish(b)
        publish(c)
        await a.load({1: {0: {"k0": 0}}})
        await a.load({1: {0: {"k1": 1}}})
        with pytest.raises(PeerLostError):
            await a.load({1: {0: {"k2": 2}}})
        assert_same_bytes(caches[0][0][2], orig[0][0][2])
        assert a.peers == (2,) and b.peers == (2,)
        await a.load({2: {0: {"k3": 3}}})                 # c is unaffected
        # the peer comes back: a fresh channel from full, registered again
        await b.connect(a.address)
        assert a.peers == (1, 2)
        res = await a.load({1: {0: {"k2": 2}}})
        assert res.wire_bytes == 16 * KiB and b.policy(0).state == "streak_1"
    for s in (0, 1, 2):
        assert_same_bytes(caches[0][0][s], orig[1][0][s])
    assert_same_bytes(caches[0][0][3], orig[2][0][3])


async def test_unresponsive_source_times_out_and_cannot_write_late():
    caches = three()
    orig = [snapshot(c) for c in caches]
    async with cluster(caches, cfg(request_timeout=0.2), wrap={1: faulty()}) as (a, b, c):
        publish(b)
        publish(c)
        b.transport.hold_next_writes(1)                # never completes until released
        t0 = time.monotonic()
        try:
            with pytest.raises(PeerLostError, match="did not complete"):
                await a.load({1: {0: {"k4": 4}}})
            # gave up after the timeout (0.2 s; a hang guard above, not a speed bound: a
            # started copy is shielded, so a fail_after could not end the wait)...
            assert 0.19 <= time.monotonic() - t0 < 30
            assert b.transport.unsettled() == {0}      # ...while the copy was still held
            assert_same_bytes(caches[0][0][4], orig[0][0][4])
            assert 1 not in a.peers
            await a.load({2: {0: {"k5": 5}}})
            slab = a.recv_slab.tensor.clone()
        finally:
            b.transport.release_held()
        with anyio.fail_after(5):
            while b.metrics.peer(0).failures == 0:        # b's late copy failed, not landed
                await anyio.sleep(0.02)
        assert torch.equal(a.recv_slab.tensor, slab)
        await a.load({2: {0: {"k6": 6}}})
    assert_same_bytes(caches[0][0][5:7], orig[2][0][5:7])


async def test_closed_peer_is_dropped_and_others_keep_working():
    caches = three()
    orig = [snapshot(c) for c in caches]
    async with cluster(caches, cfg()) as (a, b, c):
        publish(b)
        publish(c)
        await b.aclose()
        assert a.peers == (2,) and c.peers == (0,)
        with pytest.raises(PeerLostError, match="was lost"):  # lost, not unknown
            await a.load({1: {0: {"k1": 1}}})
        await a.disconnect(1)                 # forgotten on purpose: unknown from now on
        with pytest.raises(UnknownPeerError):
            await a.load({1: {0: {"k1": 1}}})
        await a.load({2: {0: {"k1": 1}}})
    assert_same_bytes(caches[0][0][1], orig[2][0][1])


async def test_malformed_requests_from_a_peer_are_refused_and_the_source_keeps_serving():
    """A peer that sends garbage gets an error reply; the source's endpoint survives."""
    from xavier_async import Endpoint, LocalFabric, RemoteError
    from xavier_async.protocol import Load

    fabric = LocalFabric()
    src = {0: torch.arange(64, dtype=torch.float32).view(8, 8)}
    dst = {0: torch.zeros(8, 8)}
    cfg = EndpointConfig(full_bytes=4096, small_bytes=1024)
    async with Endpoint(0, src, fabric.transport(), cfg) as a, \
            Endpoint(1, dst, fabric.transport(), cfg) as b:
        await b.connect(a.address)
        a.publish("k", 3)
        for body in ([1, [[0, [[1, 2]]]]],      # an unhashable key
                     [2, [[[0], ["k"]]]],        # an unhashable layer
                     [3, [[0, 7]]],              # keys that are not a list
                     [4, "nonsense"]):
            replied = anyio.Event()
            waiter = b._receiver.requests.open(0, replied.set)  # as if b had sent this request
            await b.transport.send(0, Load(waiter.req_id, body[1]).to_wire())
            with anyio.fail_after(5):
                await replied.wait()
            assert isinstance(waiter.error, RemoteError), body
            b._receiver.requests.close(waiter)
        await b.load({0: {0: {"k": 5}}})
        assert torch.equal(dst[0][5], src[0][3])

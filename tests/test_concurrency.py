"""Many loads in flight: the receive-slab and send-slab pools (issue 11).

In process (LocalTransport, FaultyTransport holding writes until the test lets them go, so
"while these copies are in flight" is an ordering, never a clock), and over real NIXL
between three processes. Every load's bytes are checked.
"""

from __future__ import annotations

import random
from contextlib import asynccontextmanager

import anyio
import pytest
import torch

from xavier_async import (EndpointClosedError, EndpointConfig, IntegrityError, InvalidRequestError,
                          PeerLostError, RemoteError, XavierError)

from .conftest import (KiB, assert_same_bytes, cancel_and_wait, cancellable, cluster, faulty,
                       fenced_slabs, forming_groups, queued_at_source, random_cache, recv_pool,
                       recv_slab, snapshot, until, zero_cache)

anyio_test = pytest.mark.anyio   # the in-process tests run on asyncio and trio

SLOTS = 128
K, S = 4, 4
#: the snapshot store's tiers (device and host), each registered once at start
T = 2
CFG = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB)   # default pools: K = S = 4
SMALL = [0]                       # one 1 KiB block: fits the small view
LARGE = [0, 1, 2, 3, 4, 5]        # six blocks: a large batch


def caches(n: int) -> list[dict[int, torch.Tensor]]:
    """Rank 0 loads (zeros); the others serve random bytes (1 KiB blocks)."""
    return [{0: zero_cache(SLOTS, (256,), torch.float32)}] + [
        {0: random_cache(SLOTS, (256,), torch.float32, seed=r)} for r in range(1, n)]


def publish(*eps) -> None:
    for ep in eps:
        for s in range(SLOTS):
            ep.publish(s, s)


def req(src: int, keys: list[int], slot0: int) -> dict:
    return {src: {0: {k: slot0 + i for i, k in enumerate(keys)}}}


def check(dst, srcs, request: dict) -> None:
    for src, layers in request.items():
        for key, slot in layers[0].items():
            assert_same_bytes(dst[0][slot], srcs[src][0][key])


def random_requests(rng: random.Random, sizes: list[int]) -> list[dict]:
    """16 loads from ranks 1 and 2 in turn, of ``rng.choice(sizes)`` random keys each, into
    distinct slots (6i .. 6i + 5)."""
    return [req(1 + i % 2, rng.sample(range(SLOTS), rng.choice(sizes)), slot0=6 * i)
            for i in range(16)]


async def load_concurrently(ep, cs, requests: list[dict]) -> None:
    """Start every load at once (a task each), wait for all, then check every byte."""
    async with anyio.create_task_group() as tg:
        for r in requests:
            tg.start_soon(ep.load, r)
    for r in requests:
        check(cs[0], cs, r)


def free_slabs(ep) -> int:
    """Receive slabs free in the pool now (in the pool and not lent)."""
    stats = ep.recv_slab_stats
    return stats["usable"] - stats["in_use"]


@asynccontextmanager
async def served(cfg=CFG, n: int = 2, wrap=None):
    """The setup of most tests here: ``caches(n)`` in a cluster, rank 0 loading, ranks 1..
    publishing every slot. ``wrap`` as for ``cluster``; by default every source is behind a
    FaultyTransport (whose writes a test can hold). Yields (caches, endpoints)."""
    cs = caches(n)
    async with cluster(cs, cfg, wrap={r: faulty() for r in range(1, n)} if wrap is None else wrap) as eps:
        publish(*eps[1:])
        yield cs, eps


def test_config_validates_the_pool_sizes():
    assert (CFG.receive_slabs, CFG.send_slabs) == (K, S)
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(InvalidRequestError, match="receive_slabs"):
            EndpointConfig(receive_slabs=bad)
        with pytest.raises(InvalidRequestError, match="send_slabs"):
            EndpointConfig(send_slabs=bad)


@anyio_test
async def test_many_loads_in_flight_from_two_sources_every_byte_checked():
    """16 concurrent loads, small and large, from two sources; the sources' first writes
    are held until K loads are in flight at once (so the pools really are used)."""
    async with served(CFG, 3) as (cs, (a, b, c)):
        rng = random.Random(5)
        # distinct destination slots per load: slots 6i .. 6i + 5
        requests = [req(1 + i % 2, rng.sample(range(SLOTS), 1 if i % 4 < 2 else len(LARGE)),
                        slot0=6 * i) for i in range(16)]
        b.transport.hold_next_writes(2)
        c.transport.hold_next_writes(2)
        async with anyio.create_task_group() as tg:
            for r in requests:
                tg.start_soon(a.load, r)
            # four copies in flight at once: two served by b, two by c, four receive slabs
            await b.transport.wait_stalled(2)
            await c.transport.wait_stalled(2)
            assert a.recv_slab_stats["in_use"] == K
            b.transport.release_held()
            c.transport.release_held()
        for r in requests:
            check(cs[0], cs, r)
        assert a.metrics.loads == 16
        assert a.recv_slab_stats["in_use"] == 0 and a.recv_slab_stats["usable"] == K


@anyio_test
async def test_one_slab_each_way_is_the_one_batch_at_a_time_design():
    """K = S = 1: two slab registrations per endpoint (and the store's tiers), one batch in flight at a time, and
    concurrent loads still all complete with the right bytes (they queue)."""
    one = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, receive_slabs=1, send_slabs=1)
    async with served(one, 3, wrap={}) as (cs, (a, b, c)):
        assert all(ep.transport.memory_registrations == 2 + T for ep in (a, b, c))
        rng = random.Random(2)
        requests = [req(1 + i % 2, rng.sample(range(SLOTS), 1 if i % 3 else len(LARGE)), slot0=6 * i)
                    for i in range(16)]
        async with anyio.create_task_group() as tg:
            for r in requests:
                tg.start_soon(a.load, r)
            await until(lambda: a.recv_slab_stats["waiting"] > 1, "loads queue for the one slab")
            assert a.recv_slab_stats["in_use"] == 1
        for r in requests:
            check(cs[0], cs, r)
        assert all(ep.transport.memory_registrations == 2 + T for ep in (a, b, c))


@anyio_test
async def test_a_source_serves_several_copies_at_once_to_one_and_to_several_peers():
    cs = caches(2) + [{0: zero_cache(SLOTS, (256,), torch.float32)}]
    async with cluster(cs, CFG, wrap={1: faulty()}) as (a, b, d):
        publish(b)
        b.transport.hold_next_writes(3)
        ra, ra2, rd = req(1, [1], 0), req(1, [2], 1), req(1, [3], 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.load, ra)
            tg.start_soon(a.load, ra2)
            tg.start_soon(d.load, rd)
            await b.transport.wait_stalled(3)    # two copies to rank 0 and one to rank 2
            assert b.recv_slab_stats["sends_in_use"] == 3
            b.transport.release_held()
        check(cs[0], cs, ra)
        check(cs[0], cs, ra2)
        check(cs[2], cs, rd)
        assert b.recv_slab_stats["sends_in_use"] == 0


@anyio_test
async def test_queued_requests_get_send_slabs_in_arrival_order():
    """With the source's one send slab busy, requests queue; they are served in the order
    they arrived (each write's target receive slab tells which request it serves)."""
    cfgs = [CFG, EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, send_slabs=1)]
    async with served(cfgs) as (cs, (a, b)):
        inner = b.transport.inner
        order: list[int] = []
        post = inner.post

        def recording_post(peer, mapping, nbytes, notify):
            order.append(mapping.slab)
            return post(peer, mapping, nbytes, notify)

        inner.post = recording_post
        b.transport.hold_next_writes(1)
        rs = [req(1, [i], slot0=i) for i in range(K)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.load, rs[0])
            await b.transport.wait_stalled(1)
            for n, r in enumerate(rs[1:], start=1):
                tg.start_soon(a.load, r)
                await until(lambda: queued_at_source(b) == n, "queued at the source, in this order")
            slabs = sorted(recv_pool(a)[1])          # each load holds its own receive slab
            b.transport.release_held()
        assert order == slabs == [0, 1, 2, 3]
        for r in rs:
            check(cs[0], cs, r)


@anyio_test
@pytest.mark.parametrize("receive_slabs", [K, 1])
async def test_a_small_load_completes_while_large_ones_are_stalled(receive_slabs):
    """No head-of-line blocking: with K - 1 large copies held, one more large load waits
    and a small one goes through (its bytes checked) before any large one has finished.
    With one receive slab there is no reservation: the small load waits too."""
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, receive_slabs=receive_slabs)
    async with served(cfg) as (cs, (a, b)):
        held = max(1, receive_slabs - 1)
        large = [req(1, LARGE, slot0=8 * i) for i in range(held + 1)]
        small = req(1, [40], slot0=60)
        b.transport.hold_next_writes(held)
        done: list[str] = []

        async def load(name: str, r: dict) -> None:
            await a.load(r)
            done.append(name)

        async with anyio.create_task_group() as tg:
            for i, r in enumerate(large[:held]):
                tg.start_soon(load, f"large{i}", r)
            await b.transport.wait_stalled(held)
            tg.start_soon(load, "large-waiting", large[held])
            await until(lambda: a.recv_slab_stats["waiting"] == 1, "the extra large load waits")
            tg.start_soon(load, "small", small)
            if receive_slabs > 1:
                with anyio.fail_after(10):
                    await until(lambda: "small" in done, "the small load finished")
                assert done == ["small"]                    # no large copy has finished
                check(cs[0], cs, small)
                assert a.recv_slab_stats["waiting"] == 1    # the extra large one still waits
            else:
                await until(lambda: a.recv_slab_stats["waiting"] == 2, "both wait")
                assert done == []
            b.transport.release_held()
        assert sorted(done) == sorted([f"large{i}" for i in range(held)] + ["large-waiting", "small"])
        for r in large + [small]:
            check(cs[0], cs, r)


@anyio_test
async def test_back_pressure_is_a_wait_never_an_error():
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, receive_slabs=2, send_slabs=2)
    async with served(cfg) as (cs, (a, b)):
        b.transport.hold_next_writes(2)
        rs = [req(1, [i], slot0=i) for i in range(6)]
        async with anyio.create_task_group() as tg:
            for r in rs:
                tg.start_soon(a.load, r)
            await b.transport.wait_stalled(2)
            await until(lambda: a.recv_slab_stats["waiting"] == 4, "four loads wait for a slab")
            assert a.recv_slab_stats["in_use"] == 2 and b.recv_slab_stats["sends_in_use"] == 2
            b.transport.release_held()
        for r in rs:
            check(cs[0], cs, r)
        assert a.recv_slab_stats["registered_since_start"] == 0


@anyio_test
async def test_cancelling_a_load_that_waits_for_a_slab_takes_nothing():
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, receive_slabs=2)
    async with served(cfg) as (cs, (a, b)):
        before = snapshot(cs[0])
        b.transport.hold_next_writes(2)
        rs = [req(1, [i], slot0=i) for i in range(2)]
        scope, outcome, waiting_load = cancellable(a, req(1, [9], slot0=20))

        async with anyio.create_task_group() as tg:
            for r in rs:
                tg.start_soon(a.load, r)
            await b.transport.wait_stalled(2)
            tg.start_soon(waiting_load)
            await until(lambda: a.recv_slab_stats["waiting"] == 1, "it waits for a slab")
            assert await cancel_and_wait(scope, outcome)
            stats = a.recv_slab_stats
            assert stats["waiting"] == 0 and stats["in_use"] == 2     # it took nothing
            b.transport.release_held()
        assert b.metrics.peer(0).batches_sent == 2                     # nothing sent for it
        assert_same_bytes(cs[0][0][20], before[0][20])
        for r in rs:
            check(cs[0], cs, r)
        assert a.recv_slab_stats["in_use"] == 0 and a.recv_slab_stats["usable"] == 2


@anyio_test
async def test_a_cancelled_load_keeps_its_slab_until_its_copy_is_terminal():
    async with served() as (cs, (a, b)):
        before = snapshot(cs[0])
        b.transport.hold_next_writes(1)
        scope, outcome, cancelled_load = cancellable(a, req(1, [5], slot0=5))

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled_load)
            await b.transport.wait_stalled(1)
            scope.cancel()
            # meanwhile other loads use the other slabs, never the lent one
            _, lent = recv_pool(a)
            for i in range(8):
                r = req(1, [10 + i], slot0=10 + i)
                await a.load(r)
                check(cs[0], cs, r)
                assert recv_pool(a)[1] >= lent
            assert "cancelled" not in outcome and a.recv_slab_stats["in_use"] == 1
            b.transport.release_held()
        assert outcome["cancelled"]
        assert a.recv_slab_stats["in_use"] == 0                        # back once terminal
        assert_same_bytes(cs[0][0][5], before[0][5])                   # not unpacked


@anyio_test
async def test_a_lost_peer_fails_only_its_own_loads():
    async with served(CFG, 3) as (cs, (a, b, c)):
        b.transport.hold_next_writes(2)
        c.transport.hold_next_writes(1)
        results: dict[str, BaseException | None] = {}
        rs = {"b0": req(1, [1], 0), "b1": req(1, [2], 1), "c0": req(2, LARGE, 8), "c1": req(2, [3], 2)}

        async def load(name: str) -> None:
            try:
                await a.load(rs[name])
                results[name] = None
            except PeerLostError as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            for name in rs:
                tg.start_soon(load, name)
            await b.transport.wait_stalled(2)
            await c.transport.wait_stalled(1)
            b.transport.lose_peer(0)                   # rank 1 vanishes with two copies in flight
            await until(lambda: "b0" in results and "b1" in results, "rank 1's loads failed")
            c.transport.release_held()
            b.transport.release_held()
        assert isinstance(results["b0"], PeerLostError) and isinstance(results["b1"], PeerLostError)
        assert results["c0"] is None and results["c1"] is None
        check(cs[0], cs, rs["c0"])
        check(cs[0], cs, rs["c1"])
        r = req(2, LARGE, 30)                           # the pool still works
        await a.load(r)
        check(cs[0], cs, r)


@anyio_test
async def test_close_drains_every_load_in_flight():
    async with served(CFG, 3) as (cs, (a, b, c)):
        b.transport.hold_next_writes(2)
        c.transport.hold_next_writes(2)
        rs = [req(1, [1], 0), req(1, LARGE, 8), req(2, [2], 1), req(2, LARGE, 16)]
        done: list[int] = []
        closed = anyio.Event()

        async def load(i: int) -> None:
            await a.load(rs[i])
            done.append(i)

        async def close() -> None:
            await a.aclose()
            closed.set()

        async with anyio.create_task_group() as tg:
            for i in range(len(rs)):
                tg.start_soon(load, i)
            await b.transport.wait_stalled(2)
            await c.transport.wait_stalled(2)
            tg.start_soon(close)
            await until(lambda: a.closed, "closing")
            with pytest.raises(EndpointClosedError):
                await a.load(req(1, [3], 3))              # new work is refused
            assert not closed.is_set() and done == []     # close waits for the copies
            b.transport.release_held()
            c.transport.release_held()
        assert closed.is_set() and sorted(done) == [0, 1, 2, 3]
        for r in rs:
            check(cs[0], cs, r)


@anyio_test
async def test_registrations_are_s_plus_k_at_start_and_none_after_warm_up():
    async with served(CFG, 3, wrap={}) as (cs, (a, b, c)):
        for ep in (a, b, c):
            assert ep.transport.memory_registrations == S + K + T
            assert ep.recv_slab_stats["registered_at_start"] == S + K + T
        rng = random.Random(1)
        for _ in range(5):
            await load_concurrently(a, cs, random_requests(rng, [1, 1, 6]))
        for ep in (a, b, c):
            assert ep.transport.memory_registrations == S + K + T
            assert ep.recv_slab_stats["registered_since_start"] == 0
        for ep in (b, c):   # view mappings: at most one per (send slab, view, receive slab)
            assert ep.metrics.peer(0).registrations <= S * 2 * K


@anyio_test
async def test_eager_mapping_maps_every_pair_when_a_peer_joins_and_nothing_after():
    """map_eagerly: each source maps 2 x S x K (send slab, view, receive slab) pairs for
    the loader as it joins; concurrent loads then register nothing at all."""
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, map_eagerly=True)
    async with served(cfg, 3, wrap={}) as (cs, (a, b, c)):
        for ep in (a, b, c):   # every pair is connected: each maps for both its peers
            for p in ep.peers:
                await until(lambda ep=ep, p=p: ep.metrics.peer(p).registrations == 2 * S * K,
                            f"rank {ep.rank} mapped everything for rank {p}")
        before = [ep.snapshot_metrics()["registrations"] for ep in (a, b, c)]
        rng = random.Random(2)
        for _ in range(3):
            await load_concurrently(a, cs, random_requests(rng, [1, 6]))
        assert [ep.snapshot_metrics()["registrations"] for ep in (a, b, c)] == before


@anyio_test
async def test_verify_checks_each_concurrent_batch_in_its_own_slab():
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, verify=True)
    async with served(cfg) as (cs, (a, b)):
        before = snapshot(cs[0])
        b.transport.hold_next_writes(3)
        rs = [req(1, LARGE, 0), req(1, [7], 10), req(1, LARGE, 20)]
        results: list[object] = [None] * 4

        async def load(i: int, r: dict) -> None:
            try:
                await a.load(r)
                results[i] = "ok"
            except IntegrityError as exc:
                results[i] = exc

        async with anyio.create_task_group() as tg:
            for i, r in enumerate(rs):
                tg.start_soon(load, i, r)
            await b.transport.wait_stalled(3)
            b.transport.corrupt_next_writes(1)          # the next write, while three are held
            tg.start_soon(load, 3, req(1, [8], 30))
            await until(lambda: results[3] is not None, "the corrupted load ended")
            b.transport.release_held()
        assert isinstance(results[3], IntegrityError)
        assert_same_bytes(cs[0][0][30], before[0][30])   # not unpacked
        assert results[:3] == ["ok"] * 3
        for r in rs:
            check(cs[0], cs, r)


@anyio_test
async def test_a_fenced_slab_leaves_the_pool_and_the_others_carry_on():
    """A timed-out copy's receive slab is fenced: it leaves the pool, loads go on in the
    others; when they are all busy and loads wait, one replacement is registered (caused
    by the fence), the stale writer's late write lands only in the fenced slab, and its
    late reply makes it a spare, which the next fence uses instead of registering."""
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, request_timeout=0.2)
    async with served(cfg, 3, wrap={1: faulty(late_writes_land=True)}) as (cs, (a, b, c)):
        b.transport.hold_next_writes(1)
        with pytest.raises(PeerLostError):
            await a.load(req(1, [3], 3))
        stats = a.recv_slab_stats
        assert stats["fenced_now"] == 1 and stats["usable"] == K - 1
        assert stats["registered_since_start"] == 0      # not needed yet: three are free
        fenced = next(iter(fenced_slabs(a)))
        await load_concurrently(a, cs, [req(2, [i], 10 + i) for i in range(12)])
        stats = a.recv_slab_stats
        assert stats["usable"] == K and stats["registered_since_start"] == 1  # one, for the fence
        assert fenced in fenced_slabs(a) and fenced not in recv_pool(a)[0]
        assert_same_bytes(cs[0][0][3], torch.zeros(256))
        b.transport.release_held()                      # the stale write lands, late
        await until(lambda: a.recv_slab_stats["fenced_now"] == 0, "its late reply released it")
        slab = recv_slab(a, fenced)
        assert_same_bytes(slab.tensor[: 1 * KiB].view(torch.float32), cs[1][0][3])
        stats = a.recv_slab_stats
        assert stats["spares"] == 1 and stats["usable"] == K and stats["released_late"] == 1
        assert_same_bytes(cs[0][0][3], torch.zeros(256))    # never unpacked
        # another fence: the spare takes its place, no registration
        await a.connect(b.address)
        b.transport.hold_next_writes(1)
        with pytest.raises(PeerLostError):
            await a.load(req(1, [4], 4))
        stats = a.recv_slab_stats
        assert stats["usable"] == K and stats["spares"] == 0 and stats["registered_since_start"] == 1
        r = req(2, LARGE, 40)
        await a.load(r)
        check(cs[0], cs, r)
        b.transport.release_held()


# -- merging batches that wait for a slab (EndpointConfig.merge_loads) ----------------------

ONE = EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB, receive_slabs=1, send_slabs=1)


@asynccontextmanager
async def releasing(b):
    """A task group whose exit lets ``b``'s held writes go, whatever happened in it (a
    failed check then fails the test instead of waiting for a copy forever)."""
    async with anyio.create_task_group() as tg:
        try:
            yield tg
        finally:
            b.transport.release_held()


async def _fill_the_slab(a, b, tg, slot0: int = 100) -> dict:
    """Start a load whose write is held: the only receive slab is busy until released."""
    first = req(1, [50], slot0=slot0)
    b.transport.hold_next_writes(1)
    tg.start_soon(a.load, first)
    await b.transport.wait_stalled(1)
    return first


class _GroupOfTwo:
    """What :func:`_group_of_two` set up: rank 0's caches and their bytes before, the first
    load (holding the only slab), the member that stays (slot 0) and the one that may
    leave (slot 1: its scope and outcome)."""

    def __init__(self, a, cs) -> None:
        self.cs, self.before = cs, snapshot(cs[0])
        self.scope, self.outcome, self.leaving = cancellable(a, req(1, [11], slot0=1))
        self.first: dict = {}
        self.stay = req(1, [10], slot0=0)

    def check_only_the_stayer_landed(self) -> None:
        """The leaver's slot kept its bytes; the first load and the stayer landed."""
        assert_same_bytes(self.cs[0][0][1], self.before[0][1])
        check(self.cs[0], self.cs, self.first)
        check(self.cs[0], self.cs, self.stay)


@asynccontextmanager
async def _group_of_two():
    """Two endpoints with one slab each way (``ONE``): fill the slab, then start a load
    that may leave and one that stays; enter once both wait in one group, yielding
    (a, b, the group); on exit ``b``'s held writes go (:func:`releasing`)."""
    async with served(ONE) as (cs, (a, b)), releasing(b) as tg:
        g = _GroupOfTwo(a, cs)
        g.first = await _fill_the_slab(a, b, tg)
        tg.start_soon(g.leaving)
        tg.start_soon(a.load, g.stay)
        await until(lambda: forming_groups(a) == {(1, False): 2}, "both in one group")
        yield a, b, g


async def _three_waiting(a, b, tg, results: dict) -> tuple[dict, list[dict]]:
    """Fill the slab, then start three loads of 2 KiB each that wait for it (their
    results go to ``results``): (the first load, the three)."""
    rs = [req(1, [10 + i, 20 + i], slot0=2 * i) for i in range(3)]

    async def load(i: int) -> None:
        results[i] = await a.load(rs[i])

    first = await _fill_the_slab(a, b, tg)
    for i in range(3):
        tg.start_soon(load, i)
    return first, rs


@anyio_test
async def test_batches_that_wait_for_a_slab_go_out_in_one_copy():
    async with served(ONE) as (cs, (a, b)):
        results: dict = {}
        async with releasing(b) as tg:
            first, rs = await _three_waiting(a, b, tg, results)
            # 4 KiB small view: two of the three 2 KiB batches form a group, the third
            # starts another (both wait for the slab: two places in its queue, not three)
            await until(lambda: a.recv_slab_stats["waiting"] == 2 and forming_groups(a).get((1, False)) == 1,
                        "two groups wait")
            b.transport.release_held()
        m = a.metrics.peer(1)
        assert (m.batches_received, m.batches_merged) == (3, 1)
        assert b.metrics.peer(0).batches_sent == 3
        # each load is charged its share of its copy: 4 KiB (the small view) for the
        # group of two, all of the second group's 4 KiB for the one alone
        shares = sorted(r.wire_bytes for r in results.values())
        assert shares == [2 * KiB, 2 * KiB, 4 * KiB] and sum(r.blocks for r in results.values()) == 6
        for r in [first, *rs]:
            check(cs[0], cs, r)


@anyio_test
async def test_merge_small_bytes_lets_a_group_of_small_batches_grow_past_the_small_view():
    """With ``merge_small_bytes`` above the small view, small batches that wait merge up to
    it: three 2 KiB batches ride in one copy (through the full view: 6 KiB exceeds the
    4 KiB small view), each charged a third of it; every byte checked."""
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB, receive_slabs=1, send_slabs=1,
                         merge_small_bytes=8 * KiB)
    async with served(cfg) as (cs, (a, b)):
        results: dict = {}
        async with releasing(b) as tg:
            first, rs = await _three_waiting(a, b, tg, results)
            await until(lambda: forming_groups(a).get((1, False)) == 3, "one group of three")
            assert a.recv_slab_stats["waiting"] == 1
            b.transport.release_held()
        m = a.metrics.peer(1)
        assert (m.batches_received, m.batches_merged) == (2, 2)
        assert sorted(r.wire_bytes for r in results.values()) == [16 * KiB // 3] * 3
        for r in [first, *rs]:
            check(cs[0], cs, r)


def test_merge_small_bytes_is_validated_against_the_views():
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB)
    assert cfg.merge_small_bytes == 4 * KiB                     # default: the small view
    assert EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB,
                          merge_small_bytes=16 * KiB).merge_small_bytes == 16 * KiB
    for bad in (2 * KiB, 17 * KiB, 4.5 * KiB, True, "8KiB"):
        with pytest.raises(InvalidRequestError, match="merge_small_bytes"):
            EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB, merge_small_bytes=bad)


# -- a cap on small round trips per source (EndpointConfig.small_round_trips) ----------------

CAPPED = EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB, small_round_trips=1)   # K = S = 4


@anyio_test
async def test_small_round_trips_caps_the_small_copies_in_flight_to_a_source():
    """With one small round trip per source, small loads that arrive while one is in
    flight wait in one group although three slabs are free, and go out as one copy when
    it ends; a large load from the same source is not held by the cap; every byte checked."""
    async with served(CAPPED) as (cs, (a, b)):
        results: dict = {}
        async with releasing(b) as tg:
            first = await _fill_the_slab(a, b, tg)           # one small copy in flight (held)
            rs = [req(1, [10 + i], slot0=i) for i in range(3)]
            for i, r in enumerate(rs):
                tg.start_soon(lambda i=i, r=r: _into(results, i, a.load(r)))
            await until(lambda: forming_groups(a).get((1, False)) == 3, "the three wait in one group")
            assert free_slabs(a) == K - 1 and a.recv_slab_stats["lanes_waiting"] == 1
            big = req(1, LARGE, slot0=20)
            await a.load(big)                               # large: past the cap, at once
            check(cs[0], cs, big)
            assert len(results) == 0 and a.recv_slab_stats["lanes_held"] == 1
            b.transport.release_held()
        m = a.metrics.peer(1)
        assert (m.batches_received, m.batches_merged) == (3, 2)   # first, large, the group
        stats = a.recv_slab_stats
        assert stats["lanes_held"] == stats["lanes_waiting"] == 0 and free_slabs(a) == K
        for r in [first, *rs]:
            check(cs[0], cs, r)


async def _into(results: dict, i: int, load) -> None:
    results[i] = await load


@anyio_test
async def test_a_load_cancelled_while_waiting_for_a_small_round_trip_takes_nothing():
    """Cancelled while its group waits for the source's one small round trip, a load
    leaves the lane queue and takes no slab; its slot keeps its contents and the next
    load goes through."""
    async with served(CAPPED) as (cs, (a, b)):
        async with releasing(b) as tg:
            first = await _fill_the_slab(a, b, tg)
            scope, outcome, run = cancellable(a, req(1, [7], slot0=3))
            tg.start_soon(run)
            await until(lambda: a.recv_slab_stats["lanes_waiting"] == 1, "waits for the round trip")
            assert await cancel_and_wait(scope, outcome)
            stats = a.recv_slab_stats
            assert stats["groups_forming"] == 0 and stats["lanes_waiting"] == 0
            assert free_slabs(a) == K - 1               # only the held copy's slab is out
            b.transport.release_held()
        assert_same_bytes(cs[0][0][3], torch.zeros(256))    # never written
        assert a.recv_slab_stats["lanes_held"] == 0 and free_slabs(a) == K
        nxt = req(1, [8], slot0=4)
        await a.load(nxt)
        for r in (first, nxt):
            check(cs[0], cs, r)


def test_small_round_trips_is_validated():
    assert EndpointConfig().small_round_trips is None
    assert EndpointConfig(small_round_trips=2).small_round_trips == 2
    for bad in (0, 1025, 1.5, True, "1"):
        with pytest.raises(InvalidRequestError, match="small_round_trips"):
            EndpointConfig(small_round_trips=bad)
    with pytest.raises(InvalidRequestError, match="merge_loads"):
        EndpointConfig(small_round_trips=1, merge_loads=False)


@anyio_test
async def test_merging_off_is_one_copy_per_batch():
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=4 * KiB, receive_slabs=1, send_slabs=1,
                         merge_loads=False)
    async with served(cfg) as (cs, (a, b)):
        rs = [req(1, [10 + i], slot0=i) for i in range(3)]
        async with releasing(b) as tg:
            first = await _fill_the_slab(a, b, tg)
            for r in rs:
                tg.start_soon(a.load, r)
            await until(lambda: a.recv_slab_stats["waiting"] == 3, "each waits on its own")
            b.transport.release_held()
        assert (a.metrics.peer(1).batches_received, a.metrics.peer(1).batches_merged) == (4, 0)
        for r in [first, *rs]:
            check(cs[0], cs, r)


@anyio_test
async def test_a_member_cancelled_before_its_group_starts_takes_nothing():
    async with _group_of_two() as (a, b, g):
        assert await cancel_and_wait(g.scope, g.outcome)
        b.transport.release_held()
    assert a.metrics.peer(1).batches_merged == 0          # the group carried one batch
    g.check_only_the_stayer_landed()                       # nothing requested for it


@anyio_test
async def test_when_every_member_leaves_the_group_leaves_the_slab_queue():
    async with served(ONE) as (cs, (a, b)):
        scope, outcome, leaving = cancellable(a, req(1, [11], slot0=1))
        async with releasing(b) as tg:
            first = await _fill_the_slab(a, b, tg)
            tg.start_soon(leaving)
            await until(lambda: a.recv_slab_stats["waiting"] == 1, "the group waits")
            await cancel_and_wait(scope, outcome)
            stats = a.recv_slab_stats
            assert stats["waiting"] == 0 and stats["groups_forming"] == 0
            b.transport.release_held()
        assert b.metrics.peer(0).batches_sent == 1
        check(cs[0], cs, first)
        later = req(1, [12], slot0=2)                          # the slab is free again
        await a.load(later)
        check(cs[0], cs, later)


@anyio_test
async def test_a_member_cancelled_after_its_group_started_is_copied_not_unpacked():
    async with _group_of_two() as (a, b, g):
        b.transport.hold_next_writes(1)                    # the group's copy stalls too
        b.transport.release_held()
        await b.transport.wait_stalled(2)                  # the group's copy has started
        g.scope.cancel()
        await anyio.sleep(0.01)
        assert "cancelled" not in g.outcome                # waits for its copy
        b.transport.release_held()
    assert g.outcome["cancelled"]
    assert a.metrics.peer(1).batches_merged == 1           # both went in one copy
    g.check_only_the_stayer_landed()                       # not unpacked


@anyio_test
async def test_a_refused_merged_request_fails_only_the_load_naming_the_missing_key():
    async with served(ONE) as (cs, (a, b)):
        b.unpublish(11)
        good = [req(1, [10], slot0=0), req(1, [12], slot0=2)]
        errors: list[BaseException] = []

        async def bad() -> None:
            try:
                await a.load(req(1, [11], slot0=1))
            except Exception as exc:
                errors.append(exc)

        async with releasing(b) as tg:
            first = await _fill_the_slab(a, b, tg)
            tg.start_soon(a.load, good[0])
            tg.start_soon(bad)
            tg.start_soon(a.load, good[1])
            await until(lambda: list(forming_groups(a).values()) == [3], "one group of three")
            b.transport.release_held()
        assert len(errors) == 1 and "not published" in str(errors[0])
        for r in [first, *good]:
            check(cs[0], cs, r)


@anyio_test
async def test_a_lost_source_fails_every_member_with_its_own_error():
    async with served(ONE) as (cs, (a, b)):
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                await a.load(req(1, [10 + i], slot0=i))
            except XavierError as exc:
                errors.append(exc)

        async with releasing(b) as tg:
            tg.start_soon(one, 9)
            b.transport.hold_next_writes(1)
            await b.transport.wait_stalled(1)
            for i in range(3):
                tg.start_soon(one, i)
            await until(lambda: a.recv_slab_stats["groups_forming"] == 1, "the others wait in a group")
            a._peer_lost(1, PeerLostError("rank 1 lost (test)"))
            b.transport.release_held()
        assert len(errors) == 4
        assert len({id(e) for e in errors}) == 4                 # each load its own exception


@anyio_test
async def test_the_batches_of_one_load_are_in_flight_together():
    """A load of several batches (here four, 16 blocks of 1 KiB each in 16 KiB slabs) has
    them all requested before the first is unpacked: several round trips at once, every
    byte checked (large batches leave one slab to small ones: three at once here); with
    one receive slab they take it in turn."""
    for slabs, at_once in ((4, lambda n: n >= 2), (1, lambda n: n == 1)):
        cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, receive_slabs=slabs)
        async with served(cfg, wrap={}) as (cs, (a, b)):
            real, now, peak = a._receiver.round_trip, [0], [0]

            async def counted(src, batch, lease):
                now[0] += 1
                peak[0] = max(peak[0], now[0])
                try:
                    await anyio.sleep(0.01)  # a copy that takes a while: the others start meanwhile
                    return await real(src, batch, lease)
                finally:
                    now[0] -= 1

            a._receiver.round_trip = counted  # type: ignore[method-assign]
            request = req(1, list(range(64)), 0)
            res = await a.load(request)
            assert res.batches == 4 and res.blocks == 64
            check(cs[0], cs, request)
            assert at_once(peak[0]), (slabs, peak[0])


@anyio_test
async def test_a_failed_batch_spares_the_batches_already_requested():
    """The third of four batches fails once two are requested: those two land and are
    unpacked (the error carries them), and a batch not yet requested at that moment
    stops (whichever it is: the count, not the timing, is checked)."""
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, receive_slabs=3)
    async with served(cfg, wrap={}) as (cs, (a, b)):
        rx = a._receiver
        real, entered, requested_then = rx.scheduler.load, [], []

        async def refusing_the_third(src, batch):
            entered.append(batch)
            if len(entered) == 3:
                await until(lambda: sum(x.requested for x in entered) >= 2, "two batches requested")
                requested_then.extend(x for x in entered if x.requested)
                raise RemoteError("refused for the test")
            return await real(src, batch)

        rx.scheduler.load = refusing_the_third  # type: ignore[method-assign]
        with pytest.raises(RemoteError, match="for the test") as info:
            await a.load(req(1, list(range(64)), 0))
        partial = info.value.partial  # type: ignore[attr-defined]
        assert len(requested_then) >= 2
        assert partial.batches >= len(requested_then) and partial.batches <= 3
        for batch in requested_then:  # unpacked, not abandoned
            for seg in batch.segments:
                for key, slots in zip(seg.keys, seg.slots):
                    assert_same_bytes(cs[0][0][slots[0]], cs[1][0][key])
        assert a.recv_slab_stats["in_use"] == 0

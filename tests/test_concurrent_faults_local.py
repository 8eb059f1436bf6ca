"""Concurrent faults in process: hypothesis draws schedules of loads, held and late
writes, lost peers, reconnects and cancellations over ``FaultyTransport``, so that many
interleavings of fences, replacements and waiting loads are checked without processes.

After every step the loader's slab bookkeeping must hold (``Endpoint.check_invariants``);
at the end every load that succeeded has exactly its source's bytes, every failure is a
typed library error whose slots are untouched, a cancelled load is all or nothing, and
close returns. (The same invariants over real NIXL processes: tests/test_chaos.py.)
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import anyio
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from xavier_async import Endpoint, EndpointConfig, LocalFabric, LocalTransport, XavierError
from xavier_async.testing import FaultPlan, FaultyTransport

from .conftest import random_cache

KiB = 1024
SLOTS = 32
SOURCES = (1, 2, 3)
#: 1 KiB blocks; a small view of 2 blocks, a full slab of 8 (a load of 3+ blocks is large)
CFG = dict(full_bytes=8 * KiB, small_bytes=2 * KiB, request_timeout=0.15)

#: a load: source, blocks, cancelled after (None: never), its write held first
load = st.tuples(st.just("load"), st.sampled_from(SOURCES), st.integers(1, 6),
                 st.one_of(st.none(), st.none(), st.floats(0, 0.05)), st.booleans())
step = st.one_of(
    load, load, load, load,
    st.tuples(st.just("hold"), st.sampled_from(SOURCES), st.integers(1, 3)),
    st.tuples(st.just("release"), st.sampled_from(SOURCES)),
    st.tuples(st.just("lose"), st.sampled_from(SOURCES)),
    st.tuples(st.just("reconnect"), st.sampled_from(SOURCES)),
    st.tuples(st.just("pause"), st.floats(0, 0.08)),
    st.tuples(st.just("pause"), st.floats(0.15, 0.3)),   # past request_timeout: held loads fence
)
schedule = st.tuples(st.integers(1, 4), st.lists(step, min_size=6, max_size=30))


def _caches(rank: int) -> dict[int, torch.Tensor]:
    return {0: random_cache(SLOTS, (256,), torch.float32, rank)}


async def _run(k: int, steps: list[tuple]) -> dict[str, int]:
    fabric = LocalFabric()
    cfg = EndpointConfig(**CFG, receive_slabs=k)
    src = {r: _caches(r) for r in SOURCES}
    faulty = {r: FaultyTransport(LocalTransport(fabric), FaultPlan(late_writes_land=True))
              for r in SOURCES}
    loader_t = FaultyTransport(LocalTransport(fabric))
    dst = {0: torch.zeros(SLOTS * 4, 256)}
    a = Endpoint(0, dst, loader_t, cfg)
    sources = {r: Endpoint(r, src[r], faulty[r], cfg) for r in SOURCES}
    counts = {"ok": 0, "failed": 0, "cancelled": 0}
    next_slot = iter(range(SLOTS * 4))
    loads: list[tuple[int, dict[int, int], object]] = []

    async def load(s: int, blocks: dict[int, int], cancel_after: float | None) -> None:
        outcome: object = "ok"
        try:
            if cancel_after is None:
                await a.load({s: {0: blocks}})
            else:
                with anyio.move_on_after(cancel_after) as scope:
                    await a.load({s: {0: blocks}})
                if scope.cancelled_caught:
                    outcome = "cancelled"
        except XavierError as exc:
            outcome = exc
        loads.append((s, blocks, outcome))

    with anyio.fail_after(30):
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(a)
            for r, ep in sources.items():
                await stack.enter_async_context(ep)
                for slot in range(SLOTS):
                    ep.publish(slot, slot)
                await a.connect(ep.address)
            # first out: every held write lands (late, where peers are gone), so sources close
            stack.callback(lambda: [t.release_held() for t in faulty.values()])
            async with anyio.create_task_group() as tg:
                for op, *args in steps:
                    if op == "load":
                        s, n, cancel_after, held = args
                        slots = [next(next_slot, None) for _ in range(n)]
                        if None in slots:
                            continue
                        if held:
                            faulty[s].hold_next_writes(1)
                        keys = [(7 * i + s) % SLOTS for i in range(len(slots))]
                        tg.start_soon(load, s, dict(zip(keys, slots)), cancel_after)
                    elif op == "hold":
                        faulty[args[0]].hold_next_writes(args[1])
                    elif op == "release":
                        faulty[args[0]].release_held()
                    elif op == "lose":
                        loader_t.lose_peer(args[0])
                    elif op == "reconnect":
                        try:
                            await a.connect(sources[args[0]].address)
                        except XavierError:
                            pass
                    elif op == "pause":
                        await anyio.sleep(args[0])
                    await anyio.sleep(0)
                    a.check_invariants()
                await anyio.sleep(0.01)
                for t in faulty.values():
                    t.release_held()
            a.check_invariants(idle=True)
            stats = a.recv_slab_stats
            counts["fences"], counts["replacements"] = stats["fences"], stats["registered"] - k
            counts["late_writes"] = sum(t.injected.late_writes_landed for t in faulty.values())
            t0 = anyio.current_time()
    assert anyio.current_time() - t0 < 5
    for s, blocks, outcome in loads:
        got = [dst[0][slot] for slot in blocks.values()]
        want = [src[s][0][key] for key in blocks]
        exact = all(torch.equal(g.view(torch.int32), w.view(torch.int32)) for g, w in zip(got, want))
        untouched = all(not g.any() for g in got)
        if outcome == "ok":
            assert exact, f"a load from rank {s} returned wrong bytes as success"
            counts["ok"] += 1
        elif outcome == "cancelled":
            assert exact or untouched, "a cancelled load left a mix of bytes"
            counts["cancelled"] += 1
        else:
            assert isinstance(outcome, XavierError)
            assert untouched, f"a failed load ({outcome!r}) wrote its slots"
            counts["failed"] += 1
    return counts


def _check(k: int, steps: list[tuple], events: bool = True) -> dict[str, int]:
    counts = anyio.run(_run, k, steps)
    for name, n in counts.items() if events else ():   # --hypothesis-show-statistics
        event(f"{name}: {min(n, 3)}{'+' if n >= 3 else ''}")
    return counts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule)
def test_concurrent_faults_in_process_never_break_an_invariant(sched):
    _check(*sched)


def test_two_sources_time_out_at_once_while_a_third_serves():
    """The interleaving of issue 21, as a fixed schedule: two sources hold their writes
    past the timeout while loads from the third wait; the late writes then land."""
    counts = _check(2, [("load", 1, 1, None, True), ("load", 2, 4, None, True),
                        ("load", 3, 1, None, False), ("load", 3, 2, None, False),
                        ("load", 3, 5, None, False), ("pause", 0.3), ("release", 1),
                        ("release", 2), ("load", 3, 1, None, False), ("reconnect", 1),
                        ("load", 1, 2, None, False)], events=False)
    assert counts["fences"] == 2 and counts["replacements"] == 2 and counts["ok"] >= 4, counts


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule)
def test_concurrent_faults_in_process_many_schedules(sched):
    _check(*sched)

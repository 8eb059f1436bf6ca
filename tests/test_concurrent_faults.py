"""Concurrent faults over real NIXL processes (issue 21, findings 1-3): standalone
reproductions, each written to fail on the engine that had the defect.

1. Several receive slabs fenced at once (one source SIGKILLed, another SIGSTOPped while
   64 loads from them are in flight) made concurrent replacement registrations share one
   slab index; a third, healthy source then wrote into one slab while the loader unpacked
   another: wrong bytes returned as success.
2. The ``AssertionError`` of that duplicate escaped ``async with Endpoint`` as an
   ``ExceptionGroup``.
3. A large load waiting for the slab kept for small batches, while the other three were
   fenced, waited forever (and ``aclose()`` with it).

And one the chaos test found (``tests/test_chaos.py``): a close that begins before a
fence empties the pool leaves the loads waiting for a slab with none coming (no
replacement is registered once closing, and nothing fails them), so close waits forever.

Every successful load's bytes are checked, block by block; every call runs under a hang
guard (``anyio.fail_after``), so a hang is a failure with a message, not a stuck run. A
library bug fails every test however well the engine contains it: no load may fail with
``InternalError`` (which the engine makes of any unexpected exception in a round trip,
such as finding 2's ``AssertionError``), and no background task of the loader or of a
running source may crash (``task_crashes``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async import (Endpoint, EndpointConfig, InternalError, PeerLostError,  # noqa: E402
                          XavierError)
from xavier_async.testing.invariants import task_crashes  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec,  # noqa: E402
                                               check_loaded, pattern_caches, zero_caches,
                                               zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.asyncio

KiB = 1024
SEED = 21
#: 512 B blocks; the sources publish 64 slots, the loader has room for every load's own slots
SPEC = LayoutSpec(layers=2, num_slots=64, block_shape=(4, 64), dtype="bfloat16")
LOADER = LayoutSpec(layers=2, num_slots=2048, block_shape=(4, 64), dtype="bfloat16")
NCFG = dict(full_bytes=64 * KiB, small_bytes=4 * KiB)
TIMEOUT = 3.0          # request_timeout, as in the issue
GUARD = TIMEOUT + 12   # a call that takes longer than this hung
CLOSE_GUARD = TIMEOUT + 5


def _start(specs: list[PeerSpec]) -> list[PeerProcess]:
    """Start the processes at once (each takes 2-3 s to come up)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(PeerProcess, s) for s in specs]
        out, errors = [], []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as exc:  # pragma: no cover - a child that did not start
                errors.append(exc)
        if errors:
            _stop(out)
            raise errors[0]
    return out


def _stop(procs: list[PeerProcess]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            try:
                os.kill(p.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p._child.conn.close()


def _request(rng: random.Random, src: int, base: int, large: bool) -> dict[int, Any]:
    """Keys from ``src``'s 64 published slots into the loader's slots ``base..``: small
    (1-4 blocks per layer, <= 4 KiB) or large (8-16 blocks per layer, 8-16 KiB)."""
    n = rng.randint(8, 16) if large else rng.randint(1, 4)
    keys = rng.sample(range(SPEC.num_slots), n)
    return {src: {layer: {k: base + j for j, k in enumerate(keys)} for layer in range(SPEC.layers)}}


@dataclass
class Outcome:
    ok: int = 0
    ok_by_rank: dict[int, int] = field(default_factory=dict)   # successes per source
    wrong: int = 0           # returned success with wrong bytes: the worst outcome
    failed: dict[str, int] = field(default_factory=dict)
    untyped: list[str] = field(default_factory=list)
    internal: list[str] = field(default_factory=list)         # InternalError: a library bug
    hung: int = 0            # took longer than the hang guard
    first_wrong: str = ""

    def failure(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.failed[name] = self.failed.get(name, 0) + 1
        if not isinstance(exc, XavierError):
            self.untyped.append(repr(exc))
        elif isinstance(exc, InternalError):
            self.internal.append(repr(exc))

    @property
    def bugs(self) -> list[str]:
        """Failures that are library bugs: untyped, or typed ``InternalError``."""
        return self.untyped + self.internal


async def _checked_load(ep: Endpoint, request: dict[int, Any], expected: dict[int, Any],
                        out: Outcome) -> None:
    """One load under a hang guard; success must carry exactly the source's bytes."""
    zero_slots(ep.caches, request)
    try:
        with anyio.fail_after(GUARD):
            await ep.load(request)
    except TimeoutError:
        out.hung += 1
        return
    except Exception as exc:
        out.failure(exc)
        return
    try:
        check_loaded(ep.caches, request, expected)
    except AssertionError as exc:
        out.wrong += 1
        out.first_wrong = out.first_wrong or str(exc)
        return
    out.ok += 1
    for src in request:
        out.ok_by_rank[src] = out.ok_by_rank.get(src, 0) + 1


@dataclass
class Report:
    faulted: Outcome = field(default_factory=Outcome)      # the 64 loads from ranks 1 and 2
    sequential: Outcome = field(default_factory=Outcome)   # 10 loads from rank 3 afterwards
    after: Outcome = field(default_factory=Outcome)        # 200 concurrent ones (+ rank 2's)
    escaped: BaseException | None = None                   # what left `async with Endpoint`
    close_hung: bool = False
    stats: dict[str, int] = field(default_factory=dict)
    registrations: int = 0
    crashes: dict[int, int] = field(default_factory=dict)  # task crashes by rank (0: loader)
    seconds: float = 0.0


async def _crashes(ep: Endpoint, up: list[PeerProcess]) -> dict[int, int]:
    """Task crashes of the loader (rank 0) and of the sources ``up`` (running, not frozen):
    each one a bug, whatever the loads' outcomes show."""
    out = {0: task_crashes(ep)}
    for p in up:
        out[p.spec.rank] = await anyio.to_thread.run_sync(p.task_crashes)
    return out


def _no_crashes(crashes: dict[int, int], summary: str) -> None:
    assert crashes and not any(crashes.values()), f"background tasks crashed: {crashes}; {summary}"


async def _reconnect(ep: Endpoint, p: PeerProcess) -> None:
    """Connect ``p`` again (it must first notice that we hung up on it)."""
    with anyio.fail_after(GUARD):
        while True:
            try:
                await ep.connect(p.address, timeout=1.0)
                return
            except XavierError:
                await anyio.sleep(0.05)


async def _kill_and_freeze(resume: bool, seed: int = 0) -> Report:
    """Loader (this process, 4 receive slabs, request_timeout 3 s) and three sources; 64
    loads in flight from ranks 1 and 2 (whose writes are slowed so that they hold slabs);
    rank 1 SIGKILLed and rank 2 SIGSTOPped in the middle, so that several slabs are
    fenced at once while other loads wait (and replacements for them are registered
    concurrently). Then loads
    from rank 3 (connected before the faults, never faulty): 10 one at a time, then 200,
    8 at a time. With ``resume``, rank 2 is resumed (SIGCONT) first, serves its stale
    requests, is reconnected and loaded from alongside rank 3."""
    t0 = time.monotonic()
    rng = random.Random(seed)
    slow = {"write_stall_rate": 1.0, "stall_seconds": 0.05}
    specs = [PeerSpec(rank=1, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1, faults=slow),
             PeerSpec(rank=2, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1, faults=slow,
                      transport={"stall_check": 0.0}),   # serves stale requests when resumed
             PeerSpec(rank=3, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1)]
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2, 3)}
    report = Report()
    procs = _start(specs)
    p1, p2, p3 = procs
    cfg = EndpointConfig(**NCFG, request_timeout=TIMEOUT)
    ep = Endpoint(0, zero_caches(LOADER), NixlTransport(), cfg)

    async def healthy(out: Outcome, n: int, concurrent: int, srcs: tuple[int, ...] = (3,)) -> None:
        async def one(i: int) -> None:
            req = _request(rng, srcs[i % len(srcs)], 1024 + 16 * (i % 64), large=i % 3 == 2)
            await _checked_load(ep, req, expected, out)
        for start in range(0, n, concurrent):
            async with anyio.create_task_group() as tg:
                for i in range(start, min(n, start + concurrent)):
                    tg.start_soon(one, i)

    try:
        try:
            with anyio.fail_after(120):
                async with ep:
                    for p in procs:
                        with anyio.fail_after(GUARD):
                            await ep.connect(p.address)
                    await healthy(report.sequential, 1, 1)   # rank 3 served once: warm

                    async def faults() -> None:
                        await anyio.sleep(0.3)
                        p1.kill()
                        os.kill(p2.proc.pid, signal.SIGSTOP)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(faults)
                        for i in range(64):
                            req = _request(rng, 1 + i % 2, 16 * i, large=i % 4 == 3)
                            tg.start_soon(_checked_load, ep, req, expected, report.faulted)

                    await healthy(report.sequential, 10, 1)   # one at a time, as in the issue
                    srcs: tuple[int, ...] = (3,)
                    if resume:
                        os.kill(p2.proc.pid, signal.SIGCONT)
                        await _reconnect(ep, p2)
                        srcs = (3, 2)
                    await healthy(report.after, 200, 8, srcs)
                    report.stats = dict(ep.recv_slab_stats)
                    report.registrations = ep.transport.memory_registrations
                report.crashes = await _crashes(ep, [p2, p3] if resume else [p3])
        except TimeoutError:
            report.close_hung = True
        except BaseException as exc:  # an ExceptionGroup out of `async with Endpoint`
            report.escaped = exc
    finally:
        _stop(procs)
    report.seconds = time.monotonic() - t0
    return report


def _summary(r: Report) -> str:
    return (f"faulted loads {r.faulted}; rank 3 afterwards, "
            f"one at a time {r.sequential}; after, concurrent {r.after}; escaped {r.escaped!r}; "
            f"hung {r.close_hung}; slabs {r.stats}; registrations {r.registrations}; "
            f"task crashes {r.crashes}; {r.seconds:.1f} s")


def _escaped(r: Report) -> str:
    if r.escaped is None:
        return ""
    import traceback
    return "".join(traceback.format_exception(r.escaped))[-3000:]


def _assert_trusted(r, healthy: tuple[int, ...]) -> None:
    """What both kill-and-freeze runs must show: no load from any source returned success
    with wrong bytes, nothing escaped ``async with`` or hung (close included), every
    failure typed and none a library bug (no ``InternalError``, no task crash), each
    healthy rank of ``healthy`` really loaded from, and registrations equal to the pools."""
    print(_summary(r))
    names = " and ".join(f"rank {h}" for h in healthy)
    for name, out in (("the faulted sources", r.faulted), ("rank 3, one at a time", r.sequential),
                      (f"{names}, concurrent", r.after)):
        assert out.wrong == 0, (f"{out.wrong} loads from {name} returned success with wrong bytes "
                                f"({out.first_wrong}); {_summary(r)}")
    assert r.escaped is None, f"the endpoint raised out of `async with`:\n{_escaped(r)}"
    assert not r.close_hung, _summary(r)
    for name, out in (("the faulted sources", r.faulted), ("rank 3", r.sequential), (names, r.after)):
        assert not out.bugs and not out.hung, f"{name}: {out}"
    _no_crashes(r.crashes, _summary(r))
    # each healthy rank served every one of its share of the 200 loads (rank 2 after
    # its resume and reconnect too): counted per rank, so one cannot stand in for another
    for h in healthy:
        assert r.after.ok_by_rank.get(h, 0) == 200 // len(healthy), (
            f"rank {h} did not serve all its loads: {_summary(r)}")
    assert r.registrations == (r.stats["send_slabs"] + r.stats["registered"]
                               + r.stats["snapshot_tiers"]), _summary(r)


async def test_finding1_a_healthy_source_never_returns_wrong_bytes_after_kill_and_freeze():
    """Finding 1: with several slabs fenced at once and their replacements registered
    concurrently, every load from the healthy rank 3 returns its exact bytes (or a typed
    error); registrations equal the pool."""
    r = await _kill_and_freeze(resume=False)
    _assert_trusted(r, (3,))
    assert r.faulted.failed, f"the faults hit no load: {_summary(r)}"   # the faults were real


async def test_finding1_the_frozen_source_resumes_and_serves_its_stale_requests():
    """Finding 1, the variant of the issue: rank 2 resumes (SIGCONT) after the loader gave
    up on it, serves its stale requests (no stall check), is reconnected and loaded from
    alongside rank 3: no load from either returns wrong bytes."""
    r = await _kill_and_freeze(resume=True, seed=1)
    _assert_trusted(r, (3, 2))


async def _wait_for(ep: Endpoint, stat: str, value: int, what: str) -> None:
    with anyio.move_on_after(GUARD):
        while ep.recv_slab_stats[stat] < value:
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"{what}: {stat} stayed at {ep.recv_slab_stats[stat]} for {GUARD} s "
                         f"({ep.recv_slab_stats})")


async def test_finding2_the_endpoint_never_raises_out_of_async_with():
    """Finding 2, the same faults timed so that the loads that wait register the
    replacements: rank 1 holds slabs 0-2 (three large loads whose writes stall), rank 2
    slab 3; rank 2 is frozen and rank 1 killed, so slabs 0-2 are fenced at once with
    nobody waiting; then small and large loads from the healthy rank 3 arrive together
    and each group registers a replacement. `async with Endpoint` never raises (no
    ExceptionGroup), and every load is exact or a typed error."""
    stall = {"write_stall_rate": 1.0, "stall_seconds": 2.0}
    specs = [PeerSpec(rank=1, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1, faults=stall),
             PeerSpec(rank=2, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1, faults=stall),
             PeerSpec(rank=3, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1)]
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2, 3)}
    rng = random.Random(2)
    held, healthy = Outcome(), Outcome()
    escaped: BaseException | None = None
    crashes: dict[int, int] = {}
    procs = _start(specs)
    p1, p2, p3 = procs
    try:
        try:
            with anyio.fail_after(60):
                async with Endpoint(0, zero_caches(LOADER), NixlTransport(),
                                    EndpointConfig(**NCFG, request_timeout=TIMEOUT)) as ep:
                    for p in procs:
                        with anyio.fail_after(GUARD):
                            await ep.connect(p.address)
                    async with anyio.create_task_group() as tg:
                        for i in range(3):   # large: slabs 0-2 (the head-of-line cap)
                            tg.start_soon(_checked_load, ep, _request(rng, 1, 16 * i, True),
                                          expected, held)
                        tg.start_soon(_checked_load, ep, _request(rng, 2, 48, False), expected, held)
                        await _wait_for(ep, "in_use", 4, "four loads holding the four slabs")
                        os.kill(p2.proc.pid, signal.SIGSTOP)
                        p1.kill()
                        await _wait_for(ep, "fenced_now", 3, "rank 1's slabs fenced")
                        for i in range(8):
                            tg.start_soon(_checked_load, ep,
                                          _request(rng, 3, 1024 + 16 * i, large=i % 2 == 1),
                                          expected, healthy)
                crashes = await _crashes(ep, [p3])
        except BaseException as exc:
            escaped = exc
    finally:
        _stop(procs)
    summary = f"loads from ranks 1 and 2 {held}; from rank 3 {healthy}; task crashes {crashes}"
    if escaped is not None:
        import traceback
        raise AssertionError(f"the endpoint raised out of `async with` ({summary}):\n"
                             + "".join(traceback.format_exception(escaped))[-3000:])
    assert held.failed and healthy.ok == 8, summary
    assert held.wrong == healthy.wrong == 0 and not held.bugs + healthy.bugs, summary
    _no_crashes(crashes, summary)


async def test_finding3_a_large_load_waiting_behind_fenced_slabs_fails_and_close_returns():
    """Finding 3: rank 1 frozen, the default 4 slabs, four large loads from it. Three hold
    three slabs (the head-of-line cap); the fourth waits for the last one, which the rule
    keeps for small batches. When the three time out and are fenced, the fourth must fail with
    PeerLostError (at about request_timeout, not wait forever), a healthy source still
    loads exact bytes, and aclose() returns."""
    slow = {"write_stall_rate": 1.0, "stall_seconds": 0.2}
    specs = [PeerSpec(rank=1, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1, faults=slow),
             PeerSpec(rank=2, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1)]
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2)}
    rng = random.Random(3)
    warm, held, after = Outcome(), Outcome(), Outcome()
    fourth: dict[str, Any] = {}
    closed: dict[str, float] = {}
    problems: list[str] = []
    crashes: dict[int, int] = {}
    procs = _start(specs)
    p1, p2 = procs
    try:
        ep = Endpoint(0, zero_caches(LOADER), NixlTransport(), EndpointConfig(**NCFG, request_timeout=TIMEOUT))
        async with ep:
            for p in procs:
                with anyio.fail_after(GUARD):
                    await ep.connect(p.address)
            # warm up: rank 1 (slowed) has been told about all four receive slabs
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(_checked_load, ep, _request(rng, 1, 16 * i, False), expected, warm)
                await _wait_for(ep, "in_use", 4, "the warm-up using every slab")
            assert warm.ok == 4, warm
            os.kill(p1.proc.pid, signal.SIGSTOP)

            async with anyio.create_task_group() as tg:
                scope = anyio.CancelScope()
                done = anyio.Event()

                async def the_fourth() -> None:
                    req = _request(rng, 1, 256, True)
                    zero_slots(ep.caches, req)
                    t = time.monotonic()
                    with scope:
                        try:
                            await ep.load(req)
                            fourth["result"] = "success"
                            check_loaded(ep.caches, req, expected)  # (it cannot be: frozen)
                        except Exception as exc:
                            fourth["result"] = exc
                    fourth["seconds"] = time.monotonic() - t
                    done.set()

                for i in range(3):
                    tg.start_soon(_checked_load, ep, _request(rng, 1, 64 + 16 * i, True), expected, held)
                await _wait_for(ep, "in_use", 3, "three large loads holding three slabs")
                tg.start_soon(the_fourth)
                with anyio.move_on_after(2 * TIMEOUT + 3):
                    await done.wait()
                if not done.is_set():
                    problems.append(f"the fourth large load was still waiting {2 * TIMEOUT + 3:.0f} s "
                                    f"after it started (request_timeout {TIMEOUT} s); slabs "
                                    f"{ep.recv_slab_stats}")
                else:   # a healthy source still works (a load that hung would unblock here)
                    for i in range(4):
                        await _checked_load(ep, _request(rng, 2, 512 + 16 * i, i % 2 == 1), expected, after)

                # close while the fourth may still wait: close is shielded, so watch it from here
                async def close() -> None:
                    t = time.monotonic()
                    await ep.aclose()
                    closed["seconds"] = time.monotonic() - t

                tg.start_soon(close)
                with anyio.move_on_after(CLOSE_GUARD):
                    while "seconds" not in closed:
                        await anyio.sleep(0.05)
                if "seconds" not in closed:
                    problems.append(f"aclose() did not return within {CLOSE_GUARD:.0f} s")
                    scope.cancel()   # unblock it: the hung load is cancelled
                    with anyio.fail_after(GUARD):
                        await done.wait()
        crashes = await _crashes(ep, [p2])
    finally:
        _stop(procs)
    summary = (f"fourth load {fourth}; first three {held}; rank 2 afterwards {after}; close "
               f"{closed}; task crashes {crashes}")
    assert not problems, "; ".join(problems) + f" ({summary})"
    assert isinstance(fourth["result"], PeerLostError), summary
    assert held.failed == {"PeerLostError": 3}, summary
    assert after.ok == 4 and after.wrong == 0, summary
    assert not warm.bugs + held.bugs + after.bugs, summary
    _no_crashes(crashes, summary)


async def test_close_while_a_fence_empties_the_pool_fails_or_serves_the_waiting_loads():
    """Found by the chaos test (seeds 1009, 1041, 1062, 1091, 1112, 1128, 1155 of the long
    run): one receive slab, held by a load from the frozen rank 1; loads from the healthy
    rank 2 wait for it; the endpoint is closed, and only then does rank 1's request time
    out and its slab get fenced. Close drains in-flight work, so the waiting loads must
    end (served from a replacement, or failed with a typed error), and aclose() must
    return; not wait for a slab nobody will register."""
    specs = [PeerSpec(rank=1, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1),
             PeerSpec(rank=2, layout=SPEC, seed=SEED, config=NCFG, torch_threads=1)]
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2)}
    rng = random.Random(4)
    held, waiting = Outcome(), Outcome()
    closed: dict[str, float] = {}
    problems: list[str] = []
    crashes: dict[int, int] = {}
    procs = _start(specs)
    p1, p2 = procs
    try:
        ep = Endpoint(0, zero_caches(LOADER), NixlTransport(),
                      EndpointConfig(**NCFG, request_timeout=TIMEOUT, receive_slabs=1))
        async with ep:
            for p in procs:
                with anyio.fail_after(GUARD):
                    await ep.connect(p.address)
            for src in (1, 2):   # both sources served once: connected and warm
                await _checked_load(ep, _request(rng, src, 16 * src, False), expected, held)
            assert held.ok == 2, held
            held = Outcome()
            os.kill(p1.proc.pid, signal.SIGSTOP)
            scopes = [anyio.CancelScope() for _ in range(3)]

            async def wait_for_the_slab(i: int) -> None:
                with scopes[i]:
                    await _checked_load(ep, _request(rng, 2, 512 + 16 * i, i == 2), expected, waiting)

            async def close() -> None:
                t = time.monotonic()
                await ep.aclose()
                closed["seconds"] = time.monotonic() - t

            async with anyio.create_task_group() as tg:
                tg.start_soon(_checked_load, ep, _request(rng, 1, 256, False), expected, held)
                await _wait_for(ep, "in_use", 1, "rank 1's load holding the slab")
                for i in range(3):
                    tg.start_soon(wait_for_the_slab, i)
                await _wait_for(ep, "waiting", 1, "rank 2's loads waiting for the slab")
                tg.start_soon(close)          # before rank 1's request times out
                with anyio.move_on_after(CLOSE_GUARD):
                    while "seconds" not in closed:
                        await anyio.sleep(0.05)
                if "seconds" not in closed:
                    problems.append(f"aclose() did not return within {CLOSE_GUARD:.0f} s "
                                    f"(request_timeout {TIMEOUT} s); slabs {ep.recv_slab_stats}")
                    for scope in scopes:      # unblock it: the waiting loads are cancelled
                        scope.cancel()
        crashes = await _crashes(ep, [p2])
    finally:
        _stop(procs)
    summary = (f"rank 1's load {held}; rank 2's waiting loads {waiting}; close {closed}; "
               f"task crashes {crashes}")
    assert not problems, "; ".join(problems) + f" ({summary})"
    assert held.ok + sum(held.failed.values()) == 1 and not held.wrong, summary
    assert waiting.ok + sum(waiting.failed.values()) == 3, summary   # every one ended
    assert not waiting.wrong and not waiting.bugs + held.bugs, summary
    _no_crashes(crashes, summary)

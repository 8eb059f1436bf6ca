"""A hypothesis stateful test of the receive-slab pool, fencing and replacements, in
process (issue 21): many interleavings of loads, stalled and lost writes, cancellations
and reconnects, without processes, checked after every step.

The loader (``K`` receive slabs, 1-4, ``merge_loads`` on or off) loads from three
sources whose transports are :class:`FaultyTransport` with ``late_writes_land``: a
stalled write still lands after its receiver gave up, into the slab that was fenced for
it, as a one-sided NIXL WRITE does. After every step: the slab invariants that hold
while loads are in flight (every registered slab in exactly one place, registrations
equal the pool, the unpack table and the transport name the pooled buffer), and every
load that has returned: exact bytes, or a typed error (never ``InternalError``: a library
bug) and no wrong byte, and no endpoint's background task crashed. At the end: every
load, cancelled ones included, returns within a bound; every returned load's slots still
hold what they held when it returned; the pool is idle, close returns.

A cancelled load is judged once its task has really ended: ``Future.cancel()`` on the
portal's future marks it done at once, while the load finishes its shielded copy and
unpack in the event loop (it may still write its slots then).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from xavier_async import Endpoint, EndpointConfig, InternalError, LocalFabric, XavierError
from xavier_async.testing import FaultPlan, FaultyTransport
from xavier_async.testing.invariants import check_slab_invariants, task_crashes, wait_settled

from .conftest import random_cache

KiB = 1024
SOURCES = (1, 2, 3)
PUBLISHED = 32                       # slots each source publishes (256 B blocks)
LOADER_SLOTS = 4096
TIMEOUT = 0.1                        # request_timeout: stalls of 0.3 s outlive it
CFG = {"full_bytes": 4 * KiB, "small_bytes": 512}   # 16 blocks a slab, 2 in the small view
END_BOUND = 10.0                     # every load has returned this long after the last step


@dataclass
class Load:
    """One load started through the portal. ``ended`` is set by the load's own task when
    it has really ended (the portal future is done at once on ``cancel()``), with
    ``outcome`` (``ok``, ``failed``, ``cancelled``) and ``error``; ``seen``: each block's
    bytes when it was settled (``exact``, ``zero`` or ``wrong``), checked again at the end."""

    request: dict[int, Any]
    ended: threading.Event = field(default_factory=threading.Event)
    outcome: str = ""
    error: BaseException | None = None
    future: Future[Any] | None = None
    seen: list[str] = field(default_factory=list)


class SlabPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self.portal = self._portal_cm.__enter__()
        self.cms: list[Any] = []
        self.ep: Endpoint | None = None
        self.sources: dict[int, Endpoint] = {}
        self.faulty: dict[int, FaultyTransport] = {}
        self.expected: dict[int, torch.Tensor] = {}
        self.pending: list[Load] = []     # started, not yet settled
        self.started: list[Load] = []
        self.settled: list[Load] = []
        self.next_slot = 0
        self.problems: list[str] = []
        self.log: list[str] = []
        self.outcomes = {"ok": 0, "failed": 0, "cancelled": 0}

    # -- setup ------------------------------------------------------------------------
    @initialize(k=st.integers(1, 4), merge=st.booleans())
    def start(self, k: int, merge: bool) -> None:
        self.log.append(f"start(k={k}, merge={merge})")
        fabric = LocalFabric()
        # the loader's registrations take 20 ms, like real ones: replacements overlap
        slow_registrations = FaultyTransport(fabric.transport(), FaultPlan(register_seconds=0.02))
        loader = Endpoint(0, {0: torch.zeros(LOADER_SLOTS, 64)}, slow_registrations,
                          EndpointConfig(**CFG, request_timeout=TIMEOUT, receive_slabs=k,
                                         merge_loads=merge))
        self.ep = self._enter(loader)
        for r in SOURCES:
            self.expected[r] = random_cache(PUBLISHED, (64,), torch.float32, 100 + r)
            faulty = FaultyTransport(fabric.transport(), FaultPlan(late_writes_land=True))
            src = self._enter(Endpoint(r, {0: self.expected[r].clone()}, faulty,
                                       EndpointConfig(**CFG, request_timeout=TIMEOUT)))
            for s in range(PUBLISHED):
                self.portal.call(src.publish, s, s)
            self.sources[r], self.faulty[r] = src, faulty
            self.portal.call(self.ep.connect, src.address)

    def _enter(self, ep: Endpoint) -> Endpoint:
        cm = self.portal.wrap_async_context_manager(ep)
        out = cm.__enter__()
        self.cms.append(cm)
        return out

    # -- rules ------------------------------------------------------------------------
    @precondition(lambda self: self.ep is not None and self.next_slot < LOADER_SLOTS - 4 * 32)
    @rule(src=st.sampled_from(SOURCES),
          keys=st.lists(st.integers(0, PUBLISHED - 1), min_size=1, max_size=24, unique=True),
          other=st.lists(st.integers(0, PUBLISHED - 1), max_size=2, unique=True),
          copies=st.integers(1, 4))
    def load(self, src: int, keys: list[int], other: list[int], copies: int) -> None:
        """``copies`` loads at once (small, large or two batches; with ``other``, from a
        second source too)."""
        self.log.append(f"load(src={src}, keys={keys}, other={other}, copies={copies})")
        for _ in range(copies):
            self._load(src, keys, other)

    def _load(self, src: int, keys: list[int], other: list[int]) -> None:
        assert self.ep is not None
        request: dict[int, Any] = {src: {0: {}}}
        for key in keys:
            request[src][0][key] = self.next_slot
            self.next_slot += 1
        if other:
            second = SOURCES[(SOURCES.index(src) + 1) % len(SOURCES)]
            request[second] = {0: {}}
            for key in other:
                request[second][0][key] = self.next_slot
                self.next_slot += 1
        load = Load(request)
        load.future = self.portal.start_task_soon(self._run, load)
        self.pending.append(load)
        self.started.append(load)

    async def _run(self, load: Load) -> None:
        """The load, recording how its task really ended (in the event loop)."""
        assert self.ep is not None
        try:
            await self.ep.load(load.request)
            load.outcome = "ok"
        except anyio.get_cancelled_exc_class():
            load.outcome = "cancelled"
            raise
        except Exception as exc:
            load.outcome, load.error = "failed", exc
        except BaseException as exc:
            load.outcome, load.error = "failed", exc
            raise
        finally:
            load.ended.set()

    @rule(src=st.sampled_from(SOURCES), n=st.integers(1, 4), seconds=st.sampled_from([0.02, 0.3]))
    def stall(self, src: int, n: int, seconds: float) -> None:
        """The source's next writes stall (0.3 s: past request_timeout, so the loader
        fences the slab, and the write lands in it late)."""
        self.log.append(f"stall(src={src}, n={n}, seconds={seconds})")
        self.portal.call(self.faulty[src].stall_next_writes, n, seconds)

    @rule(src=st.sampled_from(SOURCES))
    def lose(self, src: int) -> None:
        """The source and the loader lose each other (a partition)."""
        self.log.append(f"lose(src={src})")
        self.portal.call(self.faulty[src].lose_peer, 0)

    @rule(src=st.sampled_from(SOURCES))
    def reconnect(self, src: int) -> None:
        assert self.ep is not None
        self.log.append(f"reconnect(src={src})")
        if src in self.ep.peers:
            return
        try:
            self.portal.call(self._connect, src)
        except XavierError:
            pass
        except Exception as exc:
            self.problems.append(f"reconnecting rank {src} raised {exc!r}, not a library error")

    async def _connect(self, src: int) -> None:
        assert self.ep is not None
        with anyio.fail_after(2):
            await self.sources[src].connect(self.ep.address)

    @precondition(lambda self: bool(self.started))   # (not `pending`: that depends on timing)
    @rule(which=st.integers(0, 1000))
    def cancel(self, which: int) -> None:
        """Cancel a load (a no-op if it has returned); its task may run on (shielded)."""
        self.log.append(f"cancel(load {which % len(self.started)})")
        future = self.started[which % len(self.started)].future
        assert future is not None
        future.cancel()

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.05, 0.15]))
    def advance(self, seconds: float) -> None:
        self.log.append(f"advance({seconds})")
        self.portal.call(anyio.sleep, seconds)

    # -- checks -----------------------------------------------------------------------
    def _blocks(self, request: dict[int, Any]) -> list[tuple[str, str]]:
        """Each block of a request: ``(exact|zero|wrong, which)`` (read in the event loop)."""
        assert self.ep is not None
        cache = self.ep.caches[0]
        out = []
        for src, layers in request.items():
            for key, slot in layers[0].items():
                got = cache[slot].view(torch.uint8)
                state = ("exact" if torch.equal(got, self.expected[src][key].view(torch.uint8))
                         else "wrong" if got.any() else "zero")
                out.append((state, f"block {key} of rank {src} in slot {slot}"))
        return out

    def _settle(self, load: Load) -> None:
        """Judge a load whose task has ended (never before: see the module docstring)."""
        assert load.ended.is_set()
        blocks = self.portal.call(self._blocks, load.request)
        load.seen = [state for state, _ in blocks]
        self.settled.append(load)
        wrong = [which for state, which in blocks if state == "wrong"]
        exact = load.seen.count("exact")
        outcome = load.outcome
        self.outcomes[outcome] += 1
        if outcome == "failed":
            exc = load.error
            outcome = f"failed ({exc!r})"
            if not isinstance(exc, XavierError):
                self.problems.append(f"a load raised {exc!r}, not a library error")
            elif isinstance(exc, InternalError):
                self.problems.append(f"a load failed with a library bug: {exc!r}")
        elif outcome == "ok" and exact != len(blocks):
            self.problems.append(f"a load returned success with {len(blocks) - exact} of "
                                 f"{len(blocks)} blocks wrong ({wrong[:3] or 'left zero'}): "
                                 f"{load.request}")
        if outcome != "ok" and wrong:
            self.problems.append(f"a load that {outcome} wrote wrong bytes: {wrong[:3]}")

    def _crashes(self) -> list[str]:
        """Every endpoint's crashed background tasks (a library bug each)."""
        eps = {0: self.ep, **self.sources}
        return [f"rank {r}: {n} background task(s) crashed" for r, ep in eps.items()
                if (n := task_crashes(ep))]

    def _unchanged(self) -> list[str]:
        """Every settled load's slots still hold what they held when it was settled (the
        engine writes a load's slots only before its task ends)."""
        problems = []
        for load in self.settled:
            now = [state for state, _ in self.portal.call(self._blocks, load.request)]
            if now != load.seen:
                changed = sum(a != b for a, b in zip(now, load.seen))
                problems.append(f"{changed} blocks of a load that {load.outcome} changed after "
                                f"its task ended ({load.seen} then {now}): {load.request}")
        return problems

    @invariant()
    def slabs_and_returned_loads(self) -> None:
        if self.ep is None:
            return
        for load in [p for p in self.pending if p.ended.is_set()]:
            self.pending.remove(load)
            self._settle(load)
        problems = self.portal.call(lambda: check_slab_invariants(self.ep, idle=False))
        self._check(problems + self.problems + self._crashes())

    def _check(self, problems: list[str]) -> None:
        if problems:
            FOUND.append(problems + ["after the steps:"] + self.log)
        assert not problems, problems

    def teardown(self) -> None:
        try:
            if self.ep is not None:
                self._finish()
        finally:
            for load in self.pending:
                assert load.future is not None
                load.future.cancel()
            for cm in reversed(self.cms):
                try:
                    cm.__exit__(None, None, None)
                except BaseException as exc:  # out of `async with Endpoint`
                    self.problems.append(f"an endpoint raised out of `async with`: {exc!r}")
            self._portal_cm.__exit__(None, None, None)
            if self.ep is not None:   # (the closes' crashes too: the count outlives close)
                self.problems += self._crashes()
        self._check(self.problems)

    def _finish(self) -> None:
        """Every load's task ends within END_BOUND (cancelled ones too); then every settled
        load's slots are as they were, and the pool is idle and sound."""
        assert self.ep is not None
        waited = 0.0
        while any(not p.ended.is_set() for p in self.pending) and waited < END_BOUND:
            self.portal.call(anyio.sleep, 0.05)
            waited += 0.05
        hung = [p for p in self.pending if not p.ended.is_set()]
        for load in self.pending:
            if load.ended.is_set():
                self._settle(load)
        self.pending = hung
        if hung:
            self.problems.append(f"{len(hung)} loads had not ended {END_BOUND:.0f} s after the "
                                 f"last step (slabs {self.ep.recv_slab_stats}); first: "
                                 f"{hung[0].request}")
            for load in hung:   # cancel them, so that the pool can be checked and closed
                assert load.future is not None
                load.future.cancel()
            self.portal.call(anyio.sleep, 0.2)
            self.pending = []
        self.problems += self._unchanged()
        if not self.portal.call(wait_settled, self.ep):
            self.problems.append(f"slab stats still changing: {self.ep.recv_slab_stats}")
        self.problems += self.portal.call(check_slab_invariants, self.ep)


#: a fixed sequence of examples (derandomize), no shrinking; XAVIER_STATEFUL_EXAMPLES
#: scales it, XAVIER_STATEFUL_SEED (any value) draws a new sequence
SETTINGS = settings(
    max_examples=int(os.environ.get("XAVIER_STATEFUL_EXAMPLES", "40")), stateful_step_count=30,
    deadline=None, derandomize="XAVIER_STATEFUL_SEED" not in os.environ, database=None,
    phases=[Phase.explicit, Phase.generate], suppress_health_check=[HealthCheck.too_slow])

#: the problems (and steps) of every run that broke an invariant, first one first
FOUND: list[list[str]] = []


def test_slab_pool_fencing_and_replacements():
    """Real time decides at which step a broken run first shows, so hypothesis's replay of
    a failing example may break elsewhere (it then reports the test as flaky): the
    failure reported here is the first run's, with its steps."""
    FOUND.clear()
    try:
        run_state_machine_as_test(SlabPoolMachine, settings=SETTINGS)
    except Exception as exc:
        if FOUND:
            raise AssertionError("an invariant broke:\n  " + "\n  ".join(FOUND[0])) from exc
        raise

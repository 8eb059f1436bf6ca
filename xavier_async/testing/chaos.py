"""A Jepsen-style chaos test over real NIXL processes: seeded random schedules of loads and
faults against one loader, with the library's guarantees checked after every step.

A *schedule* (:class:`ChaosSchedule`, generated from a seed alone) runs a loader endpoint
in this process (``K`` receive slabs, 1-4, chosen per schedule) against 3-4 source
processes (:class:`SourcePool`, kept across schedules: a process takes seconds to start).
Its steps:

* ``loads``: 32-64 loads at once (small, large, several batches, two sources in one load,
  now and then an unpublished key), some cancelled after a random short delay
  (``anyio.move_on_after``), while faults hit the sources at random moments: SIGKILL,
  SIGSTOP, SIGCONT; the last step may close the loader in the middle of its loads. About
  a third of these steps are *serial*: their loads go one at a time, spread over the
  faults' window, so that a small one polls for its own reply
  (``EndpointConfig.reply_spin``) while the faults land;
* ``restart``: a new process for a killed rank (with a new byte pattern), connected;
* ``reconnect``: connect every rank the loader lost (a frozen one must fail, typed and
  in time);
* ``resume``: SIGCONT every frozen rank (it may serve its stale requests), and connect
  it again if the loader lost it.

The invariants, checked after every step (a breach is a :class:`Violation` naming the
seed and the step):

* ``bytes``: every successful load holds exactly its source's bytes, every block; a
  failed or cancelled load left each of its blocks untouched or exactly right, never a
  wrong byte; and the blocks stay so until the step ends;
* ``typed``: every failure is an :class:`~xavier_async.XavierError`, never a bare
  builtin or an ``ExceptionGroup``; nothing escapes ``async with Endpoint``;
* ``internal``: no library bug, however well contained: no load or connect fails with
  :class:`~xavier_async.InternalError` (the library's own broken invariant, which
  the engine makes of any unexpected exception in a round trip), and no background task
  of the loader or of a source crashes
  (:func:`~xavier_async.testing.invariants.task_crashes` stays 0);
* ``bounded``: every call returns within its bound (:meth:`ChaosConfig.load_bound`,
  enforced by a hang guard that reports the call);
* ``slabs``: no receive slab leaked or owned twice, registrations equal the pool
  (:func:`~xavier_async.testing.invariants.check_slab_invariants`);
* ``close``: close returns within its bound, is idempotent (a second and a concurrent
  close return too), and a load after it fails with ``EndpointClosedError``.

Replay a failure with ``run_schedule(seed)`` (the schedule is the same; the timing of a
real system is not, so a rare race may need a few runs)::

    from xavier_async.testing.chaos import run_schedule, run_schedules
    report = run_schedule(1234)
    print(report.summary())
    for v in report.violations:
        print(v)

or from a shell: ``python -m xavier_async.testing.chaos --schedules 20 --seed 1000``.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..endpoint import Endpoint, EndpointConfig
from ..errors import EndpointClosedError, InternalError, XavierError
from ..layout import CacheLayout
from ..planning import Planner
from .invariants import check_slab_invariants, task_crashes, wait_settled
from .peer_process import DTYPES, LayoutSpec, PeerProcess, PeerSpec, pattern_caches

__all__ = ["ChaosConfig", "ChaosReport", "ChaosSchedule", "Fault", "LoadPlan", "SourcePool", "Step",
           "Violation", "run_schedule", "run_schedules"]

KiB = 1024

#: what each source rank's process injects itself (fixed per rank, so that a schedule's
#: sources are the same whichever schedules ran before): slowed writes keep copies in
#: flight (so that faults hit them), rank 1 serves stale requests after a freeze (no
#: stall check), rank 2 also fails a few writes
SOURCE_FAULTS: dict[int, dict[str, Any]] = {
    1: {"write_stall_rate": 0.5, "stall_seconds": 0.03},
    2: {"write_stall_rate": 0.3, "stall_seconds": 0.02, "write_failure_rate": 0.02},
    3: {"write_stall_rate": 0.2, "stall_seconds": 0.01},
    4: {"write_stall_rate": 1.0, "stall_seconds": 0.01},
}
SOURCE_TRANSPORT: dict[int, dict[str, Any]] = {1: {"stall_check": 0.0}}


@dataclass(frozen=True)
class ChaosConfig:
    """The knobs of a chaos run (ranges are inclusive ``(low, high)``)."""

    sources: tuple[int, int] = (3, 4)
    receive_slabs: tuple[int, int] = (1, 4)
    #: loads started at once in a ``loads`` step
    loads: tuple[int, int] = (32, 64)
    steps: tuple[int, int] = (4, 7)
    #: the loader's ``EndpointConfig.request_timeout``
    request_timeout: float = 1.0
    #: the loader's ``EndpointConfig.reply_spin``: longer than the default, so that with
    #: three or four source processes on a small machine a serial step's small loads
    #: poll for their replies (the path under test) rather than wait for them
    reply_spin: float = 0.002
    #: the loader's NIXL handshake timeout (also how long telling a peer about a new
    #: receive slab may wait) and the timeout of every connect
    handshake_timeout: float = 1.0
    #: how long the loader keeps a rank lost without a clean close for its old process
    rank_grace: float = 1.0
    #: added to every bound (scheduling noise on a loaded host)
    margin: float = 3.0
    #: the fraction of loads cancelled after a random delay of up to ``cancel_within`` s
    cancel_rate: float = 0.2
    cancel_within: float = 0.03
    #: faults land within this many seconds of a step's start
    fault_window: float = 0.4
    #: at most this many faults (SIGKILL, SIGSTOP, SIGCONT) per ``loads`` step; 0: none
    #: (a control run: cancellations and the close in flight only)
    max_faults: int = 3
    #: a fraction of loads naming one unpublished key (refused: RemoteError)
    unpublished_rate: float = 0.03
    full_bytes: int = 32 * KiB
    small_bytes: int = 4 * KiB
    #: the sources' published caches (the loader's has room for every load of a step)
    layout: LayoutSpec = LayoutSpec(layers=2, num_slots=64, block_shape=(4, 64), dtype="bfloat16")
    pattern_seed: int = 77

    def load_bound(self, batches: int, sources: int) -> float:
        """How long a load of ``batches`` batches may take when ``sources`` sources may be
        frozen: a batch waits for a receive slab at most one timed-out round trip (plus
        telling a frozen peer about a slab) per source ahead of it, then makes its own;
        several batches are probed first (one more round trip)."""
        per_batch = (self.request_timeout + self.handshake_timeout) * (sources + 1)
        probe = self.request_timeout if batches > 1 else 0.0
        return self.margin + probe + batches * per_batch

    def connect_bound(self) -> float:
        return self.handshake_timeout + self.margin

    def source_spec(self, rank: int, generation: int) -> PeerSpec:
        """The process of ``rank``'s ``generation``-th incarnation (a restart has a new
        byte pattern, so bytes of an old incarnation are wrong bytes)."""
        return PeerSpec(rank=rank, layout=self.layout, seed=self.source_seed(rank, generation),
                        config={"full_bytes": self.full_bytes, "small_bytes": self.small_bytes},
                        torch_threads=1, faults={**SOURCE_FAULTS.get(rank, {}), "seed": rank},
                        transport=dict(SOURCE_TRANSPORT.get(rank, {})))

    def source_seed(self, rank: int, generation: int) -> int:
        return self.pattern_seed + 7919 * generation


# -- the schedule (pure: a function of the seed) ----------------------------------------------

@dataclass
class LoadPlan:
    """One load: ``request`` is ``{source: {layer: {key: slot}}}``; ``cancel_after``:
    cancel it after that many seconds (``None``: never); ``batches``: how many batches the
    engine plans it into (set when it runs; its bound depends on it)."""

    request: dict[int, dict[int, dict[int, int]]]
    cancel_after: float | None = None
    batches: int = 1
    unpublished: bool = False

    @property
    def slots(self) -> int:
        return sum(len(blocks) for layers in self.request.values() for blocks in layers.values())


@dataclass(frozen=True)
class Fault:
    """``kind`` (``kill``, ``stop`` or ``cont``) hits ``rank`` ``at`` seconds into a step."""

    at: float
    kind: str
    rank: int


@dataclass
class Step:
    """One step of a schedule (see the module docstring for the kinds)."""

    kind: str
    loads: list[LoadPlan] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: ``loads`` only: close the loader this many seconds after the step starts
    close_at: float | None = None
    #: ``restart``: the ranks to start again
    ranks: list[int] = field(default_factory=list)
    #: ``loads`` only: one at a time, spread over the faults' window (else all at once)
    serial: bool = False

    def describe(self) -> str:
        if self.kind != "loads":
            return f"{self.kind} {self.ranks}" if self.ranks else self.kind
        cancels = sum(p.cancel_after is not None for p in self.loads)
        faults = ", ".join(f"{f.kind} {f.rank} @{f.at:.2f}s" for f in self.faults) or "no faults"
        close = f", close @{self.close_at:.2f}s" if self.close_at is not None else ""
        serial = "serial " if self.serial else ""
        return f"{serial}loads x{len(self.loads)} ({cancels} cancelled; {faults}{close})"


@dataclass
class ChaosSchedule:
    """A seeded schedule: the loader's ``receive_slabs`` and ``merge_loads``, how many
    ``sources`` (ranks 1..n), and the steps."""

    seed: int
    sources: int
    receive_slabs: int
    merge_loads: bool
    steps: list[Step]

    @property
    def ranks(self) -> list[int]:
        return list(range(1, self.sources + 1))

    @classmethod
    def generate(cls, seed: int, config: ChaosConfig | None = None) -> ChaosSchedule:
        """The schedule of ``seed`` (the same for the same seed and config)."""
        cfg = config or ChaosConfig()
        rng = random.Random(seed)
        n = rng.randint(*cfg.sources)
        k = rng.randint(*cfg.receive_slabs)
        merge = rng.random() < 0.8
        ranks = list(range(1, n + 1))
        state = {r: "up" for r in ranks}   # as the schedule will have left them
        steps: list[Step] = []
        count = rng.randint(*cfg.steps)
        for i in range(count):
            last = i == count - 1
            dead = [r for r in ranks if state[r] == "dead"]
            stopped = [r for r in ranks if state[r] == "stopped"]
            choices = ["loads"] * 6 + ["reconnect"] * 2 + (["restart"] * 3 if dead else []) \
                + (["resume"] * 2 if stopped else [])
            kind = "loads" if i == 0 or last else rng.choice(choices)
            if kind == "restart":
                steps.append(Step("restart", ranks=sorted(rng.sample(dead, rng.randint(1, len(dead))))))
                for r in steps[-1].ranks:
                    state[r] = "up"
            elif kind == "resume":
                steps.append(Step("resume", ranks=stopped))
                for r in stopped:
                    state[r] = "up"
            elif kind == "reconnect":
                steps.append(Step("reconnect"))
            else:
                # (drawn apart from the schedule's stream: a seed's loads and faults are
                # what they were before serial steps existed)
                serial = random.Random(f"serial {seed} {i}").random() < 1 / 3
                step = Step("loads", loads=_plan_loads(rng, cfg, ranks), serial=serial)
                for at in sorted(rng.uniform(0, cfg.fault_window) for _ in range(rng.randint(0, cfg.max_faults))):
                    up = [r for r in ranks if state[r] == "up"]
                    stopped = [r for r in ranks if state[r] == "stopped"]
                    # one source stays up (its loads are the ones a fault must not corrupt)
                    hit = up if len(up) > 1 else []
                    options = [("stop", r) for r in hit] * 2 + [("kill", r) for r in hit + stopped] \
                        + [("cont", r) for r in stopped] * 2
                    if not options:
                        break
                    what, r = rng.choice(options)
                    step.faults.append(Fault(at, what, r))
                    state[r] = {"stop": "stopped", "kill": "dead", "cont": "up"}[what]
                if last and rng.random() < 0.5:
                    step.close_at = rng.uniform(0.0, cfg.fault_window + cfg.request_timeout)
                steps.append(step)
        return cls(seed, n, k, merge, steps)

    def describe(self) -> str:
        head = (f"seed {self.seed}: {self.sources} sources, K={self.receive_slabs} receive slabs, "
                f"merge_loads={self.merge_loads}")
        return "\n".join([head, *(f"  step {i}: {s.describe()}" for i, s in enumerate(self.steps))])


def _plan_loads(rng: random.Random, cfg: ChaosConfig, ranks: Sequence[int]) -> list[LoadPlan]:
    """32-64 loads; load ``i`` writes the loader's slots ``i * P ..`` (``P``: the sources'
    published slots), so no two loads of a step share a slot."""
    published = cfg.layout.num_slots
    block = cfg.layout.block_nbytes * cfg.layout.layers
    plans = []
    for i in range(rng.randint(*cfg.loads)):
        base = i * published
        shape = rng.choices(["small", "large", "multi", "two"], weights=[5, 3, 1, 1])[0]
        srcs = rng.sample(list(ranks), 2) if shape == "two" else [rng.choice(list(ranks))]
        request: dict[int, dict[int, dict[int, int]]] = {}
        slot = base
        for src in srcs:
            if shape == "large":
                n = rng.randint(cfg.small_bytes // block + 1, cfg.full_bytes // block)
            elif shape == "multi":
                n = rng.randint(cfg.full_bytes // block + 1, published)
            else:
                n = rng.randint(1, max(1, cfg.small_bytes // block // len(srcs)))
            keys = rng.sample(range(published), n)
            request[src] = {layer: {k: slot + j for j, k in enumerate(keys)}
                            for layer in range(cfg.layout.layers)}
            slot += n
        unpublished = rng.random() < cfg.unpublished_rate and slot < base + published
        if unpublished:   # one key nobody published: the load is refused
            src = srcs[0]
            for blocks in request[src].values():
                blocks[published + 1000] = slot
        cancel = rng.uniform(0, cfg.cancel_within) if rng.random() < cfg.cancel_rate else None
        plans.append(LoadPlan(request, cancel, unpublished=unpublished))
    return plans


# -- the source processes ------------------------------------------------------------------

class SourcePool:
    """Source processes by rank, kept across schedules (start is the slow part). Blocking
    methods: call them from a thread inside async code. Use as a context manager, or
    :meth:`close` it."""

    def __init__(self, config: ChaosConfig | None = None, start_timeout: float = 60.0) -> None:
        self.config = config or ChaosConfig()
        self.start_timeout = start_timeout
        self._procs: dict[int, PeerProcess] = {}
        self._generation: dict[int, int] = {}
        self._stopped: set[int] = set()
        self._lock = threading.Lock()
        #: each process's task crashes as last read (by pid: a restart starts at 0)
        self._crashes_seen: dict[int, int] = {}
        #: processes started so far (restarts included)
        self.started = 0

    def state(self, rank: int) -> str:
        """``up``, ``stopped`` or ``dead`` (never started counts as dead)."""
        p = self._procs.get(rank)
        if p is None or p.proc.poll() is not None:
            return "dead"
        return "stopped" if rank in self._stopped else "up"

    def address(self, rank: int) -> str:
        return self._procs[rank].address

    def expected(self, rank: int) -> dict[int, torch.Tensor]:
        """The bytes ``rank``'s current process publishes (its pattern)."""
        gen = self._generation.get(rank, 0)
        return pattern_caches(self.config.layout, rank, self.config.source_seed(rank, gen))

    def ensure(self, ranks: Iterable[int]) -> list[int]:
        """Resume the frozen ones and start the dead ones (at once); the ranks started."""
        ranks = list(ranks)
        for r in ranks:
            if self.state(r) == "stopped":
                self.cont(r)
        dead = [r for r in ranks if self.state(r) == "dead"]
        self._start(dead)
        return dead

    def _start(self, ranks: list[int]) -> None:
        if not ranks:
            return
        specs = {}
        for r in ranks:
            old = self._procs.pop(r, None)
            if old is not None:
                _reap(old)
            gen = self._generation[r] = self._generation.get(r, -1) + 1
            specs[r] = self.config.source_spec(r, gen)
        with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
            futures = {r: pool.submit(PeerProcess, s, self.start_timeout) for r, s in specs.items()}
            errors = []
            for r, f in futures.items():
                try:
                    self._procs[r] = f.result()
                    self.started += 1
                except Exception as exc:  # a child that did not come up
                    errors.append(exc)
        if errors:
            raise errors[0]

    def kill(self, rank: int) -> bool:
        """SIGKILL (a frozen process dies too); ``False`` if it was already dead."""
        p = self._procs.get(rank)
        if p is None or p.proc.poll() is not None:
            return False
        p.proc.kill()
        self._stopped.discard(rank)
        try:
            p.proc.wait(10)
        except Exception:
            pass
        return True

    def stop(self, rank: int) -> bool:
        """SIGSTOP; ``False`` unless it was up."""
        if self.state(rank) != "up":
            return False
        os.kill(self._procs[rank].proc.pid, signal.SIGSTOP)
        self._stopped.add(rank)
        return True

    def cont(self, rank: int) -> bool:
        """SIGCONT; ``False`` unless it was stopped."""
        if self.state(rank) != "stopped":
            return False
        os.kill(self._procs[rank].proc.pid, signal.SIGCONT)
        self._stopped.discard(rank)
        return True

    def new_task_crashes(self, rank: int, timeout: float = 10.0) -> int | None:
        """How many background tasks of ``rank``'s process crashed since the last call for
        that process (0 unless it is up); ``None`` if it did not answer within
        ``timeout``."""
        p = self._procs.get(rank)
        if p is None or self.state(rank) != "up":
            return 0
        try:
            total = p.task_crashes(timeout)
        except Exception:
            return None
        seen = self._crashes_seen.get(p.proc.pid, 0)
        self._crashes_seen[p.proc.pid] = total
        return total - seen

    def resume_all(self) -> None:
        for r in list(self._stopped):
            self.cont(r)

    def close(self) -> None:
        """Resume, close (kill if need be) every process."""
        self.resume_all()
        for p in self._procs.values():
            if p.proc.poll() is None:
                try:
                    p.close(timeout=5)
                except Exception:
                    pass
            _reap(p)
        self._procs.clear()

    def __enter__(self) -> SourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reap(p: PeerProcess) -> None:
    if p.proc.poll() is None:
        try:
            os.kill(p.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.proc.kill()
    try:
        p.proc.wait(10)
    except Exception:
        pass
    try:
        p._child.conn.close()
    except Exception:
        pass


# -- the report ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Violation:
    """A broken invariant: which ``seed`` and ``step`` (its ``kind``), which ``invariant``
    (``bytes``, ``typed``, ``internal``, ``bounded``, ``slabs``, ``close``), and what
    happened."""

    seed: int
    step: int
    kind: str
    invariant: str
    detail: str

    def __str__(self) -> str:
        return (f"seed {self.seed} step {self.step} ({self.kind}): [{self.invariant}] "
                f"{self.detail} -- replay: run_schedule({self.seed})")


@dataclass
class ChaosReport:
    """What a run did and found: ``schedules`` and ``steps`` run, loads ``ok`` /
    ``failed`` / ``cancelled`` (``errors``: failures by type), ``faults`` injected by kind,
    ``violations`` and the wall time; ``spins``: round trips that polled for their reply
    themselves (``EndpointConfig.reply_spin``: that path, under the same faults), ``polled``
    those whose reply came within the spin; ``crashes``: background tasks of the loader
    and the sources that crashed (each one also an ``internal`` violation)."""

    schedules: int = 0
    steps: int = 0
    ok: int = 0
    failed: int = 0
    cancelled: int = 0
    spins: int = 0
    polled: int = 0
    crashes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0
    #: the seeds run, with each one's violations count
    seeds: dict[int, int] = field(default_factory=dict)

    def count(self, what: dict[str, int], key: str, n: int = 1) -> None:
        what[key] = what.get(key, 0) + n

    def merge(self, other: ChaosReport) -> None:
        self.schedules += other.schedules
        self.steps += other.steps
        self.ok += other.ok
        self.failed += other.failed
        self.cancelled += other.cancelled
        self.spins += other.spins
        self.polled += other.polled
        self.crashes += other.crashes
        for k, v in other.errors.items():
            self.count(self.errors, k, v)
        for k, v in other.faults.items():
            self.count(self.faults, k, v)
        self.violations.extend(other.violations)
        self.seconds += other.seconds
        self.seeds.update(other.seeds)

    def summary(self) -> str:
        bad = sorted(s for s, n in self.seeds.items() if n)
        return (f"{self.schedules} schedules, {self.steps} steps in {self.seconds:.1f} s; loads: "
                f"{self.ok} ok, {self.failed} failed {dict(sorted(self.errors.items()))}, "
                f"{self.cancelled} cancelled; {self.spins} reply spins, {self.polled} "
                f"replies polled; faults {dict(sorted(self.faults.items()))}; "
                f"{self.crashes} task crashes; "
                f"{len(self.violations)} violations" + (f" (seeds {bad})" if bad else ""))


# -- running a schedule ----------------------------------------------------------------------

class _Run:
    """One schedule against one loader (the async part, in its own event loop)."""

    def __init__(self, schedule: ChaosSchedule, cfg: ChaosConfig, pool: SourcePool,
                 report: ChaosReport) -> None:
        self.schedule, self.cfg, self.pool, self.report = schedule, cfg, pool, report
        self.step = -1
        self.kind = "start"
        self.expected: dict[int, dict[int, torch.Tensor]] = {}
        slots = cfg.loads[1] * cfg.layout.num_slots
        dtype = DTYPES[cfg.layout.dtype]
        self.caches = {layer: torch.zeros(slots, *cfg.layout.block_shape, dtype=dtype)
                       for layer in range(cfg.layout.layers)}
        self.planner = Planner(CacheLayout.of(self.caches), cfg.full_bytes)
        self.ep: Endpoint | None = None
        self.closed = False
        self.in_flight_batches = 1
        self.slab_problems: set[str] = set()
        self.loader_crashes = 0   # the loader's task crashes already reported

    def violation(self, invariant: str, detail: str) -> None:
        self.report.violations.append(
            Violation(self.schedule.seed, self.step, self.kind, invariant, detail))

    # -- bytes ------------------------------------------------------------------------
    def batches(self, plan: LoadPlan) -> list[list[tuple[int, int, int, int]]]:
        """The load's batches as the engine plans them: ``(source, layer, key, slot)`` each
        (a batch is unpacked whole or not at all)."""
        out = []
        for b in self.planner.plan(plan.request):
            out.append([(b.src, int(seg.layer), int(key), slot)
                        for seg in b.segments for key, slots in zip(seg.keys, seg.slots)
                        for slot in slots])
        return out

    def check_bytes(self, i: int, plan: LoadPlan, outcome: str, when: str) -> bool:
        """Every batch of a successful load exact; of a failed or cancelled one, exact or
        untouched (still zero), never a wrong byte, never part of a batch. ``False`` (and a
        violation) otherwise."""
        published = self.cfg.layout.num_slots
        wrong: list[str] = []
        torn: list[str] = []
        missing = 0
        for batch in self.batches(plan):
            exact = untouched = 0
            for src, layer, key, slot in batch:
                got = self.caches[layer][slot].reshape(-1).view(torch.uint8)
                want_src = self.expected.get(src)
                if key < published and want_src is not None and torch.equal(
                        got, want_src[layer][key].reshape(-1).view(torch.uint8)):
                    exact += 1
                elif not got.any():
                    untouched += 1
                elif len(wrong) < 3:
                    wrong.append(f"block {key} of rank {src} layer {layer} in slot {slot}")
                else:
                    wrong.append("...")
            if exact and untouched:
                torn.append(f"a batch of {len(batch)} blocks from rank {batch[0][0]} has {exact} "
                            f"exact and {untouched} untouched")
            if exact != len(batch):
                missing += len(batch) - exact
        nblocks = plan.slots
        if wrong or torn:
            self.violation("bytes", f"load {i} ({outcome}, {when}) holds wrong bytes: "
                                    f"{'; '.join(wrong[:4] + torn[:2])}; request {_short(plan.request)}")
            return False
        if outcome == "ok" and missing:
            self.violation("bytes", f"load {i} returned success with wrong bytes ({when}): {missing} "
                                    f"of {nblocks} blocks still zero, not the source's; request "
                                    f"{_short(plan.request)}")
            return False
        return True

    # -- the steps --------------------------------------------------------------------
    async def run(self) -> None:
        sched, cfg = self.schedule, self.cfg
        self.kind = "start"
        await anyio.to_thread.run_sync(self.pool.ensure, sched.ranks)
        for r in sched.ranks:
            self.expected[r] = self.pool.expected(r)
        from ..transports.nixl import NixlTransport
        transport = NixlTransport(handshake_timeout=cfg.handshake_timeout, rank_grace=cfg.rank_grace)
        config = EndpointConfig(full_bytes=cfg.full_bytes, small_bytes=cfg.small_bytes,
                                request_timeout=cfg.request_timeout, reply_spin=cfg.reply_spin,
                                receive_slabs=sched.receive_slabs, merge_loads=sched.merge_loads)
        self.ep = ep = Endpoint(0, self.caches, transport, config)
        try:
            async with ep:
                for r in sched.ranks:
                    await self.connect(r, must=True)
                for self.step, step in enumerate(sched.steps):
                    self.kind = step.kind
                    self.report.steps += 1
                    if step.kind == "loads":
                        await self.loads(step)
                    elif step.kind == "restart":
                        await self.restart(step.ranks)
                    elif step.kind == "reconnect":
                        for r in sched.ranks:
                            if r not in ep.peers and self.pool.state(r) != "dead":
                                await self.connect(r, must=False)
                    elif step.kind == "resume":   # SIGCONT, then connect it again if it was lost
                        for r in step.ranks:
                            if await anyio.to_thread.run_sync(self.pool.cont, r):
                                self.report.count(self.report.faults, "cont")
                        for r in step.ranks:
                            if r not in ep.peers and self.pool.state(r) == "up":
                                await self.connect(r, must=False)
                    self.check_loader_crashes()
                    if self.closed:
                        break
                    await self.check_slabs()
                if not self.closed:
                    self.step += 1
                    self.kind = "close"
                    await self.close(None)
        except Exception as exc:   # out of `async with Endpoint`: the endpoint crashed
            self.violation("typed", "an exception escaped `async with Endpoint`: "
                           + _describe(exc))
        finally:
            self.report.spins += ep.metrics.reply_spins
            self.report.polled += ep.metrics.replies_polled
            self.check_loader_crashes()   # (the close's too)
            await anyio.to_thread.run_sync(self.pool.resume_all)
            await self.check_source_crashes()

    def check_loader_crashes(self) -> None:
        """The loader's background tasks that crashed since the last check: a violation."""
        n = task_crashes(self.ep)
        if n > self.loader_crashes:
            self.report.crashes += n - self.loader_crashes
            self.violation("internal", f"{n - self.loader_crashes} background task(s) of the "
                                       "loader crashed (logged: 'background task ... failed')")
            self.loader_crashes = n

    async def check_source_crashes(self) -> None:
        """The sources' background tasks that crashed since the last check (of each
        process; a crash while an earlier schedule's loader closed shows here)."""
        for r in self.schedule.ranks:
            n = await anyio.to_thread.run_sync(self.pool.new_task_crashes, r)
            if n is None:
                self.violation("bounded", f"rank {r} ({self.pool.state(r)}) did not say within "
                                          "10 s how many of its tasks crashed")
            elif n:
                self.report.crashes += n
                self.violation("internal", f"{n} background task(s) of rank {r} crashed "
                                           "(logged in its process: 'background task ... failed')")

    async def connect(self, rank: int, must: bool) -> None:
        assert self.ep is not None
        state = self.pool.state(rank)
        guard = self.cfg.connect_bound()
        with anyio.move_on_after(guard) as scope:
            try:
                await self.ep.connect(self.pool.address(rank), timeout=self.cfg.handshake_timeout)
                if not must:
                    self.report.count(self.report.faults, "reconnect")
                return
            except XavierError as exc:
                self.report.count(self.report.errors, f"connect:{type(exc).__name__}")
                if isinstance(exc, InternalError):
                    self.violation("internal", f"connect to rank {rank} ({state}) failed with a "
                                               f"library bug: {_describe(exc)}")
            except Exception as exc:
                self.violation("typed", f"connect to rank {rank} ({state}) raised a non-library "
                                        f"error: {_describe(exc)}")
        if scope.cancelled_caught:
            self.violation("bounded", f"connect to rank {rank} ({state}) did not return within "
                                      f"{guard:.1f} s")

    async def restart(self, ranks: list[int]) -> None:
        for r in ranks:   # (dead already, unless the schedule's faults missed it)
            await anyio.to_thread.run_sync(self.pool.kill, r)
        started = await anyio.to_thread.run_sync(self.pool.ensure, ranks)
        self.report.count(self.report.faults, "restart", len(started))
        for r in ranks:
            self.expected[r] = self.pool.expected(r)
            await self.connect(r, must=False)

    async def check_slabs(self) -> None:
        assert self.ep is not None
        if not await wait_settled(self.ep):
            self.violation("slabs", f"slab stats still changing 2 s after the loads settled: "
                                    f"{self.ep.recv_slab_stats}")
        for problem in check_slab_invariants(self.ep):
            if problem not in self.slab_problems:   # once per schedule: the state persists
                self.slab_problems.add(problem)
                self.violation("slabs", f"{problem}; stats {self.ep.recv_slab_stats}")

    async def loads(self, step: Step) -> None:
        ep = self.ep
        assert ep is not None
        for t in self.caches.values():
            t.zero_()
        outcomes: dict[int, str] = {}
        nsrc = self.schedule.sources
        for plan in step.loads:
            plan.batches = len(self.planner.plan(plan.request))
        self.in_flight_batches = max((p.batches for p in step.loads), default=1)

        async def one(i: int, plan: LoadPlan) -> None:
            bound = self.cfg.load_bound(plan.batches, nsrc)
            outcome = "ok"
            with anyio.move_on_after(bound) as guard:
                try:
                    if plan.cancel_after is not None:
                        with anyio.move_on_after(plan.cancel_after) as cancel:
                            await ep.load(plan.request)
                        if cancel.cancelled_caught:
                            outcome = "cancelled"
                    else:
                        await ep.load(plan.request)
                except XavierError as exc:
                    outcome = "failed"
                    self.report.count(self.report.errors, type(exc).__name__)
                    if isinstance(exc, InternalError):
                        self.violation("internal", f"load {i} failed with a library bug: "
                                                   f"{_describe(exc)}")
                except Exception as exc:
                    outcome = "failed"
                    self.report.count(self.report.errors, type(exc).__name__)
                    self.violation("typed", f"load {i} raised a non-library error: {_describe(exc)}")
            if guard.cancelled_caught:
                outcome = "hung"
                self.violation("bounded", f"load {i} did not return within {bound:.1f} s "
                                          f"({plan.batches} batches; request "
                                          f"{_short(plan.request)}); slabs {ep.recv_slab_stats}")
            if outcome == "ok" and plan.unpublished:
                self.violation("bytes", f"load {i} of an unpublished key returned success")
            self.tally(outcome)
            if outcome != "hung" and self.check_bytes(i, plan, outcome, "when it returned"):
                outcomes[i] = outcome

        async def serial(plans: list[LoadPlan]) -> None:
            """One load after another, spread over the faults' window."""
            gap = self.cfg.fault_window / max(1, len(plans))
            for i, plan in enumerate(plans):
                await one(i, plan)
                await anyio.sleep(gap)

        async def fault(f: Fault) -> None:
            await anyio.sleep(f.at)
            done = await anyio.to_thread.run_sync(
                {"kill": self.pool.kill, "stop": self.pool.stop, "cont": self.pool.cont}[f.kind], f.rank)
            if done:
                self.report.count(self.report.faults, f.kind)

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as loads_scope:
                async with anyio.create_task_group() as work:
                    for f in step.faults:
                        work.start_soon(fault, f)
                    if step.serial:
                        work.start_soon(serial, step.loads)
                    else:
                        for i, plan in enumerate(step.loads):
                            work.start_soon(one, i, plan)
                    if step.close_at is not None:
                        tg.start_soon(self.close_later, step.close_at, loads_scope)
        for i, plan in enumerate(step.loads):   # the bytes stay put until the step ends
            if i in outcomes:
                self.check_bytes(i, plan, outcomes[i], "checked again at the end of the step")

    def tally(self, outcome: str) -> None:
        if outcome == "ok":
            self.report.ok += 1
        elif outcome == "cancelled":
            self.report.cancelled += 1
        else:
            self.report.failed += 1

    async def close_later(self, at: float, loads_scope: anyio.CancelScope) -> None:
        await anyio.sleep(at)
        self.report.count(self.report.faults, "close_in_flight")
        await self.close(loads_scope)

    async def close(self, loads_scope: anyio.CancelScope | None) -> None:
        """Close the loader (twice at once, then once more): each returns within the
        bound; then a load fails with EndpointClosedError. Close is shielded in the
        engine, so it runs in tasks watched from here: a hung close is reported, then the
        step's loads are cancelled to let it finish."""
        ep = self.ep
        assert ep is not None
        self.closed = True
        # in flight: it drains the loads (each within its bound); idle: it only lets go
        bound = (self.cfg.load_bound(self.in_flight_batches, self.schedule.sources)
                 if loads_scope is not None else self.cfg.connect_bound())
        finished: list[BaseException | None] = []

        async def closer() -> None:
            try:
                await ep.aclose()
                finished.append(None)
            except BaseException as exc:  # reported below (a cancellation re-raised)
                finished.append(exc)
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(closer)
            tg.start_soon(closer)
            with anyio.move_on_after(bound):
                while len(finished) < 2:
                    await anyio.sleep(0.01)
            if len(finished) < 2:
                self.violation("close", f"aclose() did not return within {bound:.1f} s; slabs "
                                        f"{ep.recv_slab_stats}")
                if loads_scope is not None:
                    loads_scope.cancel()
        for exc in finished:
            if exc is not None:
                self.violation("close", f"aclose() raised {_describe(exc)}")
        with anyio.move_on_after(self.cfg.margin) as scope:
            await ep.aclose()   # idempotent
        if scope.cancelled_caught:
            self.violation("close", "a second aclose() did not return at once")
        try:
            await ep.load({self.schedule.ranks[0]: {0: {0: 0}}})
            self.violation("close", "a load after close succeeded")
        except EndpointClosedError:
            pass
        except Exception as exc:
            self.violation("typed", f"a load after close raised {_describe(exc)}, not "
                                    "EndpointClosedError")


def _describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return f"{exc!r}\n{text[-2000:]}"


def _short(request: Any) -> str:
    out = {src: {layer: len(blocks) for layer, blocks in layers.items()}
           for src, layers in request.items()}
    return f"{{source: {{layer: blocks}}}} = {out}"


def run_schedule(seed: int, *, config: ChaosConfig | None = None,
                 sources: SourcePool | None = None, verbose: bool = False) -> ChaosReport:
    """Run the schedule of ``seed`` (:meth:`ChaosSchedule.generate`) against real NIXL
    processes and check the invariants after every step. ``sources``: a pool to reuse
    (one is started, and closed afterwards, if not given). Returns the report; its
    ``violations`` name the seed and step.

    The loader runs in an event loop of its own, in a thread: if even a hang guard cannot
    stop a call (a close that waits forever inside a shielded scope), the schedule is
    reported as hung after its overall bound, its sources are killed, and the run
    continues."""
    cfg = config or (sources.config if sources is not None else ChaosConfig())
    own = sources is None
    pool = sources if sources is not None else SourcePool(cfg)
    report = ChaosReport(schedules=1)
    schedule = ChaosSchedule.generate(seed, cfg)
    if verbose:
        print(schedule.describe(), flush=True)
    run = _Run(schedule, cfg, pool, report)
    t0 = time.monotonic()
    failure: list[BaseException] = []

    def target() -> None:
        try:
            anyio.run(run.run)
        except BaseException as exc:  # a bug of the driver, or of the engine it drives
            failure.append(exc)

    thread = threading.Thread(target=target, name=f"chaos-{seed}", daemon=True)
    try:
        thread.start()
        worst = max(cfg.load_bound(4, schedule.sources), cfg.connect_bound())
        overall = 120.0 + len(schedule.steps) * (2 * worst + 30.0)
        thread.join(overall)
        if thread.is_alive():
            run.violation("bounded", f"the schedule did not finish within {overall:.0f} s "
                                     f"(stuck in step {run.step}, {run.kind}); its sources are "
                                     "killed")
            for r in schedule.ranks:
                pool.kill(r)
            thread.join(30)
        if failure:
            run.violation("typed", f"the run failed: {_describe(failure[0])}")
    finally:
        report.seconds = time.monotonic() - t0
        report.seeds[seed] = len(report.violations)
        if own:
            pool.close()
    return report


def run_schedules(seeds: Iterable[int], *, config: ChaosConfig | None = None,
                  sources: SourcePool | None = None, verbose: bool = False) -> ChaosReport:
    """Run several schedules, reusing one pool of source processes; one merged report."""
    cfg = config or (sources.config if sources is not None else ChaosConfig())
    own = sources is None
    pool = sources if sources is not None else SourcePool(cfg)
    total = ChaosReport()
    try:
        for seed in seeds:
            r = run_schedule(seed, config=cfg, sources=pool, verbose=verbose)
            if verbose:
                print(f"seed {seed}: {r.summary()}", flush=True)
                for v in r.violations:
                    print(f"  {v}".split("\n")[0], flush=True)
            total.merge(r)
    finally:
        if own:
            pool.close()
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xavier_async.testing.chaos --schedules N --seed S``: exit status 1 if
    any invariant broke."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m xavier_async.testing.chaos",
                                     description="seeded chaos schedules over real NIXL processes")
    parser.add_argument("--schedules", type=int, default=10, help="how many schedules (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed (then seed+1, ...)")
    parser.add_argument("--request-timeout", type=float, default=ChaosConfig.request_timeout)
    parser.add_argument("-v", "--verbose", action="store_true", help="print every schedule")
    args = parser.parse_args(argv)
    cfg = ChaosConfig(request_timeout=args.request_timeout)
    report = run_schedules(range(args.seed, args.seed + args.schedules), config=cfg,
                           verbose=args.verbose)
    print(report.summary())
    for v in report.violations:
        print(v)
    return 1 if report.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The chaos test (issue 21): seeded random schedules of loads, SIGKILL / SIGSTOP /
SIGCONT, restarts, reconnects, cancellations and a close in the middle, over real NIXL
processes, with the invariants checked after every step (:mod:`xavier_async.testing.chaos`).

A violation names its seed and step; replay it with
``xavier_async.testing.chaos.run_schedule(seed)``.

* the short run (default suite): four fixed schedules chosen to cover K = 1..4 receive
  slabs, merge_loads off, a restart and a close with loads in flight;
* the long run: ``pytest -m slow tests/test_chaos.py -rA`` runs ``XAVIER_CHAOS_SCHEDULES``
  schedules (default 200) from seed ``XAVIER_CHAOS_SEED`` (default 1000), in chunks of
  five (one test each) that share the source processes.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("nixl")

from xavier_async.testing.chaos import (ChaosConfig, ChaosReport, ChaosSchedule,  # noqa: E402
                                        SourcePool, run_schedule, run_schedules)

#: cover K = 1 (seed 1, with a restart), 2 (seed 3, closed in flight), 3 (seed 8,
#: merge_loads off, a restart, closed in flight) and 4 (seed 0, four sources)
SHORT_SEEDS = [1, 3, 8, 0]
LONG = int(os.environ.get("XAVIER_CHAOS_SCHEDULES", "200"))
FIRST = int(os.environ.get("XAVIER_CHAOS_SEED", "1000"))
CHUNK = 5


@pytest.fixture(scope="module")
def sources():
    """One pool of source processes for every schedule of this module."""
    with SourcePool(ChaosConfig()) as pool:
        yield pool


def _fail_on_violations(report: ChaosReport) -> None:
    if report.violations:
        lines = [str(v) for v in report.violations]
        pytest.fail(f"{len(lines)} invariant violations ({report.summary()}):\n" + "\n".join(lines),
                     pytrace=False)


def test_the_short_schedules_cover_what_they_claim():
    """The fixed seeds of the short run really vary K, turn merging off, restart a rank and
    close with loads in flight (so a change of the generator cannot silently empty it)."""
    scheds = [ChaosSchedule.generate(s) for s in SHORT_SEEDS]
    assert sorted(s.receive_slabs for s in scheds) == [1, 2, 3, 4]
    assert any(not s.merge_loads for s in scheds)
    steps = [step for s in scheds for step in s.steps]
    assert any(step.kind == "restart" for step in steps)
    assert sum(step.close_at is not None for step in steps) >= 2
    kinds = {f.kind for step in steps for f in step.faults}
    assert kinds == {"kill", "stop", "cont"}
    for s in scheds:
        assert 3 <= s.sources <= 4
        assert all(32 <= len(step.loads) <= 64 for step in s.steps if step.kind == "loads")
    # a seed is its schedule: the replay runs the same steps
    assert ChaosSchedule.generate(8).describe() == scheds[2].describe()


def test_chaos_short(sources):
    """A few schedules in the default suite; every invariant after every step."""
    report = run_schedules(SHORT_SEEDS, sources=sources)
    print(report.summary())
    # the schedules really ran, and really hit loads with faults and cancellations
    assert report.schedules == len(SHORT_SEEDS), report.summary()
    assert report.ok > 0 and report.failed > 0 and report.cancelled > 0, report.summary()
    assert report.faults.get("kill", 0) and report.faults.get("stop", 0), report.summary()
    assert report.spins > 0, report.summary()  # serial steps' loads polled for replies
    _fail_on_violations(report)


_long_total = ChaosReport()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range((LONG + CHUNK - 1) // CHUNK))
def test_chaos_long(sources, chunk):
    """``XAVIER_CHAOS_SCHEDULES`` schedules (default 200), five per test; the last chunk
    prints the total."""
    seeds = range(FIRST + chunk * CHUNK, FIRST + min(LONG, (chunk + 1) * CHUNK))
    report = run_schedules(seeds, sources=sources)
    _long_total.merge(report)
    print(f"seeds {seeds.start}..{seeds.stop - 1}: {report.summary()}")
    if chunk == (LONG + CHUNK - 1) // CHUNK - 1:
        print(f"chaos long run, total: {_long_total.summary()}")
    assert report.schedules == len(seeds)
    _fail_on_violations(report)


def test_a_control_run_without_faults_breaks_no_invariant():
    """The control: a schedule without signals (cancellations and a close in flight only)
    through ``run_schedule(seed)`` alone, which starts and stops its own sources (the
    replay entry point the violation messages name). The invariants must not flag a run
    in which nothing is killed or frozen."""
    cfg = ChaosConfig(sources=(3, 3), steps=(3, 3), max_faults=0)
    assert all(not step.faults for step in ChaosSchedule.generate(4, cfg).steps)
    report = run_schedule(4, config=cfg)
    print(report.summary())
    assert report.schedules == 1 and report.steps >= 3 and report.ok > 0, report.summary()
    assert report.cancelled > 0, report.summary()
    _fail_on_violations(report)

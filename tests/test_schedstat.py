"""The bench's per-phase scheduler figures (``xavier_async.bench.schedstat``)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from xavier_async.bench import schedstat


def test_delta_adds_a_process_threads_and_orders_them_by_cpu():
    before = {"loader": {"python3": (1_000_000_000, 0), "ucx": (0, 0)}}
    after = {"loader": {"python3": (1_500_000_000, 250_000_000), "ucx": (1_000_000_000, 50_000_000),
                        "xa-copy": (100_000_000, 0)}}   # a thread that started meanwhile
    d = schedstat.delta(before, after, wall_s=2.0, top=2)["loader"]
    assert d["cpu_s"] == pytest.approx(1.6)
    assert d["runqueue_wait_s"] == pytest.approx(0.3)
    assert d["cpu_of_wall"] == pytest.approx(0.8)
    assert d["runqueue_wait_of_wall"] == pytest.approx(0.15)
    assert d["threads"] == [["ucx", 1.0, 0.05], ["python3", 0.5, 0.25]]


def test_delta_of_an_ended_thread_is_not_negative():
    d = schedstat.delta({"p": {"t": (5, 5)}}, {"p": {"t": (1, 1)}}, wall_s=1.0)["p"]
    assert d["cpu_s"] == 0 and d["runqueue_wait_s"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/schedstat"),
                    reason="Linux schedstat only")
def test_a_phase_of_busy_work_counts_as_cpu():
    pid = {"me": os.getpid()}
    s0, t0 = schedstat.sample(pid), time.perf_counter()
    stop = t0 + 0.2
    while time.perf_counter() < stop:
        pass
    d = schedstat.delta(s0, schedstat.sample(pid), time.perf_counter() - t0)["me"]
    assert d["cpu_s"] >= 0.1   # 0.2 s of spinning on this thread (less if it waited for a core)
    assert d["cpu_s"] + d["runqueue_wait_s"] >= 0.15


def test_sample_of_no_such_process_is_empty():
    assert schedstat.sample({"gone": 2**22 + 12345}) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/schedstat"),
                    reason="Linux schedstat only")
def test_a_tree_sample_counts_a_child_process_busy_for_the_phase():
    import subprocess
    me = {"me": os.getpid()}
    s0, t0 = schedstat.sample(me, tree=True), time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt = time.perf_counter() + 0.3\nwhile time.perf_counter() < t: pass\n"
                              "time.sleep(5)"])
    try:
        time.sleep(0.6)   # it has spun 0.3 s and sleeps: still alive to be sampled
        d = schedstat.delta(s0, schedstat.sample(me, tree=True), time.perf_counter() - t0, top=10)["me"]
        flat = schedstat.delta(schedstat.sample(me), schedstat.sample(me), 1.0)["me"]
    finally:
        child.kill()
        child.wait()
    names = [t[0] for t in d["threads"]]
    assert any(n.startswith("python") and n.endswith("(main)") for n in names), names
    assert d["cpu_s"] >= 0.15   # the child's spin counted (the parent mostly slept)
    assert all(t[0] == "main" or not t[0].endswith("(main)") for t in flat["threads"])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/schedstat"),
                    reason="Linux schedstat only")
def test_measured_puts_the_block_delta_under_its_phase():
    into: dict = {}
    with schedstat.measured({"me": os.getpid()}, into, "spin"):
        stop = time.perf_counter() + 0.2
        while time.perf_counter() < stop:
            pass
    assert set(into) == {"spin"} and into["spin"]["me"]["cpu_s"] >= 0.1

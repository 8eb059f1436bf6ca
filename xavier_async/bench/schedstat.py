"""Where the processes of a bench run spent a phase: on a core, or waiting for one.

Linux keeps, per thread, the nanoseconds it ran and the nanoseconds it sat runnable on a
run queue waiting for a core (``/proc/PID/task/TID/schedstat``). Summed over a process's
threads across one phase, the second figure says how much of a small load's latency a
crowded host adds before any of our code runs: on 2 cores, three busy processes cannot
all run at once. :func:`sample` reads them; :func:`delta` turns two samples into
per-process figures; :func:`measured` does both around a block. Where ``/proc`` has no schedstat (not Linux, or schedstats off),
:func:`sample` returns an empty dict and the bench reports nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from time import perf_counter
from typing import Any

#: a sample: process name -> thread name -> (ns on a core, ns waiting on a run queue)
Sample = dict[str, dict[str, tuple[int, int]]]


def _threads(pid: int, out: dict[str, tuple[int, int]], main: str) -> None:
    """Add ``pid``'s threads to ``out``: its first thread as ``main``, the others by
    their OS name (Python threads inherit the first thread's: those add up under it)."""
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                ran, waited, _ = (int(x) for x in f.read().split())
            if int(tid) == pid:
                name = main
            else:
                with open(f"{base}/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError):  # the thread ended meanwhile, or no schedstat
            continue
        r, w = out.get(name, (0, 0))   # threads of one name (a pool) add up
        out[name] = (r + ran, w + waited)


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (Linux ``/proc/PID/task/*/children``)."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def _tree(pid: int, out: dict[str, tuple[int, int]]) -> None:
    """Add the threads of ``pid`` and of every process under it: each process's first
    thread by the process's name (``comm``), the others by their own."""
    with open(f"/proc/{pid}/comm") as f:
        name = f.read().strip()
    _threads(pid, out, f"{name} (main)")
    for child in _children(pid):
        try:
            _tree(child, out)
        except OSError:   # it ended meanwhile
            continue


def sample(pids: dict[str, int], tree: bool = False) -> Sample:
    """Each process's threads' run and run-queue wait nanoseconds, by thread name
    (``main``: the process's first thread); with ``tree``, every process under it too
    (a vLLM replica's engine-core process), each first thread named ``NAME (main)``.
    Empty where the host does not keep them."""
    out: Sample = {}
    try:
        for name, pid in pids.items():
            out[name] = {}
            if tree:
                _tree(pid, out[name])
            else:
                _threads(pid, out[name], "main")
    except OSError:
        return {}
    return out


def delta(before: Sample, after: Sample, wall_s: float, top: int = 3) -> dict[str, Any]:
    """Per process, over the phase between two samples: ``cpu_s`` (on a core, all its
    threads), ``runqueue_wait_s`` (runnable but waiting for a core), both also as a
    fraction of the phase's wall time, and its ``top`` threads by cpu time
    (``[name, cpu_s, runqueue_wait_s]``)."""
    out: dict[str, Any] = {}
    for proc, threads in after.items():
        old = before.get(proc, {})
        rows = []
        for name, (ran, waited) in threads.items():
            r0, w0 = old.get(name, (0, 0))
            rows.append((name, max(ran - r0, 0) / 1e9, max(waited - w0, 0) / 1e9))
        cpu = sum(r for _, r, _ in rows)
        wait = sum(w for _, _, w in rows)
        rows.sort(key=lambda x: x[1], reverse=True)
        out[proc] = {"cpu_s": cpu, "runqueue_wait_s": wait,
                     "cpu_of_wall": cpu / wall_s if wall_s else 0.0,
                     "runqueue_wait_of_wall": wait / wall_s if wall_s else 0.0,
                     "threads": [[n, round(r, 4), round(w, 4)] for n, r, w in rows[:top]]}
    return out


@contextmanager
def measured(pids: dict[str, int], into: dict[str, Any], phase: str, *, tree: bool = False,
             top: int = 3) -> Iterator[None]:
    """Sample ``pids`` around the block and put its :func:`delta` in ``into[phase]``
    (nothing where the host keeps no schedstat, or when the block raises)."""
    before, t0 = sample(pids, tree), perf_counter()
    yield
    if before:
        into[phase] = delta(before, sample(pids, tree), perf_counter() - t0, top)


__all__ = ["Sample", "delta", "measured", "sample"]

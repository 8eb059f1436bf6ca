"""Where the processes of a bench run spent a phase: on a core, or waiting for one.

Linux keeps, per thread, the nanoseconds it ran and the nanoseconds it sat runnable on a
run queue waiting for a core (``/proc/PID/task/TID/schedstat``). Summed over a process's
threads across one phase, the second figure says how much of a small load's latency a
crowded host adds before any of our code runs: on 2 cores, three busy processes cannot
all run at once. :func:`sample` reads them; :func:`delta` turns two samples into
per-process figures. Where ``/proc`` has no schedstat (not Linux, or schedstats off),
:func:`sample` returns an empty dict and the bench reports nothing.
"""

from __future__ import annotations

import os
from typing import Any

#: a sample: process name -> thread name -> (ns on a core, ns waiting on a run queue)
Sample = dict[str, dict[str, tuple[int, int]]]


def _threads(pid: int) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                ran, waited, _ = (int(x) for x in f.read().split())
            if int(tid) == pid:
                name = "main"   # (other threads inherit its name unless they set one)
            else:
                with open(f"{base}/{tid}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError):  # the thread ended meanwhile, or no schedstat
            continue
        r, w = out.get(name, (0, 0))   # threads of one name (a pool) add up
        out[name] = (r + ran, w + waited)
    return out


def sample(pids: dict[str, int]) -> Sample:
    """Each process's threads' run and run-queue wait nanoseconds, by thread name
    (``main``: the process's first thread; others by their OS name, which Python threads
    inherit from the first one: those add up under it) (empty where the host does not
    keep them)."""
    try:
        return {name: _threads(pid) for name, pid in pids.items()}
    except OSError:
        return {}


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


__all__ = ["Sample", "delta", "sample"]

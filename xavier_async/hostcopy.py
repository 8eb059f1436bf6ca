"""Many host copies in one system call, with the GIL released once.

A run table of host memory is executed as a loop of ``memmove`` calls (``ctypes``), and
each call releases and takes back the GIL. On the event loop's thread that costs ~0.3 us
a run. On a copy thread it costs a GIL hand-off a run whenever the loop thread wants the
GIL meanwhile: on the 2-core machine a scattered 12 MiB table (1,536 runs of 8 KiB) took
932 ms on one copy thread while another thread ran Python without pause, against 2.9 ms
beside an idle one (``scripts/copy_thread_gil.py``), and the serving bench's large unpacks
on copy threads took 2.5 ms at p50 (11 ms mean) on a 16-core host against 1.25 ms on the
loop (``docs/benchmarks.md``).

:func:`copy_runs` hands a whole table to the kernel instead: ``process_vm_readv`` on our
own process copies up to ``IOV_MAX`` (1,024) runs per call, gathering from the sources
and scattering to the destinations, with the GIL released for the whole call. A process
may always read itself this way (no ptrace permission is involved for its own thread
group), but a seccomp filter can forbid the call: then, and after any short copy, the
table (or the rest of it) goes through ``memmove`` as before, and a refused call is not
tried again in this process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from array import array

#: runs per ``process_vm_readv`` call (Linux's ``IOV_MAX``)
IOV_MAX = 1024
#: a table with fewer runs than this is copied with ``memmove`` (a few GIL hand-offs cost
#: little)
MIN_RUNS = 16
#: nor one whose runs are this large on average: the kernel pins the pages it copies, so
#: on the 2-core machine 24 runs of 512 KiB took 5.8 ms that way against 1.2 ms as memmoves
MAX_MEAN_RUN = 64 * 1024

_memmove = ctypes.memmove


def _load() -> object | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()
#: whether :func:`copy_runs` uses the system call (False: ``memmove`` only; set when the
#: call is refused, and by tests to force the fallback)
ENABLED = _readv is not None
#: tables copied by the system call, and batches it refused or cut short (then copied
#: with ``memmove``)
stats = {"syscall_tables": 0, "fallbacks": 0}


_here = threading.local()


def mark_copy_thread() -> None:
    """Make :func:`copy_runs` batch on the calling thread (a copy thread's initializer).
    Elsewhere (the event loop's thread, where no GIL hand-off is paid) it uses
    ``memmove``: on the 2-core machine that was ~10% faster for 1,536 runs of 8 KiB."""
    _here.batch = True


def _memmove_runs(dst: list[int], src: list[int], ns: list[int]) -> None:
    mm = _memmove
    for d, s, n in zip(dst, src, ns):
        mm(d, s, n)


def copy_runs(dst: list[int], src: list[int], ns: list[int]) -> None:
    """``dst[i] <- src[i]`` for ``ns[i]`` bytes, every ``i``: host addresses of this
    process, no two runs overlapping. On a copy thread (:func:`mark_copy_thread`), many
    small runs go to the kernel in batches of :data:`IOV_MAX`; otherwise, and after a
    refused call, ``memmove`` a run."""
    global ENABLED
    count = len(ns)
    if (count < MIN_RUNS or not ENABLED or not getattr(_here, "batch", False)
            or sum(ns) > count * MAX_MEAN_RUN):
        _memmove_runs(dst, src, ns)
        return
    pid = os.getpid()
    for start in range(0, count, IOV_MAX):
        end = min(count, start + IOV_MAX)
        k = end - start
        local, remote = array("Q", bytes(16 * k)), array("Q", bytes(16 * k))
        local[0::2], local[1::2] = array("Q", dst[start:end]), array("Q", ns[start:end])
        remote[0::2], remote[1::2] = array("Q", src[start:end]), local[1::2]
        want = sum(ns[start:end])
        got = _readv(pid, local.buffer_info()[0], k,  # type: ignore[operator]
                     remote.buffer_info()[0], k, 0)
        if got == want:
            continue
        err = ctypes.get_errno() if got < 0 else 0
        if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
            ENABLED = False            # forbidden here (seccomp): never tried again
        # a refused or short copy: this batch and the rest through memmove (copying a run
        # twice is harmless: its source has not changed)
        stats["fallbacks"] += 1
        _memmove_runs(dst[start:], src[start:], ns[start:])
        return
    stats["syscall_tables"] += 1


def split_runs(dst: list[int], src: list[int], ns: list[int],
               parts: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Cut a run table into at most ``parts`` tables of about equal bytes, in order (a run
    that a cut falls inside is cut there too), for as many threads to copy at once: every
    destination byte is written from the same source byte as by the whole table. Empty
    parts are left out; ``parts`` <= 1 returns the table whole."""
    total = sum(ns)
    if parts <= 1 or total == 0:
        return [(dst, src, ns)]
    out: list[tuple[list[int], list[int], list[int]]] = []
    d: list[int] = []
    s: list[int] = []
    n: list[int] = []
    done = 0                             # bytes placed in finished parts and in d, s, n
    index = 1
    cut = -(-total // parts)             # where part ``index`` ends (ceiling)
    for a, b, k in zip(dst, src, ns):
        while k and done + k >= cut:     # this run reaches the cut: its head ends the part
            head = cut - done
            if head:
                d.append(a)
                s.append(b)
                n.append(head)
                a, b, k = a + head, b + head, k - head
            if n:
                out.append((d, s, n))
                d, s, n = [], [], []
            done = cut
            if done == total:
                break
            index += 1                   # the next cut past this one (fewer bytes than
            cut = -(-index * total // parts)  # parts: some cuts fall together)
            while cut <= done:
                index += 1
                cut = -(-index * total // parts)
        if k:
            d.append(a)
            s.append(b)
            n.append(k)
            done += k
    if n:
        out.append((d, s, n))
    return out


__all__ = ["IOV_MAX", "MAX_MEAN_RUN", "MIN_RUNS", "copy_runs", "mark_copy_thread", "split_runs"]

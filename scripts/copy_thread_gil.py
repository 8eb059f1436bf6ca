"""A copy thread's run table against the GIL (issue 34): 1,536 runs of 8 KiB (12 MiB) copied
on one or two threads while the main thread idles, polls (a GIL-free call, then a little
Python, as the poller does) or runs Python without pause (an engine thread beside the
endpoint), with ``memmove`` a run (a GIL hand-off a run) and with
:func:`xavier_async.hostcopy.copy_runs` on a marked copy thread (one ``process_vm_readv``
per 1,024 runs). Prints each copy's median and the main thread's iteration p99; the first
and last runs' bytes are checked.

Usage: python scripts/copy_thread_gil.py   (numpy)"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
from xavier_async.hostcopy import copy_runs, mark_copy_thread
N, B = 1536, 8192
bufs = []
def mk():
    src = (np.arange(N * B * 2) % 251).astype(np.uint8); dst = np.zeros(N * B * 2, np.uint8); bufs.append((src, dst))
    return ([dst.ctypes.data + 2 * i * B for i in range(N)], [src.ctypes.data + 2 * i * B for i in range(N)], [B] * N)
tables = [mk(), mk()]
def timed(batched, busy, threads):
    out = []; lat = []
    def worker(t):
        if batched: mark_copy_thread()
        for _ in range(15):
            a = time.perf_counter(); copy_runs(*t); out.append(time.perf_counter() - a)
    ths = [threading.Thread(target=worker, args=(tables[i],)) for i in range(threads)]
    [t.start() for t in ths]
    x = 0
    while any(t.is_alive() for t in ths):
        a = time.perf_counter()
        if busy == "poller":
            time.sleep(0)
            for _ in range(200): x += 1
        elif busy == "python":
            for _ in range(20000): x += 1
        else:
            time.sleep(0.0005)
        lat.append(time.perf_counter() - a)
    [t.join() for t in ths]
    lat.sort()
    for s, d in bufs[:threads]:
        assert np.array_equal(d[:B], s[:B]) and np.array_equal(d[-2*B:-B], s[-2*B:-B])
    return statistics.median(out) * 1e3, lat[int(len(lat) * .99)] * 1e3
print("1,536 runs of 8 KiB (12 MiB) on copy threads while the main thread idles / polls / runs Python")
for busy in ("idle", "poller", "python"):
    for th in (1, 2):
        r = {b: timed(b, busy, th) for b in (False, True)}
        print(f"main {busy:6} threads {th}: memmove a run {r[False][0]:7.2f} ms "
              f"(main p99 {r[False][1]:5.2f} ms) | one call per 1,024 runs {r[True][0]:7.2f} ms "
              f"(main p99 {r[True][1]:5.2f} ms)", flush=True)

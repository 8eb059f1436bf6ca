"""One large host run table copied by 1, 2, 4 or 8 copy threads at once (issue 34, point 1).

A 12 MiB load of 1,536 scattered 8 KiB runs (the serving bench's large unpack) is cut into
K chunks of about equal bytes, and K marked copy threads (:func:`xavier_async.hostcopy.mark_copy_thread`)
copy one chunk each while the main thread waits, as the endpoint's loop does. Prints the
median time and GB/s per K and the ratio to K=1 of the same run; the destination is
zeroed and checked against the source after every K.

Usage: python scripts/split_copy.py [runs [run bytes [repeats]]]   (numpy)"""

from __future__ import annotations

import concurrent.futures
import statistics
import sys
import time

import numpy as np

from xavier_async.hostcopy import copy_runs, mark_copy_thread


def main(runs: int = 1536, run: int = 8192, repeats: int = 40) -> None:
    src = (np.arange(runs * run * 2, dtype=np.int64) % 251).astype(np.uint8)
    dst = np.zeros_like(src)
    # every other slot, as an engine's scattered blocks are
    table = ([dst.ctypes.data + 2 * i * run for i in range(runs)],
             [src.ctypes.data + 2 * i * run for i in range(runs)], [run] * runs)
    base = None
    print(f"{runs} runs of {run} B ({runs * run / 2**20:.1f} MiB), median of {repeats}")
    for k in (1, 2, 4, 8):
        cut = [round(i * runs / k) for i in range(k + 1)]
        chunks = [tuple(col[cut[i]:cut[i + 1]] for col in table) for i in range(k)]
        pool = concurrent.futures.ThreadPoolExecutor(k, initializer=mark_copy_thread)
        list(pool.map(lambda c: copy_runs(*c), chunks))  # warm: threads started, pages touched
        dst[:] = 0
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for f in [pool.submit(copy_runs, *c) for c in chunks]:
                f.result()
            times.append(time.perf_counter() - t)
        pool.shutdown()
        view_d, view_s = dst.reshape(runs, 2, run)[:, 0], src.reshape(runs, 2, run)[:, 0]
        assert np.array_equal(view_d, view_s), f"K={k}: wrong bytes"
        med = statistics.median(times)
        base = base or med
        print(f"K={k}: {med * 1e3:6.2f} ms  {runs * run / med / 1e9:5.2f} GB/s  x{base / med:4.2f} of K=1")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))

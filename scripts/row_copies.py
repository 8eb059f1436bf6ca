"""Host run tables as torch row copies against memmove and process_vm_readv (issue 34):
measured, not adopted (docs/benchmarks.md, "Torch row copies for host run tables").

Three shapes of a source's gather (cache slots into a slab) and a loader's scatter (the
slab into cache slots), as :func:`xavier_async.hostcopy.copy_runs` gets them:

* 1,536 scattered runs of 8 KiB (12 MiB, one layer of 8 KiB blocks);
* 4 layers x 1,536 scattered runs of 2 KiB (12 MiB);
* 192 scattered runs of 64 KiB (12 MiB: the largest mean run that takes row copies;
  larger runs stay memmoves, as the serving bench's large stream's 24 runs of 512 KiB do).

Each is copied with ``memmove`` a run, with ``process_vm_readv`` (batched, as on a copy
thread: :func:`xavier_async.hostcopy.copy_runs`) and with torch's row copies (each layer's
rows viewed as int64, one ``index_select`` into the slab or one ``index_copy_`` out of it
a layer: torch copies uint8 rows element by element), first on an idle machine from the main thread, then
on a copy thread while the main thread runs Python without pause (an engine thread
beside the endpoint). Medians of 7 copies; every copy's bytes are checked.

Usage: python scripts/row_copies.py"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable

import torch

from xavier_async import hostcopy

SHAPES = {"1,536 x 8 KiB": (1, 8192, 1536), "4 x 1,536 x 2 KiB": (4, 2048, 1536),
          "192 x 64 KiB": (1, 64 * 1024, 192)}


def tables(layers: int, row: int, count: int):
    """Caches, a slab, the slots gathered and the bytes the slab must then hold."""
    rows = max(4 * count, 8)
    caches = [torch.randint(0, 255, (rows, row), dtype=torch.uint8) for _ in range(layers)]
    slab = torch.zeros(layers * count * row, dtype=torch.uint8)
    slots = random.Random(1).sample(range(rows), count)
    want = torch.cat([c[slots].reshape(-1) for c in caches])
    return caches, slab, slots, want


def tables_of(caches: list[torch.Tensor], slab: torch.Tensor, slots: list[int], row: int):
    """The gather's run table (the scatter's is the same reversed)."""
    dst, src, ns = [], [], []
    for i, cache in enumerate(caches):
        for r, slot in enumerate(slots):
            dst.append(slab.data_ptr() + (i * len(slots) + r) * row)
            src.append(cache.data_ptr() + slot * row)
            ns.append(row)
    return dst, src, ns


def way(name: str, caches: list[torch.Tensor], slab: torch.Tensor, slots: list[int]
        ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The gather and the scatter of one way of copying."""
    layers, row = len(caches), caches[0].shape[1]
    count = len(slots)
    if name == "rows":
        idx = torch.tensor(slots, dtype=torch.long)
        c64 = [c.view(torch.int64) for c in caches]
        parts = [slab.view(torch.int64).view(layers * count, -1)[i * count:(i + 1) * count]
                 for i in range(layers)]

        def gather() -> None:
            for c, part in zip(c64, parts):
                torch.index_select(c, 0, idx, out=part)

        def scatter() -> None:
            for c, part in zip(c64, parts):
                c.index_copy_(0, idx, part)
        return gather, scatter
    dst, src, ns = tables_of(caches, slab, slots, row)
    if name == "memmove":
        return (lambda: hostcopy._memmove_runs(dst, src, ns),
                lambda: hostcopy._memmove_runs(src, dst, ns))

    def batched(d: list[int], s: list[int]) -> None:
        hostcopy.mark_copy_thread()
        hostcopy.copy_runs(d, s, ns)   # tables below its limits fall back to memmove
    return (lambda: batched(dst, src)), (lambda: batched(src, dst))


def measure(shape: str, name: str, busy: bool) -> tuple[float, float]:
    caches, slab, slots, want = tables(*SHAPES[shape])
    gather, scatter = way(name, caches, slab, slots)
    times: dict[str, list[float]] = {"gather": [], "scatter": []}

    def work() -> None:
        for _ in range(7):
            slab.zero_()
            a = time.perf_counter()
            gather()
            times["gather"].append(time.perf_counter() - a)
            assert torch.equal(slab, want)
            for c in caches:
                c.zero_()
            a = time.perf_counter()
            scatter()
            times["scatter"].append(time.perf_counter() - a)
            assert torch.equal(torch.cat([c[slots].reshape(-1) for c in caches]), want)

    if not busy:
        work()
    else:
        t = threading.Thread(target=work)
        t.start()
        x = 0
        while t.is_alive():
            for _ in range(20000):
                x += 1
        t.join()
    return (statistics.median(times["gather"]) * 1e3, statistics.median(times["scatter"]) * 1e3)


def main() -> None:
    torch.set_num_threads(1)
    print("median ms, gather / scatter (bytes checked)")
    for busy in (False, True):
        print("copy thread beside a Python-busy main thread" if busy else "main thread, idle machine")
        for shape in SHAPES:
            cells = [f"{name} {g:7.2f} / {s:7.2f}" for name in ("memmove", "readv", "rows")
                     for g, s in [measure(shape, name, busy)]]
            print(f"  {shape:18} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()

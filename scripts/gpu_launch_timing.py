"""Where the host time of one fused unpack goes on a GPU machine, and what launching it
cheaper buys: the breakdown of DeviceRuns.run (table, staging, H2D, Triton launch, event,
wait) for one block hash x 24 layers, against variants (table read in place from pinned
host memory, the compiled kernel launched directly, reused events), plus the speed of the
host's Python (the planner, a pure loop) to compare with another machine.
Usage: python scripts/gpu_launch_timing.py   (needs CUDA and Triton; cupy optional)"""
import os
import statistics
import time

import numpy as np
import torch

from xavier_async import _triton_runs, packing
from xavier_async.layout import CacheLayout
from xavier_async.planning import Planner
from xavier_async.testing.peer_process import LayoutSpec, pattern_caches


def med(f, n=300):
    for _ in range(30):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns()
        f()
        ts.append(time.perf_counter_ns() - t)
    return statistics.median(ts) / 1e3


def host_facts():
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        if os.path.exists(path):
            print(path, open(path).read().strip())
    print("nproc", os.cpu_count(), "affinity", len(os.sched_getaffinity(0)))
    try:
        model = [l for l in open("/proc/cpuinfo") if l.startswith("model name")][0].strip()
        print(model)
    except Exception:
        pass
    print(f"pure python loop (sum of squares, 1000): {med(lambda: sum(i * i for i in range(1000))):.1f} us")
    t = torch.empty(8)
    print(f"torch cpu op (t.add_(1)): {med(lambda: t.add_(1)):.2f} us")


def main():
    host_facts()
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda:0")
    spec = LayoutSpec(layers=24, num_slots=512, block_shape=(2, 16, 2, 64), dtype="bfloat16")
    caches = pattern_caches(spec, 0, 1, dev)
    dst = {k: torch.zeros_like(v) for k, v in caches.items()}
    layout = CacheLayout.of(caches)
    planner = Planner(layout, 12 << 20)
    send = torch.zeros(12 << 20, dtype=torch.uint8, device=dev)
    slab = packing.SlabRows(send, [spec.block_nbytes])
    src_t = packing.CacheTable(packing.byte_rows(caches))
    dst_t = packing.CacheTable(packing.byte_rows(dst))
    runs = packing.DeviceRuns(dev)
    req = {1: {layer: {0: 7} for layer in caches}}
    print(f"planner.plan one hash x 24: {med(lambda: planner.plan(req)):.1f} us")
    (b,) = planner.plan(req)
    srcs = [list(s.keys) for s in b.segments]
    packing.pack(slab, b.segments, srcs, src_t, runs).synchronize()

    def check():
        torch.cuda.synchronize()
        ok = all(torch.equal(dst[l][7].view(torch.int16), caches[l][0].view(torch.int16)) for l in caches)
        for v in dst.values():
            v.zero_()
        return ok

    # the shipped path
    full = med(lambda: packing.unpack(slab, b, dst_t, runs, wait=True))
    print(f"shipped unpack (wait=True): {full:.1f} us  bytes ok {check()}")
    full = med(lambda: packing.unpack(slab, b, dst_t, runs, wait=False))
    print(f"shipped unpack (wait=False, enqueue only): {full:.1f} us  bytes ok {check()}")
    pk = med(lambda: packing.pack(slab, b.segments, srcs, src_t, runs).synchronize())
    print(f"shipped pack + event wait: {pk:.1f} us")
    packing.unpack(slab, b, dst_t, runs, wait=True)
    print("  bytes ok", check())

    # its pieces
    table = packing.unpack_table(slab.ptr, b, dst_t)
    print(f"  unpack_table: {med(lambda: packing.unpack_table(slab.ptr, b, dst_t)):.1f} us")
    rows = [(s, d, n) for d, s, n in zip(*table)]
    print(f"  rows list: {med(lambda: [(s, d, n) for d, s, n in zip(*table)]):.1f} us")
    print(f"  torch.tensor(rows): {med(lambda: torch.tensor(rows, dtype=torch.int64)):.1f} us")
    host = torch.empty((256, 3), dtype=torch.int64, pin_memory=True)
    devbuf = torch.empty((256, 3), dtype=torch.int64, device=dev)
    tt = torch.tensor(rows, dtype=torch.int64)
    print(f"  host[:n] = t: {med(lambda: host[: len(rows)].copy_(tt)):.1f} us")
    stream = torch.cuda.current_stream(dev)
    print(f"  current_stream: {med(lambda: torch.cuda.current_stream(dev)):.1f} us")

    def ctx():
        with torch.cuda.stream(stream):
            pass
    print(f"  with torch.cuda.stream: {med(ctx):.1f} us")
    print(f"  H2D copy_ non_blocking: {med(lambda: devbuf[: len(rows)].copy_(host[: len(rows)], non_blocking=True)):.1f} us")
    print(f"  triton launch (JIT dispatch): {med(lambda: _triton_runs._copy_rows[(len(rows),)](devbuf, CHUNK=65536, BLOCK=1024, WIDE=True)):.1f} us")

    def ev():
        e = torch.cuda.Event()
        e.record(stream)
        return e
    print(f"  Event() + record: {med(ev):.1f} us")
    e = ev()
    print(f"  event.synchronize (done): {med(e.synchronize):.1f} us")
    print(f"  event.query (done): {med(e.query):.1f} us")

    def launch_sync():
        _triton_runs._copy_rows[(len(rows),)](devbuf, CHUNK=65536, BLOCK=1024, WIDE=True)
        ev().synchronize()
    print(f"  launch + event + synchronize: {med(launch_sync):.1f} us")

    # variant: pinned host table read in place, numpy fill, compiled kernel launched
    # directly, events reused
    pinned = torch.empty((256, 3), dtype=torch.int64, pin_memory=True)
    pn = pinned.numpy()
    arr = np.asarray(rows, dtype=np.int64)
    print(f"  np.asarray(rows): {med(lambda: np.asarray(rows, dtype=np.int64)):.1f} us")
    pn[: len(rows)] = arr
    try:
        k = _triton_runs._copy_rows[(len(rows),)](pinned, CHUNK=65536, BLOCK=1024, WIDE=True)
        torch.cuda.synchronize()
        print("  kernel reading a pinned host table: bytes ok", check())
    except Exception as exc:
        print("  kernel reading a pinned host table: FAILED", repr(exc)[:300])
        k = None
    if k is not None:
        sh = stream.cuda_stream
        events = [torch.cuda.Event() for _ in range(4)]
        st = {"i": 0}

        def direct_launch():
            k.run(len(rows), 1, 1, sh, k.function, k.packed_metadata, None, None, None,
                  pinned, 65536, 1024, True)
        try:
            direct_launch()
            torch.cuda.synchronize()
            print("  direct launch bytes ok", check())
            print(f"  direct launch: {med(direct_launch):.1f} us")

            def fast_unpack(spin: bool = False) -> None:
                tb = packing.unpack_table(slab.ptr, b, dst_t)
                n = len(tb[0])
                pn[:n, 0] = tb[1]
                pn[:n, 1] = tb[0]
                pn[:n, 2] = tb[2]
                k.run(n, 1, 1, sh, k.function, k.packed_metadata, None, None, None,
                      pinned, 65536, 1024, True)
                e = events[st["i"] % 4]
                st["i"] += 1
                e.record(stream)
                if spin:
                    while not e.query():
                        pass
                else:
                    e.synchronize()
            fast_unpack()
            print("  fast unpack bytes ok", check())
            print(f"fast unpack (table + numpy fill + direct launch + event + sync): {med(fast_unpack):.1f} us")
            print(f"fast unpack, spin on query: {med(lambda: fast_unpack(True)):.1f} us")
        except Exception as exc:
            print("  direct launch FAILED", repr(exc)[:300])
    try:
        import cupy
        code = r'''extern "C" __global__ void copy_rows(const long long* t) {
            const long long* r = t + 3 * blockIdx.x;
            const int4* s = (const int4*)r[0]; int4* d = (int4*)r[1]; long long n = r[2] / 16;
            for (long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i]; }'''
        kern = cupy.RawKernel(code, "copy_rows")
        ptr = pinned.data_ptr()
        cs = cupy.cuda.ExternalStream(stream.cuda_stream)

        def cupy_launch():
            with cs:
                kern((len(rows),), (256,), (ptr,))
        cupy_launch()
        torch.cuda.synchronize()
        print("  cupy RawKernel bytes ok", check())
        print(f"  cupy RawKernel launch: {med(cupy_launch):.1f} us")
    except Exception as exc:
        print("  cupy FAILED", repr(exc)[:300])
    try:
        from cuda.bindings import driver as cu

        def memcpy_each():
            for s, d, n in rows:
                cu.cuMemcpyAsync(d, s, n, stream.cuda_stream)
        memcpy_each()
        torch.cuda.synchronize()
        print("  cuMemcpyAsync x24 bytes ok", check())
        print(f"  cuMemcpyAsync x{len(rows)}: {med(memcpy_each):.1f} us")
    except Exception as exc:
        print("  cuda.bindings FAILED", repr(exc)[:300])


if __name__ == "__main__":
    main()

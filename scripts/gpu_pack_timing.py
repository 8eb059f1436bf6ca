"""Pack/unpack on one GPU, the tensor path (per-run slices + one foreach copy + a stream
synchronize) against the fused path (one Triton launch over a run table + its event), on
the bench's layout (24 layers of 8 KiB blocks). Prints medians in microseconds.
Usage: python scripts/gpu_pack_timing.py   (needs CUDA and Triton)"""
import statistics
import time

import torch

from xavier_async import packing
from xavier_async.layout import CacheLayout
from xavier_async.planning import Planner
from xavier_async.testing.peer_process import LayoutSpec, pattern_caches

dev = torch.device("cuda:0")
spec = LayoutSpec(layers=24, num_slots=512, block_shape=(2, 16, 2, 64), dtype="bfloat16")
caches = pattern_caches(spec, 0, 1, dev)
dst = {k: torch.zeros_like(v) for k, v in caches.items()}
layout = CacheLayout.of(caches)
planner = Planner(layout, 12 << 20)
send = torch.zeros(12 << 20, dtype=torch.uint8, device=dev)
sizes = [spec.block_nbytes]
slab = packing.SlabRows(send, sizes)
src_t, dst_t = packing.CacheTable(packing.byte_rows(caches)), packing.CacheTable(packing.byte_rows(dst))
runs = packing.DeviceRuns(dev)
cases = {"1 hash x 24": {0: 7},
         "64 hashes x 24 contiguous": {k: 100 + k for k in range(64)},
         "64 hashes x 24 scattered": {k: (k * 37) % 500 for k in range(64)}}


def med(f, n=200):
    for _ in range(20):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


for name, blocks in cases.items():
    (b,) = planner.plan({1: {layer: blocks for layer in caches}})
    srcs = [[k for k in s.keys] for s in b.segments]
    tensor_pack = med(lambda: packing.gather(slab, b.segments, srcs, src_t.rows))
    fused_pack = med(lambda: packing.pack(slab, b.segments, srcs, src_t, runs).synchronize())
    tensor_unpack = med(lambda: packing.scatter(slab, b.segments, dst_t.rows, wait=True))
    fused_unpack = med(lambda: packing.unpack(slab, b, dst_t, runs, wait=True))
    ok = all(torch.equal(dst[l][list(blocks.values())[0]].view(torch.int16), caches[l][list(blocks)[0]].view(torch.int16)) for l in caches)
    print(f"{name:28} pack tensor {tensor_pack:7.1f} fused {fused_pack:7.1f} | unpack tensor {tensor_unpack:7.1f} fused {fused_unpack:7.1f} us | bytes ok {ok}")

"""What planning a load costs on this host: the serving trace's small loads (one block hash x
a random 2-16 of 24 layers, nearly all new subsets of layers for the planner's shape cache)
and one 12 MiB load (64 hashes x 24 layers), at the bench's default layout, on the CPU.
Prints the median over five runs of the microseconds per plan.
Usage: python scripts/plan_timing.py"""
import random
import statistics
import time

import torch

from xavier_async.bench.suite import BenchOptions, bench_layout
from xavier_async.layout import CacheLayout
from xavier_async.planning import Planner


def per_call_us(f, n: int) -> float:
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(n):
            f(i)
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    o = BenchOptions()
    spec = bench_layout(o.full_bytes)
    caches = {layer: torch.zeros((spec.num_slots, spec.block_nbytes), dtype=torch.uint8)
              for layer in range(spec.layers)}
    planner = Planner(CacheLayout.of(caches), o.full_bytes)
    rng = random.Random(0)
    small = []
    for _ in range(600):
        layers = sorted(rng.sample(range(spec.layers), rng.randint(2, 16)))
        key, slot = rng.randrange(1 << 60), rng.randrange(spec.num_slots)
        small.append({1: {layer: {key: slot} for layer in layers}})
    large = {1: {layer: {k: k for k in range(spec.num_slots // 2)} for layer in range(spec.layers)}}
    print(f"small load (1 hash x 2-16 layers): {per_call_us(lambda i: planner.plan(small[i % 600]), 20000):.2f} us"
          f" per plan ({planner.misses} shape-cache misses, {planner.hits} hits)")
    print(f"12 MiB load (64 hashes x 24 layers): {per_call_us(lambda i: planner.plan(large), 2000):.2f} us per plan")


if __name__ == "__main__":
    main()

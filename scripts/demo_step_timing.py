"""What one engine step of the demo costs on this device: the Qwen2.5-0.5B shape in BF16
(or the small float32 model on the CPU), three step shapes the demo's engine runs, each
timed to the device's completion (median of 10 after 3 warm-ups), then the busiest
operators of the mixed step under the torch profiler.

Usage: python scripts/demo_step_timing.py [cuda|cpu]"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from xavier_async.demo.model import BLOCK, QWEN25_05B, SMALL, PagedModel, StepItem


def main(device: str) -> None:
    shape = QWEN25_05B if device == "cuda" else SMALL
    dev = torch.device(device)
    slots = 4096
    if dev.type == "cuda":
        from xavier_async.demo.replica import deterministic_cuda
        deterministic_cuda()  # as the replicas set the device up
    model = PagedModel(shape, 0, dev, slots)
    per_req = 160  # blocks a request may reach (2,560 positions)

    def req_slots(r: int) -> list[int]:
        return list(range(r * per_req, (r + 1) * per_req))

    decode = [StepItem(req_slots(r), 1040 + r, [7], True) for r in range(16)]
    prefill = [StepItem(req_slots(16), 0, [i % 1000 + 1 for i in range(2048)], True)]
    mixed = decode[:15] + [StepItem(req_slots(17), 1024, [i % 1000 + 1 for i in range(1024)], True)]
    shapes = {"16 decode rows": decode, "one 2048-token prefill chunk": prefill,
              "15 decode + a 1024-token chunk at 1024": mixed}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    print(f"device {device}, model {shape.layers} layers, {shape.dtype}, block {BLOCK} tokens")
    for name, items in shapes.items():
        for _ in range(3):
            model.step(items)
        sync()
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            model.step(items)
            sync()
            ts.append(time.perf_counter() - t)
        rows = sum(len(it.ids) for it in items)
        print(f"{name:42s} rows {rows:5d}  step {statistics.median(ts) * 1e3:8.2f} ms "
              f"(min {min(ts) * 1e3:.2f})")
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            model.step(mixed)
        sync()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")

"""One-hash loads one at a time, as fast as they go: the mean time of a load through
``Endpoint.load_blocks`` (one block hash x 24 layers, 192 KiB) between this process and a
peer process over NIXL on the CPU, with the bytes of the last load checked. No marks, no
profiler: what an import of the package (interpreted or compiled, see
scripts/mypyc_probe.sh) costs end to end.
Usage: python scripts/load_loop.py [LOADS]   (default 20000)"""
import sys
import time

import anyio
import torch

from xavier_async import Endpoint, EndpointConfig
from xavier_async.bench.common import bench_layout
from xavier_async.bench.suite import PEER, _load_request
from xavier_async.testing.peer_process import (PeerProcess, PeerSpec, check_loaded,
                                               pattern_caches, zero_slots)
from xavier_async.transports.nixl import NixlTransport


async def main(n: int) -> None:
    full = 12 << 20
    layout = bench_layout(full)
    cfg = dict(full_bytes=full, small_bytes=256 << 10)
    torch.set_num_threads(1)
    spec = PeerSpec(rank=PEER, layout=layout, seed=1, device="cpu", config=cfg, torch_threads=1)
    peer = await anyio.to_thread.run_sync(PeerProcess, spec)
    try:
        async with Endpoint(0, pattern_caches(layout, 0, 1), NixlTransport(),
                            EndpointConfig(**cfg)) as ep:
            await ep.connect(peer.address)
            dest = layout.num_slots // 2
            for _ in range(300):
                await ep.load_blocks(PEER, [0], [dest])
            req = _load_request(1, layout.layers, layout)
            zero_slots(ep.caches, req)
            t = time.perf_counter()
            for _ in range(n):
                await ep.load_blocks(PEER, [0], [dest])
            per_load = (time.perf_counter() - t) / n * 1e6
            checked = check_loaded(ep.caches, req, {PEER: pattern_caches(layout, PEER, 1)})
            print(f"{per_load:.1f} us a load ({n} loads, {ep.metrics.replies_polled} replies "
                  f"polled, {checked} blocks checked; the receiver from "
                  f"{sys.modules['xavier_async.receiver'].__file__})")
    finally:
        await anyio.to_thread.run_sync(peer.close)


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 20000)

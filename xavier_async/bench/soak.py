"""The soak (``xavier-async bench --soak N``): N loads over real NIXL between processes.

This process is the loader; ranks 1 and 2 are :class:`PeerProcess` children whose
transports inject faults (failed and stalled writes, failed registrations). Loads have
random sizes (1 to 24 keys over 1 to 4 layers: one to several batches), random keys and
random destination slots; every 97th load is cancelled after a random short delay; rank 2
is killed (SIGKILL) and restarted once, half way. Every successful load's bytes are
checked. Host memory (RSS) and open file descriptors of every process, and device memory
on CUDA, are sampled after a warm-up and at the end.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import torch

from ..endpoint import Endpoint, EndpointConfig
from ..errors import PeerLostError, XavierError
from ..testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec, check_loaded, pattern_caches,
                                    zero_slots)

SPEC = LayoutSpec(layers=4, num_slots=64, block_shape=(2, 8, 64), dtype="bfloat16")  # 2 KiB blocks
CFG: dict[str, Any] = dict(full_bytes=64 << 10, small_bytes=8 << 10)
FAULTS = dict(write_failure_rate=0.002, write_stall_rate=0.002, stall_seconds=0.005,
              registration_failure_rate=0.05)
SEED = 3


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _sample(pids: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {name: {"rss_kib": _rss_kib(pid), "fds": _fds(pid)} for name, pid in pids.items()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["loader"]["cuda_allocated"] = torch.cuda.memory_allocated()
    return out


async def soak(loads: int, *, seed: int = 0, report: Callable[[int, int], None] | None = None,
               ) -> dict[str, Any]:
    """Run the soak; returns its figures (raises AssertionError on a wrong byte)."""
    rng = random.Random(seed)
    expected = {r: pattern_caches(SPEC, r, SEED) for r in (1, 2)}
    caches = {layer: t.zero_() for layer, t in pattern_caches(SPEC, 0, SEED).items()}
    outcomes: Counter[str] = Counter()

    def spec(rank: int) -> PeerSpec:
        return PeerSpec(rank=rank, layout=SPEC, seed=SEED, config=CFG, torch_threads=1,
                        faults={**FAULTS, "seed": seed * 10 + rank})

    peers = {1: PeerProcess(spec(1)), 2: PeerProcess(spec(2))}
    restart_at = loads // 2
    warm_at = max(1, loads // 20)
    samples: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        cfg = EndpointConfig(**CFG, request_timeout=10.0)
        async with Endpoint(0, caches, _nixl(), cfg) as ep:
            for p in peers.values():
                await ep.connect(p.address)

            def request() -> dict[int, Any]:
                srcs = rng.choice(([1], [2], [1, 2]))
                slots = rng.sample(range(SPEC.num_slots), rng.randint(len(srcs), 24))
                out: dict[int, dict[int, dict[int, int]]] = {}
                for i, slot in enumerate(slots):
                    src = srcs[i % len(srcs)]
                    for layer in rng.sample(range(SPEC.layers), rng.randint(1, SPEC.layers)):
                        out.setdefault(src, {}).setdefault(layer, {})[rng.randrange(SPEC.num_slots)] = slot
                # a key may appear twice in one layer only with one slot: keep the dicts as built
                return out

            for i in range(loads):
                if i == warm_at:
                    samples["warm"] = _sample({"loader": os.getpid(),
                                               **{f"rank{r}": p.proc.pid for r, p in peers.items()}})
                    samples["warm"]["registrations"] = ep.snapshot_metrics()["memory_registrations"]
                if i == restart_at:
                    peers[2].kill()
                    peers[2] = PeerProcess(spec(2))
                    outcomes["restarts"] += 1
                if 2 not in ep.peers and i >= restart_at:
                    try:
                        await ep.connect(peers[2].address, timeout=5.0)
                    except XavierError:
                        outcomes["reconnect failed"] += 1
                for r, p in peers.items():  # a peer lost to an injected fault: reconnect it
                    if r not in ep.peers and not (r == 2 and i == restart_at):
                        try:
                            await ep.connect(p.address, timeout=5.0)
                            outcomes["reconnects"] += 1
                        except XavierError:
                            outcomes["reconnect failed"] += 1
                req = request()
                zero_slots(ep.caches, req)
                cancel = i % 97 == 96
                try:
                    if cancel:
                        with anyio.move_on_after(rng.uniform(0, 0.002)) as scope:
                            await ep.load(req)
                        if scope.cancelled_caught:
                            outcomes["cancelled"] += 1
                            continue
                    else:
                        await ep.load(req)
                except PeerLostError:
                    outcomes["peer lost"] += 1
                    continue
                except XavierError as exc:
                    outcomes[type(exc).__name__] += 1
                    continue
                n = check_loaded(ep.caches, req, expected)
                assert n > 0
                outcomes["ok"] += 1
                outcomes["blocks checked"] += n
                if report is not None and i % 1000 == 0:
                    report(i, loads)
            samples["end"] = _sample({"loader": os.getpid(),
                                      **{f"rank{r}": p.proc.pid for r, p in peers.items()}})
            samples["end"]["registrations"] = ep.snapshot_metrics()["memory_registrations"]
            fence = ep.recv_slab_stats
    finally:
        for p in peers.values():
            p.close()
    elapsed = time.perf_counter() - t0
    growth = {name: {k: samples["end"][name][k] - v for k, v in fig.items()}
              for name, fig in samples.get("warm", {}).items() if isinstance(fig, dict)}
    return {"loads": loads, "seconds": round(elapsed, 1), "outcomes": dict(outcomes),
            "samples": samples, "growth": growth, "recv_slabs": fence,
            "note": "rank2 is a new process after the restart: its growth is measured from a "
                    "different process and is not meaningful"}


async def verify_cost(loads: int = 2000, keys: int = 8, seed: int = 0) -> dict[str, Any]:
    """End-to-end loads from one child over NIXL, by two loaders in this process: one with
    ``verify=True``, one without, interleaved in rounds of 100. Median microseconds per
    load and the ratio (the cost of verified delivery)."""
    import statistics
    rng = random.Random(seed)
    expected = {1: pattern_caches(SPEC, 1, SEED)}
    child = PeerProcess(PeerSpec(rank=1, layout=SPEC, seed=SEED, config=CFG, torch_threads=1))
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        plain = Endpoint(0, pattern_caches(SPEC, 0, SEED), _nixl(), EndpointConfig(**CFG))
        checked = Endpoint(2, pattern_caches(SPEC, 2, SEED), _nixl(), EndpointConfig(**CFG, verify=True))
        async with plain, checked:
            for ep in (plain, checked):
                await ep.connect(child.address)
            for r in range(2 * (loads // 100)):
                ep = checked if r % 2 else plain
                for _ in range(100):
                    slots = rng.sample(range(SPEC.num_slots), keys)
                    req = {1: {layer: {rng.randrange(SPEC.num_slots): s for s in slots}
                               for layer in range(SPEC.layers)}}
                    t = time.perf_counter()
                    await ep.load(req)
                    times[ep is checked].append(time.perf_counter() - t)
                assert check_loaded(ep.caches, req, expected) > 0
    finally:
        child.close()
    off, on = (statistics.median(times[v]) * 1e6 for v in (False, True))
    return {"loads": loads, "keys_per_load": keys, "layers": SPEC.layers,
            "block_bytes": SPEC.block_nbytes, "median_us_verify_off": round(off, 1),
            "median_us_verify_on": round(on, 1), "ratio": round(on / off, 3)}


def _nixl() -> Any:
    from ..transports.nixl import NixlTransport
    return NixlTransport()


def print_soak(result: dict[str, Any]) -> None:
    print(f"soak: {result['loads']} loads in {result['seconds']} s")
    for k, v in sorted(result["outcomes"].items()):
        print(f"  {k:>16}: {v}")
    for name, g in result["growth"].items():
        print(f"  growth after warm-up, {name}: {g}")
    print(f"  receive slabs: {result['recv_slabs']}")


__all__ = ["soak", "verify_cost", "print_soak", "SPEC", "CFG", "FAULTS"]

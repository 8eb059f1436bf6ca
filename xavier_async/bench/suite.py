"""``xavier-async bench``: the figures a serving engineer needs, each against a floor
measured in the same run.

Two endpoints: this process (rank 0, the writer of channel copies and the loader of
end-to-end loads) and a peer (rank 1) in a child process over NIXL (``--transport nixl``,
the default) or in this process (``--transport local``). Sections:

* floor: raw NIXL WRITE on the same registrations, one handle re-posted, busy-polled
  (``local``: a torch copy between the two slabs);
* the seed's four channel cases (always full, alternating under size-only selection,
  alternating under the streak machine, sustained small);
* end-to-end loads (request, pack, write, unpack, acknowledge), small and large;
* a seeded replay of a serving trace shaped like the seed's deployment, as bare channel
  copies (padded under size-only selection, padded under the streak machine, trimmed) and
  as real loads (block keys, layers and destination slots, bytes checked at the end);
* the per-stage breakdown of each load (receiver and source stage histograms, when the
  engine records them) and the cost of planning one block hash x all layers;
* the state-machine decision cost and memory growth over many copies and over many real
  loads (host: Python objects retained and RSS; device: the CUDA allocator);
* packed path vs descriptor path per batch shape (:mod:`.descriptors`, raw NIXL between
  two processes, after the rig is closed), and the rule the figures support.
* the snapshot store (:mod:`.snapshots`): a source serving from its two tiers against one
  serving from live slots, hit rate and latency per tier, staging and demotion costs, and
  direct write vs gather on pool memory (the rule for ``direct_write_regions``);
* serving load (:mod:`.serving`): two source processes and this loader (DRAM), or two
  endpoints that both load and serve (the GPU pair), the trace replayed with 16 loads in
  flight, one receive/send slab vs the engine's default.

Times are medians (and p95) of per-operation wall time; every comparison is a ratio.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from typing import Any

import anyio
import torch

from .. import __version__
from ..endpoint import Endpoint, EndpointConfig
from ..testing.peer_process import LayoutSpec, PeerProcess, PeerSpec, check_loaded, digest, pattern_caches, \
    zero_slots
from ..policy import ChannelPolicy
from ..slabs import KiB, MiB
from ..testing.devices import gpu_facts, peer_device
from ..transports.local import LocalFabric
from .common import (PEER, SEED_CASES, TRACE_MODES, BenchOptions, TraceBatch, bench_layout, make_trace,
                     nearest_rank, stats, target, trace_payload, use_device)
from .raw import RAW_COPIES, accept_raw_copies, copy_raw, raw_floor, tune_channel

# the shared pieces live in .common (every section imports them from there); these names
# stay importable from here
__all__ = ["BenchOptions", "PEER", "SEED_CASES", "TRACE_MODES", "TraceBatch", "bench_layout",
           "make_trace", "nearest_rank", "run", "stats", "target", "trace_payload", "use_device"]


# -- rigs: the two endpoints ---------------------------------------------------------------
class Rig:
    """Rank 0 here plus a peer; subclasses say where the peer lives."""

    ep: Endpoint
    layout: LayoutSpec

    async def peer_metrics(self) -> dict[str, Any]:
        raise NotImplementedError

    async def peer_digest(self, nbytes: int) -> str:
        raise NotImplementedError

    def floor(self, nbytes: int, copies: int) -> list[float]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return self.ep.transport.describe()


class LocalRig(Rig):
    def __init__(self, ep: Endpoint, peer: Endpoint, layout: LayoutSpec) -> None:
        self.ep, self.peer, self.layout = ep, peer, layout

    async def peer_metrics(self) -> dict[str, Any]:
        return self.peer.snapshot_metrics()

    async def peer_digest(self, nbytes: int) -> str:
        assert self.peer.recv_slab is not None
        return digest(self.peer.recv_slab.tensor[:nbytes])

    def floor(self, nbytes: int, copies: int) -> list[float]:
        assert self.ep.send_slab is not None and self.peer.recv_slab is not None
        src, dst = self.ep.send_slab.tensor[:nbytes], self.peer.recv_slab.tensor[:nbytes]
        cuda = src.is_cuda
        out = []
        for i in range(10 + copies):
            t = time.perf_counter()
            dst.copy_(src)
            if cuda:
                torch.cuda.synchronize()
            if i >= 10:
                out.append(time.perf_counter() - t)
        return out


class NixlRig(Rig):
    def __init__(self, ep: Endpoint, peer: PeerProcess, layout: LayoutSpec) -> None:
        self.ep, self.peer, self.layout = ep, peer, layout

    async def peer_metrics(self) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(self.peer.call, "metrics")

    async def peer_digest(self, nbytes: int) -> str:
        return await anyio.to_thread.run_sync(self.peer.call, "recv_digest", nbytes)

    def floor(self, nbytes: int, copies: int) -> list[float]:
        return raw_floor(self.ep, PEER, nbytes, copies)


# -- sections --------------------------------------------------------------------------------
async def _copies(ep: Endpoint, sizes: Sequence[int]) -> list[float]:
    out = []
    perf = time.perf_counter
    for n in sizes:
        t = perf()
        await copy_raw(ep, PEER, n)
        out.append(perf() - t)
    return out


async def _checked_copy_digest(rig: Rig, nbytes: int) -> bool:
    """The last copy's bytes arrived: the peer's receive slab equals our send slab."""
    assert rig.ep.send_slab is not None
    return await rig.peer_digest(nbytes) == digest(rig.ep.send_slab.tensor[:nbytes])


async def seed_cases(rig: Rig, o: BenchOptions, floors: dict[str, dict[str, float]]) -> dict[str, Any]:
    ep, F, S = rig.ep, o.full_bytes, o.small_bytes
    seqs = {
        "always_full": ([F] * o.copies, 2),
        "alternating_size_only": ([F, S] * (o.copies // 2), 1),
        "alternating_streak": ([F, S] * (o.copies // 2), 2),
        "sustained_small": ([S] * o.copies, 2),
    }
    floor_of = {F: floors["full"]["median_us"], S: floors["small"]["median_us"]}
    out: dict[str, Any] = {}
    for name, (sizes, streak) in seqs.items():
        tune_channel(ep, PEER, streak=streak, trimmed=False)
        await _copies(ep, sizes[: o.warmup])  # warm-up: views mapped, machine in steady state
        regs0 = ep.snapshot_metrics()["registrations"]
        peer_regs0 = (await rig.peer_metrics())["registrations"]
        m0 = dict(ep.metrics.peer(PEER).as_dict())
        times = await _copies(ep, sizes)
        m1 = ep.metrics.peer(PEER).as_dict()
        st = stats(times)
        floor_mean = statistics.fmean(floor_of[n] for n in sizes)
        out[name] = {
            **st,
            "streak": streak,
            "copies": len(sizes),
            "registrations_after_warmup": ep.snapshot_metrics()["registrations"] - regs0,
            "peer_registrations_after_warmup": (await rig.peer_metrics())["registrations"] - peer_regs0,
            "wire_bytes": m1["wire_bytes"] - m0["wire_bytes"],
            "useful_bytes": m1["useful_bytes"] - m0["useful_bytes"],
            "copies_small": m1["copies_small"] - m0["copies_small"],
            "view_switches": m1["view_switches"] - m0["view_switches"],
            "floor_mean_us": floor_mean,
            "ratio_mean_to_floor": st["mean_us"] / floor_mean,
            "bytes_verified": await _checked_copy_digest(rig, sizes[-1]),
        }
        if len(set(sizes)) == 1:
            out[name]["ratio_median_to_floor"] = st["median_us"] / floor_of[sizes[0]]
    out["alternating_streak_vs_always_full"] = (out["alternating_streak"]["mean_us"]
                                                / out["always_full"]["mean_us"])
    tune_channel(ep, PEER, streak=2, trimmed=False)
    return out


def _load_request(keys: int, layers: int, layout: LayoutSpec, key0: int = 0) -> dict[int, Any]:
    dest0 = layout.num_slots // 2
    return {PEER: {layer: {key0 + k: dest0 + k for k in range(keys)} for layer in range(layers)}}


async def e2e_loads(rig: Rig, o: BenchOptions, seed_res: dict[str, Any]) -> dict[str, Any]:
    ep, layout = rig.ep, rig.layout
    keys_full = layout.num_slots // 2
    expected = {PEER: pattern_caches(layout, PEER, o.seed)}
    cases = {"small": _load_request(1, layout.layers, layout),           # one block hash, all layers
             "small_one_layer": _load_request(1, 1, layout),              # one block of one layer
             "large": _load_request(keys_full, layout.layers, layout),    # a full slab
             "small_blocks": _load_request(1, layout.layers, layout)}     # "small" by load_blocks
    dest0 = layout.num_slots // 2

    def loader(name: str, req: dict[int, Any]) -> Callable[[], Any]:
        if name == "small_blocks":  # the same load through the block-major API
            return partial(ep.load_blocks, PEER, [0], [dest0])
        return partial(ep.load, req)

    out: dict[str, Any] = {}
    for name, req in cases.items():
        load = loader(name, req)
        tune_channel(ep, PEER, streak=2, trimmed=False)
        zero_slots(ep.caches, req)
        await load()
        verified = check_loaded(ep.caches, req, expected) > 0
        for _ in range(min(o.warmup, 5)):
            await load()
        stages0 = await _stages(rig)
        times = []
        perf = time.perf_counter
        for _ in range(max(5, o.loads // 4) if name == "large" else o.loads):
            t = perf()
            await load()
            times.append(perf() - t)
        stages = _stages_since(stages0, await _stages(rig))
        zero_slots(ep.caches, req)
        await load()
        verified = verified and check_loaded(ep.caches, req, expected) > 0
        payload = sum(len(b) for b in req[PEER].values()) * layout.block_nbytes
        ref = seed_res["always_full" if name == "large" else "sustained_small"]["median_us"]
        st = stats(times)
        out[name] = {**st, "payload_bytes": payload, "channel_copy_median_us": ref,
                     "ratio_to_channel_copy": st["median_us"] / ref, "bytes_verified": verified,
                     "stages": stages}
    return out


async def _stages(rig: Rig) -> tuple[Any, Any] | None:
    """Both endpoints' stage histograms (receiver: here; source: the peer), or None while
    the engine does not record them."""
    here = rig.ep.snapshot_metrics().get("stages")
    there = (await rig.peer_metrics()).get("stages")
    if here is None or there is None:
        return None
    from ..stages import LoadStages
    return LoadStages.from_dict(here), LoadStages.from_dict(there)


def _stages_since(before: tuple[Any, Any] | None, after: tuple[Any, Any] | None,
                  ) -> dict[str, dict[str, float]] | None:
    """Per stage, p50/p99/mean (us) of what was recorded in between: receiver stages from
    this endpoint, source stages from the peer. None when nothing was recorded."""
    if before is None or after is None:
        return None
    from ..stages import RECEIVER_STAGES, SOURCE_STAGES
    here, there = after[0].minus(before[0]), after[1].minus(before[1])
    out: dict[str, dict[str, float]] = {}
    for side, names, st in (("receiver", RECEIVER_STAGES, here), ("source", SOURCE_STAGES, there)):
        for name in names:
            h = st[name]
            if h.n:
                out[f"{side}.{name}"] = {"n": h.n, "p50_us": h.p50_us, "p99_us": h.p99_us,
                                         "mean_us": h.mean_us}
    return out or None


def plan_cost(layout: LayoutSpec, full_bytes: int, n: int = 3000) -> dict[str, float]:
    """Median cost of planning one block hash x all layers (validate + batches), with the
    cached planner and with the reference path it replaces (normalize + plan_batches)."""
    from ..layout import CacheLayout
    from ..planning import Planner, normalize, plan_batches
    caches = {layer: torch.empty((layout.num_slots, *layout.block_shape), dtype=torch.bfloat16,
                                 device="meta") for layer in range(layout.layers)}
    lay = CacheLayout.of(caches)
    planner = Planner(lay, full_bytes)
    perf = time.perf_counter_ns

    def med(fn: Callable[[int], Any]) -> float:
        for i in range(50):
            fn(i)
        ts = []
        for i in range(n):
            t = perf()
            fn(i)
            ts.append(perf() - t)
        return statistics.median(ts) / 1e3

    slots = layout.num_slots
    def req(i: int) -> dict[int, Any]:  # a new block hash each time, as a serving stack asks
        return {PEER: {layer: {1000 + i: i % slots} for layer in range(layout.layers)}}
    reqs = [req(i) for i in range(n + 50)]
    cached = med(lambda i: planner.plan(reqs[i]))
    reference = med(lambda i: [plan_batches(p, lay, full_bytes) for p in normalize(reqs[i], lay).values()])
    return {"cached_us": cached, "reference_us": reference, "layers": layout.layers}


async def trace_replay(rig: Rig, o: BenchOptions, floors: dict[str, dict[str, float]]) -> dict[str, Any]:
    ep, layout = rig.ep, rig.layout
    trace = make_trace(o.trace_batches, o.trace_large, layout, o.full_bytes, o.small_bytes, o.seed)
    payloads = [trace_payload(b, layout) for b in trace]
    useful = sum(payloads)
    full_rate = o.full_bytes / (floors["full"]["median_us"] * 1e-6)   # bytes per second
    out: dict[str, Any] = {"batches": len(trace), "large_batches": sum(b.large for b in trace),
                           "useful_bytes": useful}
    for name, (streak, trimmed) in TRACE_MODES.items():
        ch = tune_channel(ep, PEER, streak=streak, trimmed=trimmed)
        await _copies(ep, [o.full_bytes, o.small_bytes, o.small_bytes])  # map both views
        ch.policy.reset()
        regs0 = ep.snapshot_metrics()["registrations"]
        m0 = dict(ep.metrics.peer(PEER).as_dict())
        t0 = time.perf_counter()
        times = await _copies(ep, payloads)
        total = time.perf_counter() - t0
        m1 = ep.metrics.peer(PEER).as_dict()
        wire = m1["wire_bytes"] - m0["wire_bytes"]
        out[name] = {**stats(times), "streak": streak, "trimmed": trimmed,
                     "wire_bytes": wire, "wire_over_useful": wire / useful,
                     "registrations_after_warmup": ep.snapshot_metrics()["registrations"] - regs0,
                     "copies_small": m1["copies_small"] - m0["copies_small"],
                     "total_ms": total * 1e3,
                     "bytes_verified": await _checked_copy_digest(rig, payloads[-1])}
    trimmed_wire = out["trimmed_streak"]["wire_bytes"]
    floor_s = trimmed_wire / full_rate + len(trace) * floors["small"]["median_us"] * 1e-6
    out["floor_ms"] = floor_s * 1e3
    for name in TRACE_MODES:
        out[name]["ratio_total_to_floor"] = out[name]["total_ms"] / out["floor_ms"]
    tune_channel(ep, PEER, streak=2, trimmed=False)
    return out


async def trace_loads(rig: Rig, o: BenchOptions, floors: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The serving trace replayed as :meth:`Endpoint.load` calls: each batch asks the peer
    for block hashes (its published slots) into destination slots of ours, the layers a
    serving stack would name; the bytes of every slot the trace wrote are checked at the
    end (the last block loaded into each). The peer's channel runs its configured mode."""
    ep, layout = rig.ep, rig.layout
    trace = make_trace(o.trace_batches, o.trace_large, layout, o.full_bytes, o.small_bytes, o.seed)
    rng = random.Random(o.seed + 1)
    half = layout.num_slots // 2
    requests = []
    for b in trace:
        keys = rng.sample(range(half), b.keys)               # the peer's published blocks
        dests = rng.sample(range(half, layout.num_slots), b.keys)
        layers = range(layout.layers) if b.large else sorted(rng.sample(range(layout.layers), b.layers))
        requests.append({PEER: {layer: dict(zip(keys, dests)) for layer in layers}})
    useful = sum(trace_payload(b, layout) for b in trace)
    for req in requests[:3]:                                 # warm: both views mapped
        await ep.load(req)
    regs0 = ep.snapshot_metrics()["registrations"]
    peer0 = await rig.peer_metrics()
    stages0 = await _stages(rig)
    final: dict[tuple[int, int], int] = {}
    times = []
    perf = time.perf_counter
    t0 = perf()
    for req in requests:
        t = perf()
        await ep.load(req)
        times.append(perf() - t)
    total = perf() - t0
    for req in requests:
        for layer, blocks in req[PEER].items():
            for key, dest in blocks.items():
                final[(layer, dest)] = key
    by_layer: dict[int, list[tuple[int, int]]] = {}
    for (layer, dest), key in final.items():
        by_layer.setdefault(layer, []).append((key, dest))
    verified = True
    expected = {PEER: pattern_caches(layout, PEER, o.seed)}
    for layer, pairs in by_layer.items():
        # several destinations may hold one key: check each (key -> dest) on its own
        for key, dest in pairs:
            verified = verified and check_loaded(ep.caches, {PEER: {layer: {key: dest}}}, expected) == 1
    peer1 = await rig.peer_metrics()
    wire = peer1["total"]["wire_bytes"] - peer0["total"]["wire_bytes"]
    full_rate = o.full_bytes / (floors["full"]["median_us"] * 1e-6)
    floor_s = useful / full_rate + len(trace) * floors["small"]["median_us"] * 1e-6
    return {**stats(times), "batches": len(trace), "large_batches": sum(b.large for b in trace),
            "useful_bytes": useful, "wire_bytes": wire, "wire_over_useful": wire / useful,
            "registrations_after_warmup": (ep.snapshot_metrics()["registrations"] - regs0
                                           + peer1["registrations"] - peer0["registrations"]),
            "total_ms": total * 1e3, "floor_ms": floor_s * 1e3,
            "ratio_total_to_floor": total / floor_s, "bytes_verified": verified,
            "slots_checked": len(final), "stages": _stages_since(stages0, await _stages(rig))}


async def load_timeline(o: BenchOptions) -> dict[str, Any]:
    """One-hash loads, one at a time, with a :class:`~xavier_async.testing.timeline.Timeline`
    in both processes (its own rig: the marks cost about a microsecond each): per side,
    the load's busy time split into NIXL's calls, byte copies and Python host time, and
    each stage's median, for ``load()`` and ``load_blocks()``; bytes checked."""
    from ..testing.timeline import ENV, Timeline, host_time, load_timelines

    timeline = Timeline().install()
    old = os.environ.get(ENV)
    os.environ[ENV] = "1"  # the peer process installs one too

    async def body(rig: Rig) -> dict[str, Any]:
        assert isinstance(rig, NixlRig)
        ep, layout = rig.ep, rig.layout
        req = _load_request(1, layout.layers, layout)
        dest0 = layout.num_slots // 2
        expected = {PEER: pattern_caches(layout, PEER, o.seed)}
        mark_ns = timeline.mark_cost_ns()
        out: dict[str, Any] = {}
        for name, load in (("load", partial(ep.load, req)),
                           ("load_blocks", partial(ep.load_blocks, PEER, [0], [dest0]))):
            zero_slots(ep.caches, req)
            for _ in range(max(20, min(o.warmup, 100))):
                await load()
            ok = check_loaded(ep.caches, req, expected) > 0
            timeline.take()
            await anyio.to_thread.run_sync(rig.peer.call, "timeline")
            for _ in range(o.loads):
                await load()
            mine = timeline.take()
            theirs = await anyio.to_thread.run_sync(rig.peer.call, "timeline")
            out[name] = {**host_time(load_timelines(mine, theirs), mark_ns), "bytes_verified": ok,
                         "mark_ns": mark_ns}
        return out

    try:
        res: dict[str, Any] = await _with_rig(o, body)
        return res
    finally:
        timeline.uninstall()
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def decision_cost(n: int = 20000) -> dict[str, float]:
    """Median cost of one ChannelPolicy.select (the hot-path state-machine decision),
    measured in blocks of 100 calls."""
    p = ChannelPolicy(12 * MiB, 256 * KiB)
    sizes = [4096, 12 * MiB, 4096, 4096, 8192, 12 * MiB] * 17
    sizes = sizes[:100]
    per_block = []
    perf = time.perf_counter
    select = p.select
    for _ in range(n // 100):
        t = perf()
        for s in sizes:
            select(s)
        per_block.append((perf() - t) / 100)
    return {"median_us": statistics.median(per_block) * 1e6}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def memory_growth(rig: Rig, o: BenchOptions) -> dict[str, Any]:
    """Host RSS and device memory before and after many copies (alternating views)."""
    ep = rig.ep
    sizes = [o.small_bytes, o.small_bytes, 64 * KiB, o.full_bytes] * 25
    await _copies(ep, sizes)  # warm
    cuda = ep.layout.device.type == "cuda"
    dev0 = torch.cuda.memory_allocated(ep.layout.device) if cuda else 0
    rss0 = _rss_bytes()
    done = 0
    while done < o.alloc_copies:
        await _copies(ep, [o.small_bytes, 64 * KiB, o.small_bytes])
        done += 3
    rss1 = _rss_bytes()
    dev1 = torch.cuda.memory_allocated(ep.layout.device) if cuda else 0
    slabs = 2 * o.full_bytes
    return {"copies": done, "rss_growth_bytes": rss1 - rss0, "device_growth_bytes": dev1 - dev0,
            "slab_bytes_per_endpoint": slabs}


def _peer_rss_bytes(rig: Rig) -> int | None:
    """The peer process's RSS (None when the peer lives in this process)."""
    peer = getattr(rig, "peer", None)
    proc = getattr(peer, "proc", None)
    if proc is None:
        return None
    with open(f"/proc/{proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def memory_requests(layout: LayoutSpec) -> list[dict[int, Any]]:
    """The loads the memory check cycles through: one block hash x all layers, one layer
    block, 8 consecutive hashes x all layers, 8 scattered hashes x 3 layers."""
    half = layout.num_slots // 2
    n = min(8, half)
    scattered = {(k * 5) % half: half + (k * 3) % half for k in range(n)}
    return [_load_request(1, layout.layers, layout, key0=1),
            _load_request(1, 1, layout, key0=2),
            _load_request(n, layout.layers, layout),
            {PEER: {layer: dict(scattered) for layer in (0, layout.layers // 2, layout.layers - 1)}}]


async def load_memory_growth(rig: Rig, o: BenchOptions) -> dict[str, Any]:
    """Memory growth over ``o.alloc_loads`` real :meth:`Endpoint.load` calls (after a
    warm-up), measured twice: a first run for host RSS (this process and the peer's; over
    the second of two windows of that many loads, the first reported apart) and
    device memory (``torch.cuda.memory_allocated``), a second under ``tracemalloc`` for the
    Python objects the loads leave alive (net traced bytes between two snapshots taken at
    the same quiet point, after ``gc.collect``, with the top allocation sites when not
    zero). The last loads of each run have their destination slots zeroed first and their
    bytes checked after."""
    import gc
    import tracemalloc

    ep, layout = rig.ep, rig.layout
    reqs = memory_requests(layout)
    expected = {PEER: pattern_caches(layout, PEER, o.seed)}
    cuda = ep.layout.device.type == "cuda"

    def dev_bytes() -> int:
        return torch.cuda.memory_allocated(ep.layout.device) if cuda else 0

    async def loads(n: int) -> bool:
        checked = True
        for i in range(n):
            req = reqs[i % len(reqs)]
            last = i >= n - len(reqs)
            if last:
                zero_slots(ep.caches, req)
            await ep.load(req)
            if last:
                checked = checked and check_loaded(ep.caches, req, expected) > 0
        return checked

    async def settle() -> None:  # no load in flight, the loop's callbacks run, garbage gone
        await anyio.sleep(0.005)
        gc.collect()

    await loads(max(len(reqs), min(200, o.alloc_loads // 10)))  # warm: every shape planned
    await settle()
    # RSS over two windows of alloc_loads each: the first includes a process's one-time
    # growth (measured: +659 KB over a first 10,000 loads, then 0 B over 100,000 and over
    # 10,000 more in the same process), the second is what the loads keep
    rss_w, peer_w = _rss_bytes(), _peer_rss_bytes(rig)
    ok_first = await loads(o.alloc_loads)
    await settle()
    rss0, peer0, dev0 = _rss_bytes(), _peer_rss_bytes(rig), dev_bytes()
    ok_rss = await loads(o.alloc_loads) and ok_first
    await settle()
    rss1, peer1, dev1 = _rss_bytes(), _peer_rss_bytes(rig), dev_bytes()
    # the progress display (rich) redraws from its own thread: not the loads' memory
    ignore = [tracemalloc.Filter(False, f) for f in ("*/rich/*", tracemalloc.__file__)]
    tracemalloc.start(8)
    try:
        # both snapshots at the same point of an identical cycle (loads, then quiet), after
        # a traced warm-up: one-time caches (abc, re, the filter's own) and the live state of
        # the transport's poll task are in both, so only what the loads keep adds up
        await loads(max(len(reqs), min(200, o.alloc_loads // 10)))
        await settle()
        tracemalloc.take_snapshot().filter_traces(ignore)
        before = tracemalloc.take_snapshot().filter_traces(ignore)
        ok_traced = await loads(o.alloc_loads)
        await settle()
        after = tracemalloc.take_snapshot().filter_traces(ignore)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    diff = after.compare_to(before, "lineno")
    retained = sum(d.size_diff for d in diff)
    top = [str(d) for d in sorted(diff, key=lambda d: -d.size_diff)[:5] if d.size_diff > 0]
    return {"loads": o.alloc_loads, "requests": len(reqs),
            "python_retained_bytes": retained, "python_peak_bytes": peak,
            "python_top_growth": top,
            "rss_growth_bytes": rss1 - rss0,
            "peer_rss_growth_bytes": None if peer0 is None or peer1 is None else peer1 - peer0,
            "first_window_rss_growth_bytes": rss0 - rss_w,
            "first_window_peer_rss_growth_bytes": (None if peer_w is None or peer0 is None
                                                   else peer0 - peer_w),
            "device_growth_bytes": dev1 - dev0, "bytes_verified": ok_rss and ok_traced}


def environment(rig: Rig, device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "xavier_async": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
        "platform": platform.platform(), "cpus": os.cpu_count(), "device": device,
        "pinned_cpu": sorted(os.sched_getaffinity(0)) if len(os.sched_getaffinity(0)) < (os.cpu_count() or 1)
        else None,
        **rig.describe(),
    }
    if device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    # one GPU for both processes (--device cuda on a one-GPU machine) is said here
    env.update(gpu_facts(device))
    return env


# -- driver ------------------------------------------------------------------------------------
async def _with_rig(o: BenchOptions, body: Callable[[Rig], Any]) -> Any:
    device = o.resolved_device()
    layout = bench_layout(o.full_bytes)
    cfg: dict[str, Any] = dict(full_bytes=o.full_bytes, small_bytes=o.small_bytes)
    if o.reply_spin is not None:
        cfg["reply_spin"] = o.reply_spin
    here, there = peer_device(0, device).device, peer_device(1, device).device
    caches = pattern_caches(layout, 0, o.seed, here)
    if o.transport == "local":
        fabric = LocalFabric()
        here_ep = Endpoint(0, caches, fabric.transport(), EndpointConfig(**cfg))
        peer_ep = Endpoint(PEER, pattern_caches(layout, PEER, o.seed, there), fabric.transport(),
                           EndpointConfig(**cfg))
        accept_raw_copies(peer_ep)
        async with here_ep as ep, peer_ep as peer:
            for slot in range(layout.num_slots // 2):
                peer.publish(slot, slot)
            await ep.connect(peer.address)
            _fill_send_slab(ep, o.seed)
            return await body(LocalRig(ep, peer, layout))
    from ..transports.nixl import NixlTransport
    # one process per GPU, each seeing both (CUDA IPC between them needs that; one GPU: both
    # on it, see peer_device); both poll, so on a machine large enough each gets its own
    # physical core (no SMT sibling)
    cpus = pick_cpus(2) if o.resolved_pin() else None
    spec = PeerSpec(rank=PEER, layout=layout, seed=o.seed, device=there,
                    config=cfg, hello_extras={RAW_COPIES: True},
                    torch_threads=1 if device == "cpu" else None,
                    cpus=[cpus[1]] if cpus else None)
    # this thread is pinned for the rig's life only: threads started meanwhile (anyio's
    # workers, which later spawn the protocol floor's source and the serving section's
    # peers) would keep the one CPU, and processes they start would time-slice on it
    # (16 ms loads on a 16-core host): every thread of this process gets its CPUs back
    unpinned = os.sched_getaffinity(0) if cpus else None
    if cpus:
        os.sched_setaffinity(0, [cpus[0]])
    try:
        peer_proc = await anyio.to_thread.run_sync(PeerProcess, spec)
        try:
            async with Endpoint(0, caches, NixlTransport(), EndpointConfig(**cfg)) as ep:
                await ep.connect(peer_proc.address)
                _fill_send_slab(ep, o.seed)
                return await body(NixlRig(ep, peer_proc, layout))
        finally:
            await anyio.to_thread.run_sync(peer_proc.close)
    finally:
        if unpinned is not None:
            _unpin_threads(unpinned)


def _unpin_threads(cpus: set[int]) -> None:
    """Give every thread of this process ``cpus`` (Linux: a thread id is a pid here)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # it ended meanwhile
            pass


def physical_cores() -> list[list[int]]:
    """CPUs grouped by physical core (SMT siblings together), in CPU order."""
    groups: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                key = f.read().strip()
        except OSError:
            key = str(cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def pick_cpus(n: int = 2) -> list[int] | None:
    """One CPU on each of ``n`` different physical cores, leaving core 0 to the system
    when there are enough; None on machines too small to pin (fewer than 4 cores)."""
    cores = physical_cores()
    if len(cores) < 4:
        return None
    return [cores[i + 1][0] for i in range(n)]


def _fill_send_slab(ep: Endpoint, seed: int) -> None:
    assert ep.send_slab is not None
    g = torch.Generator().manual_seed(seed + 77)
    ep.send_slab.tensor.copy_(torch.randint(0, 256, (ep.send_slab.tensor.numel(),), generator=g,
                                            dtype=torch.uint8))


async def run(o: BenchOptions, report: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run every section; return one JSON-able dict."""
    device = use_device(o)

    async def body(rig: Rig) -> dict[str, Any]:
        t0 = time.perf_counter()
        res: dict[str, Any] = {"options": asdict(o), "environment": environment(rig, device)}
        report("floor")
        floors = {"full": stats(rig.floor(o.full_bytes, max(20, o.copies // 2))),
                  "small": stats(rig.floor(o.small_bytes, o.copies))}
        res["floor"] = {**floors, "kind": "memcpy" if o.transport == "local" else "raw NIXL WRITE"}
        report("seed cases")
        res["seed_cases"] = await seed_cases(rig, o, floors)
        report("end-to-end loads")
        res["e2e_loads"] = await e2e_loads(rig, o, res["seed_cases"])
        report("trace replay")
        res["trace"] = await trace_replay(rig, o, floors)
        report("trace as loads")
        res["trace_loads"] = await trace_loads(rig, o, floors)
        report("decision cost")
        res["decision"] = decision_cost()
        res["plan"] = plan_cost(rig.layout, o.full_bytes)
        report("memory growth")
        res["memory"] = await memory_growth(rig, o)
        report("memory over loads")
        res["memory_loads"] = await load_memory_growth(rig, o)
        # the floor again, to show how much the machine drifted during the run
        res["floor_after"] = {"full": stats(rig.floor(o.full_bytes, max(20, o.copies // 4))),
                              "small": stats(rig.floor(o.small_bytes, o.copies // 2))}
        res["metrics"] = rig.ep.snapshot_metrics()
        res["peer_metrics"] = await rig.peer_metrics()
        res["targets"] = targets(res)
        res["elapsed_s"] = time.perf_counter() - t0
        return res

    res: dict[str, Any] = await _with_rig(o, body)
    if o.protocol_floor and o.transport == "nixl":
        # its own two bare NIXL processes, after our rig is closed (a quiet machine)
        from .protocol_floor import protocol_floor
        report("protocol floor")
        layout = bench_layout(o.full_bytes)
        try:
            # where the run pins, its two processes on the CPUs the rig's had (the rig
            # gave every thread its CPUs back when it ended)
            pin = pick_cpus(2) if o.resolved_pin() else None
            cpus = ([pin[0]], [pin[1]]) if pin else None
            res["protocol_floor"] = await anyio.to_thread.run_sync(
                lambda: protocol_floor(layout, o.full_bytes, device, iters=max(20, o.loads),
                                       warmup=min(o.warmup, 20), seed=o.seed, cpus=cpus))
        except Exception as exc:  # reported beside the loads; the other sections stand
            res["protocol_floor"] = {"error": f"{type(exc).__name__}: {exc}"}
        res["targets"].update(protocol_targets(res))
    if o.load_timeline and o.transport == "nixl":
        report("load timeline")
        try:
            res["load_timeline"] = await load_timeline(o)
        except Exception as exc:  # reported in its table; the other sections stand
            res["load_timeline"] = {"error": f"{type(exc).__name__}: {exc}"}
        res["targets"].update(timeline_targets(res["load_timeline"]))
    if o.descriptors and o.transport == "nixl":
        # its own two processes, after our rig is closed (a quiet machine)
        from .descriptors import run_descriptors
        report("descriptor path")
        res["descriptors"] = await anyio.to_thread.run_sync(
            lambda: run_descriptors(o.full_bytes, device, iters=max(8, o.copies // 2),
                                    warmup=min(o.warmup, 10), seed=o.seed, quick=o.quick))
    if o.snapshot and o.transport == "nixl":
        # after the rig is closed: a loader and three sources of its own, then raw NIXL
        from .snapshots import snapshot_section
        report("snapshot store")
        try:
            res["snapshot"] = await snapshot_section(o)
        except Exception as exc:  # a wrong byte included: reported, and the command fails
            res["snapshot"] = {"error": f"{type(exc).__name__}: {exc}"}
    if o.serving:
        # after the rig is closed: three processes of its own (loader and two sources)
        from .serving import serving
        report("serving load")
        try:
            res["serving"] = await serving(o)
        except Exception as exc:  # a wrong byte included: reported, and the command fails,
            # without losing the sections above
            res["serving"] = {"error": f"{type(exc).__name__}: {exc}"}
    if o.compare == "xoscar":
        # After our rig is closed (its peer process gone), so the anchor runs on a quiet
        # machine; its ratios are against the floor measured above.
        report("xoscar compare")
        res["compare"] = {"xoscar": await compare_xoscar(o, res, device)}
    return res


async def compare_xoscar(o: BenchOptions, res: dict[str, Any], device: str) -> dict[str, Any]:
    """The seed's four cases through xoscar's copy_to (see :mod:`.xoscar_anchor`), with
    the speedup over our numbers of the same run; ``{"error": ...}`` if it cannot run."""
    from . import xoscar_anchor as anchor_xoscar
    if not anchor_xoscar.available():
        return {"error": "xoscar is not installed: pip install 'xavier-async[xoscar]'"}
    try:
        xo = await anchor_xoscar.run_cases(o, res["floor"], device=device,
                                           cpus=pick_cpus(2) if o.resolved_pin() else None)
    except Exception as exc:  # report it next to our numbers instead of losing the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    xo["speedup_vs_xavier"] = anchor_xoscar.compare_with(res["seed_cases"], xo)
    return xo


def targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The product's targets (docs/benchmarks.md, Targets), each as (value, limit, met)."""
    sc, tr = r["seed_cases"], r["trace"]
    t = target
    out = {
        "channel_small_vs_floor": t(sc["sustained_small"]["ratio_median_to_floor"], 2.5),
        "channel_full_vs_floor": t(sc["always_full"]["ratio_median_to_floor"], 1.3),
        "registrations_after_warmup": t(max(sc[c]["registrations_after_warmup"] +
                                            sc[c]["peer_registrations_after_warmup"]
                                            for c in SEED_CASES), 0),
        "alternating_streak_vs_always_full": t(sc["alternating_streak_vs_always_full"], 1.10),
        "trimmed_wire_over_useful": t(tr["trimmed_streak"]["wire_over_useful"], 1.02),
        "trace_vs_floor": t(tr["trimmed_streak"]["ratio_total_to_floor"], 3.0),
        "trace_loads_vs_floor": t(r["trace_loads"]["ratio_total_to_floor"], 3.0),
        "plan_one_hash_us": t(r["plan"]["cached_us"], 5.0),
        "decision_us": t(r["decision"]["median_us"], 3.0),
        "memory_growth_bytes": t(max(r["memory"]["rss_growth_bytes"], r["memory"]["device_growth_bytes"],
                                     0), 0),
    }
    ml = r.get("memory_loads")
    if ml is not None:
        # over real loads: Python objects left alive, device memory, and this process's RSS
        out["load_memory_python_bytes"] = t(max(ml["python_retained_bytes"], 0), 0)
        out["load_memory_device_bytes"] = t(max(ml["device_growth_bytes"], 0), 0)
        out["load_memory_rss_bytes"] = t(max(ml["rss_growth_bytes"], 0), 0)
    if r["environment"].get("device") == "cuda":
        out["e2e_small_load_us"] = t(r["e2e_loads"]["small"]["median_us"], 150.0)
    return out


def timeline_targets(lt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 24's host-time target: Python host time per one-hash load on each side (by
    ``load_blocks``, the block-major API), at most 15 us."""
    if "error" in lt or "load_blocks" not in lt:
        return {}
    b = lt["load_blocks"]
    return {"host_python_us_receiver": target(b["receiver.python"], 15.0),
            "host_python_us_source": target(b["source.python"], 15.0)}


def protocol_targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 24's load targets against the plain-Python protocol floor and the raw WRITE
    floors of the same run (none when the floor did not run)."""
    pf, e2e, fl = r.get("protocol_floor") or {}, r["e2e_loads"], r["floor"]
    if "error" in pf or "small" not in pf:
        return {}
    small, full = fl["small"]["median_us"], fl["full"]["median_us"]
    out = {"load_small_vs_protocol_floor": target(e2e["small"]["median_us"] /
                                                  pf["small"]["gather"]["median_us"], 1.2),
           "load_blocks_small_vs_protocol_floor": target(
               e2e["small_blocks"]["median_us"] / pf["small"]["gather"]["median_us"], 1.2),
           "load_small_vs_raw_small": target(e2e["small"]["median_us"] / small, 4.0),
           "load_one_layer_vs_raw_small": target(e2e["small_one_layer"]["median_us"] / small, 3.0)}
    large_limit = 1.5 if r["environment"].get("device") == "cuda" else 1.2
    out["load_large_vs_raw_full"] = target(e2e["large"]["median_us"] / full, large_limit)
    return out

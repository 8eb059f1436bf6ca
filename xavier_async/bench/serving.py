"""The serving-load section of ``xavier-async bench``: many loads in flight from two peers.

Three processes: this one is the loader (rank 0); ranks 1 and 2 are sources, each a
:class:`~xavier_async.testing.PeerProcess` whose caches hold known bytes. The loader
replays the seed-shaped trace (:func:`~xavier_async.bench.suite.make_trace`: a few cold
loads near the full slab among many warm small ones) as real :meth:`Endpoint.load` calls
with :data:`CONCURRENCY` requests in flight, each load from one of the two sources.

It runs twice, side by side: with one receive slab and one send slab per endpoint (K=1,
the seed's design) and with the endpoint's default K (``EndpointConfig.receive_slabs``
and ``send_slabs``).

Per run, phases (each with its own destination slots, all checked byte for byte after
the phase, outside the timings):

* warm-up: a round of large loads all in flight at once, the start of the trace and a
  round of concurrent small loads (both views used on every slab, from both sources);
  registrations and RSS of all three processes are sampled after it;
* unloaded: the trace's small loads alone, one at a time (latency p50/p99);
* mixed: the whole trace, 16 in flight (useful GB/s, loads/s, small-load p50/p99);
* concurrent small: the trace's small loads, 16 in flight (loads/s);
* large stream: full-slab loads from both sources, 16 in flight, aggregate useful
  bandwidth against the raw NIXL full-copy rate measured in the same run.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ..endpoint import Endpoint, EndpointConfig
from ..testing.peer_process import LayoutSpec, PeerProcess, PeerSpec, check_loaded, pattern_caches, \
    zero_caches
from .raw import RAW_COPIES, raw_floor
from .soak import _sample
from .suite import BenchOptions, bench_layout, make_trace, stats, target

#: loads in flight, as in the seed's deployment
CONCURRENCY = 16
SOURCES = (1, 2)
#: the EndpointConfig fields of the slab counts
SLAB_FIELDS = ("receive_slabs", "send_slabs")

Request = dict[int, dict[int, dict[int, int]]]


# -- configuration ----------------------------------------------------------------------------
def config_kwargs(k: int | None, **base: Any) -> dict[str, Any]:
    """EndpointConfig keyword arguments: ``base`` plus ``receive_slabs=k, send_slabs=k``;
    ``k=None`` keeps the engine's defaults."""
    out = dict(base)
    if k is not None:
        out.update({name: k for name in SLAB_FIELDS})
    return out


def config_for(k: int | None, **base: Any) -> EndpointConfig:
    """The loader's and the sources' config for ``k`` slabs (see :func:`config_kwargs`)."""
    return EndpointConfig(**config_kwargs(k, **base))


def slab_counts(cfg: EndpointConfig) -> dict[str, int]:
    """Receive and send slabs per endpoint."""
    return {"receive_slabs": cfg.receive_slabs, "send_slabs": cfg.send_slabs}


# -- loads --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """One load of the replay: block hashes (the source's published slots) from one source."""

    src: int
    keys: tuple[int, ...]
    layers: tuple[int, ...]
    large: bool

    @property
    def blocks(self) -> int:
        return len(self.keys) * len(self.layers)


def trace_loads(o: BenchOptions, src_layout: LayoutSpec) -> list[Load]:
    """The seed-shaped trace as loads, each from a random source (seeded)."""
    rng = random.Random(o.seed + 11)
    out = []
    for b in make_trace(o.trace_batches, o.trace_large, src_layout, o.full_bytes, o.small_bytes, o.seed):
        layers = range(src_layout.layers) if b.large else sorted(rng.sample(range(src_layout.layers),
                                                                             b.layers))
        out.append(Load(rng.choice(SOURCES), tuple(rng.sample(range(src_layout.num_slots), b.keys)),
                        tuple(layers), b.large))
    return out


def large_stream(n: int, src_layout: LayoutSpec) -> list[Load]:
    """``n`` full-slab loads (every published block x every layer), sources alternating."""
    keys = tuple(range(src_layout.num_slots // 2))
    return [Load(SOURCES[i % 2], keys, tuple(range(src_layout.layers)), True) for i in range(n)]


def phase_loads(o: BenchOptions, src_layout: LayoutSpec) -> dict[str, list[Load]]:
    """The loads of each phase, in the order they run (the same for every K)."""
    mixed = trace_loads(o, src_layout)
    small = [x for x in mixed if not x.large]
    stream = large_stream(16 if o.quick else 32, src_layout)
    # warm-up: a whole round of large loads in flight at once (every slab takes a full
    # copy from both sources), then the start of the trace and a round of small loads
    warm = stream[:CONCURRENCY] + mixed[: 2 * CONCURRENCY] + small[:CONCURRENCY]
    return {"warm": warm, "unloaded": small, "mixed": mixed, "concurrent_small": small,
            "large_stream": stream}


def slots_needed(loads: Sequence[Load]) -> int:
    return sum(len(x.keys) for x in loads)


def requests_for(loads: Sequence[Load]) -> list[Request]:
    """One request per load, each into its own destination slots (consecutive from 0), so
    loads in flight never share a slot and every slot's final bytes are known."""
    out, slot = [], 0
    for x in loads:
        dests = dict(zip(x.keys, range(slot, slot + len(x.keys))))
        slot += len(x.keys)
        out.append({x.src: {layer: dests for layer in x.layers}})
    return out


def check_phase(caches: Mapping[Any, torch.Tensor], requests: Sequence[Request],
                expected: dict[int, dict[int, torch.Tensor]]) -> int:
    """Every block of every request against the source's known bytes, one comparison per
    (request, layer), so the temporaries stay under one batch; on a mismatch, the first
    wrong block is named (:func:`check_loaded`). Returns the number of blocks checked."""
    n = 0
    for req in requests:
        for src, layers in req.items():
            for layer, blocks in layers.items():
                cache = caches[layer]
                got = cache[torch.tensor(list(blocks.values()), device=cache.device)].cpu()
                want = expected[src][layer][torch.tensor(list(blocks))]
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    check_loaded(caches, req, expected)
                    raise AssertionError(f"blocks from rank {src} layer {layer} differ")  # pragma: no cover
                n += len(blocks)
    return n


async def replay(ep: Endpoint, requests: Sequence[Request], concurrency: int,
                 ) -> tuple[list[float], float]:
    """Run the requests with ``concurrency`` workers taking them in order; per-load seconds
    (in request order) and the wall time of the whole phase."""
    lat = [0.0] * len(requests)
    todo = iter(range(len(requests)))
    perf = time.perf_counter

    async def worker() -> None:
        for i in todo:
            t = perf()
            await ep.load(requests[i])
            lat[i] = perf() - t

    t0 = perf()
    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, len(requests))):
            tg.start_soon(worker)
    return lat, perf() - t0


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 in microseconds (nearest rank), and the count."""
    s = sorted(samples)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] * 1e6
    return {"p50_us": at(0.50), "p99_us": at(0.99), "n": len(s)}


# -- one run (one K) ----------------------------------------------------------------------------
@asynccontextmanager
async def sources(specs: Sequence[PeerSpec]) -> AsyncIterator[list[PeerProcess]]:
    """Start the source processes together; close every one that started."""
    started: list[PeerProcess] = []

    async def start(spec: PeerSpec) -> None:
        started.append(await anyio.to_thread.run_sync(PeerProcess, spec))

    try:
        async with anyio.create_task_group() as tg:
            for spec in specs:
                tg.start_soon(start, spec)
        yield sorted(started, key=lambda p: p.spec.rank)
    finally:
        for p in started:
            await anyio.to_thread.run_sync(p.close)


class Phases:
    """Run phases on one loader endpoint, checking each phase's bytes afterwards."""

    def __init__(self, ep: Endpoint, expected: dict[int, dict[int, torch.Tensor]]) -> None:
        self.ep, self.expected = ep, expected
        self.blocks_checked = self.loads_checked = 0

    async def run(self, loads: Sequence[Load], concurrency: int) -> tuple[list[float], float]:
        for t in self.ep.caches.values():
            t.zero_()  # a check cannot pass on bytes of an earlier phase
        reqs = requests_for(loads)
        lat, wall = await replay(self.ep, reqs, concurrency)
        self.blocks_checked += check_phase(self.ep.caches, reqs, self.expected)
        self.loads_checked += len(reqs)
        return lat, wall


async def run_k(o: BenchOptions, k: int | None, phases: dict[str, list[Load]], src_layout: LayoutSpec,
                device: str) -> dict[str, Any]:
    """All phases with ``k`` slabs per endpoint (None: the engine's default)."""
    # every (send slab, view, receive slab) is mapped as peers join, as a serving engine
    # would configure it: registrations are then flat whatever pairs the traffic uses
    base: dict[str, Any] = dict(full_bytes=o.full_bytes, small_bytes=o.small_bytes, map_eagerly=True)
    cfg = config_for(k, **base)
    cuda = device == "cuda"
    specs = [PeerSpec(rank=r, layout=src_layout, seed=o.seed, device="cuda:1" if cuda else "cpu",
                      config=config_kwargs(k, **base), hello_extras={RAW_COPIES: True},
                      torch_threads=None if cuda else 1) for r in SOURCES]
    mixed, stream, conc = phases["mixed"], phases["large_stream"], phases["concurrent_small"]
    loader_layout = LayoutSpec(layers=src_layout.layers, block_shape=src_layout.block_shape,
                               dtype=src_layout.dtype,
                               num_slots=max(slots_needed(p) for p in phases.values()))
    expected = {r: pattern_caches(src_layout, r, o.seed) for r in SOURCES}
    caches = zero_caches(loader_layout, "cuda:0" if cuda else "cpu")
    from ..transports.nixl import NixlTransport
    async with sources(specs) as peers:
        async with Endpoint(0, caches, NixlTransport(), cfg) as ep:
            for p in peers:
                await ep.connect(p.address)
            floor = stats(raw_floor(ep, SOURCES[0], o.full_bytes, 20 if o.quick else 50))
            ph = Phases(ep, expected)
            await ph.run(phases["warm"], CONCURRENCY)
            pids = {"loader": os.getpid(), **{f"source{p.spec.rank}": p.proc.pid for p in peers}}

            async def registrations() -> dict[str, int]:
                out = {"loader": ep.snapshot_metrics()["registrations"]}
                for p in peers:
                    m = await anyio.to_thread.run_sync(p.call, "metrics")
                    out[f"source{p.spec.rank}"] = m["registrations"]
                return out

            regs0, mem0 = await registrations(), _sample(pids)
            unloaded, _ = await ph.run(phases["unloaded"], 1)
            mixed_lat, mixed_wall = await ph.run(mixed, CONCURRENCY)
            _, small_wall = await ph.run(conc, CONCURRENCY)
            _, stream_wall = await ph.run(stream, CONCURRENCY)
            regs1, mem1 = await registrations(), _sample(pids)
    useful = _useful(mixed, src_layout)
    stream_useful = _useful(stream, src_layout)
    full_rate = o.full_bytes / (floor["median_us"] * 1e-6)
    unloaded_small = percentiles(unloaded)
    mixed_small = percentiles([t for t, x in zip(mixed_lat, mixed) if not x.large])
    return {
        **slab_counts(cfg),
        "raw_full_copy": {**floor, "gbps": full_rate / 1e9},
        "unloaded_small": unloaded_small,
        "mixed": {"loads": len(mixed), "useful_bytes": useful, "seconds": mixed_wall,
                  "useful_gbps": useful / mixed_wall / 1e9, "loads_per_s": len(mixed) / mixed_wall,
                  "small": mixed_small,
                  "large": percentiles([t for t, x in zip(mixed_lat, mixed) if x.large])},
        "small_p99_mixed_over_unloaded_p50": mixed_small["p99_us"] / unloaded_small["p50_us"],
        "concurrent_small": {"loads": len(conc), "seconds": small_wall,
                             "loads_per_s": len(conc) / small_wall},
        "large_stream": {"loads": len(stream), "useful_bytes": stream_useful, "seconds": stream_wall,
                         "useful_gbps": stream_useful / stream_wall / 1e9,
                         "vs_raw_full_copy": stream_useful / stream_wall / full_rate},
        "registrations_after_warmup": {name: regs1[name] - regs0[name] for name in regs0},
        "rss_growth_bytes": {name: (mem1[name]["rss_kib"] - mem0[name]["rss_kib"]) * 1024 for name in pids},
        "loader_slots": loader_layout.num_slots,
        # check_phase raises on a wrong byte: reaching here means every block matched
        "bytes_checked": {"loads": ph.loads_checked, "blocks": ph.blocks_checked, "ok": True},
    }


def _useful(loads: Sequence[Load], layout: LayoutSpec) -> int:
    return sum(x.blocks for x in loads) * layout.block_nbytes


# -- the section --------------------------------------------------------------------------------
async def serving(o: BenchOptions, report: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The section: K=1 and the default K side by side, with the issue's targets."""
    if o.transport != "nixl":
        return {"skipped": "the serving section runs three processes over NIXL (--transport nixl)"}
    device = o.resolved_device()
    src_layout = bench_layout(o.full_bytes)
    phases = phase_loads(o, src_layout)
    mixed = phases["mixed"]
    default_k = slab_counts(config_for(None, full_bytes=o.full_bytes, small_bytes=o.small_bytes))
    runs = {}
    for name, k in (("k1", 1), ("default", None)):
        report(f"serving {name}")
        runs[name] = await run_k(o, k, phases, src_layout, device)
    out: dict[str, Any] = {
        "concurrency": CONCURRENCY, "device": device,
        "default_slabs": default_k,
        "trace": {"loads": len(mixed), "large": sum(x.large for x in mixed),
                  "useful_bytes": _useful(mixed, src_layout), "block_bytes": src_layout.block_nbytes,
                  "layers": src_layout.layers},
        "runs": runs,
        "concurrent_small_default_over_k1": (runs["default"]["concurrent_small"]["loads_per_s"]
                                             / runs["k1"]["concurrent_small"]["loads_per_s"]),
    }
    out["targets"] = serving_targets(out, o.full_bytes)
    return out


def serving_targets(s: dict[str, Any], full_bytes: int) -> dict[str, dict[str, Any]]:
    """The issue's targets, as ratios measured in this run (docs/benchmarks.md)."""
    d, runs = s["runs"]["default"], s["runs"].values()
    return {
        "small_p99_mixed_vs_unloaded_p50": target(d["small_p99_mixed_over_unloaded_p50"], 3.0),
        "concurrent_small_loads_per_s_vs_k1": target(s["concurrent_small_default_over_k1"], 3.0, le=False),
        "large_stream_vs_raw_full_copy": target(d["large_stream"]["vs_raw_full_copy"], 0.70, le=False),
        "serving_registrations_after_warmup": target(
            max(v for r in runs for v in r["registrations_after_warmup"].values()), 0),
        # flat: less than one full slab over all phases, in every process
        "serving_rss_growth_bytes": target(max(v for r in runs for v in r["rss_growth_bytes"].values()),
                                           full_bytes),
        "serving_bytes_checked": target(sum(r["bytes_checked"]["blocks"] for r in runs), 1, le=False),
    }


# -- report -------------------------------------------------------------------------------------
def serving_tables(s: dict[str, Any]) -> list[tuple[str, list[list[str]], list[str]]]:
    """(title, rows, header) for the report: K=1 and default K side by side, the targets."""
    for why in ("skipped", "error"):
        if why in s:
            return [("Serving load", [[s[why]]], [why])]
    k1, d = s["runs"]["k1"], s["runs"]["default"]

    def row(label: str, get: Callable[[dict[str, Any]], Any], fmt: str = "{:.1f}") -> list[str]:
        a, b = get(k1), get(d)
        return [label, fmt.format(a), fmt.format(b), f"{b / a:.2f}x" if a else "-"]

    rows = [
        row("small p50 unloaded (us)", lambda r: r["unloaded_small"]["p50_us"]),
        row("small p99 unloaded (us)", lambda r: r["unloaded_small"]["p99_us"]),
        row("small p50 mixed (us)", lambda r: r["mixed"]["small"]["p50_us"]),
        row("small p99 mixed (us)", lambda r: r["mixed"]["small"]["p99_us"]),
        row("small p99 mixed / p50 unloaded", lambda r: r["small_p99_mixed_over_unloaded_p50"], "{:.2f}"),
        row("large p50 mixed (us)", lambda r: r["mixed"]["large"]["p50_us"]),
        row("mixed useful GB/s", lambda r: r["mixed"]["useful_gbps"], "{:.3f}"),
        row("mixed loads/s", lambda r: r["mixed"]["loads_per_s"], "{:.0f}"),
        row(f"{s['concurrency']} concurrent small: loads/s", lambda r: r["concurrent_small"]["loads_per_s"],
            "{:.0f}"),
        row("large stream useful GB/s", lambda r: r["large_stream"]["useful_gbps"], "{:.3f}"),
        row("raw NIXL full copy GB/s", lambda r: r["raw_full_copy"]["gbps"], "{:.3f}"),
        row("large stream / raw full copy", lambda r: r["large_stream"]["vs_raw_full_copy"], "{:.2f}"),
        row("registrations after warm-up", lambda r: sum(r["registrations_after_warmup"].values()), "{}"),
        row("max RSS growth (KiB)", lambda r: max(r["rss_growth_bytes"].values()) / 1024, "{:.0f}"),
        row("blocks checked", lambda r: r["bytes_checked"]["blocks"], "{}"),
    ]
    t = s["trace"]
    title = (f"Serving load: {t['loads']} loads ({t['large']} large, {t['useful_bytes'] / 1e6:.1f} MB) from "
             f"2 sources, {s['concurrency']} in flight, {s['device']}; K=1 vs default K "
             f"(receive/send slabs {d['receive_slabs']}/{d['send_slabs']})")
    target_rows = [[k, f"{v['value']:.3g}", f"{'<=' if k not in _AT_LEAST else '>='} {v['limit']:.3g}",
                    "met" if v["met"] else "MISSED"] for k, v in s["targets"].items()]
    return [(title, rows, ["", "K=1", f"K={d['receive_slabs']}", "K / K=1"]),
            ("Serving targets", target_rows, ["target", "value", "limit", ""])]


_AT_LEAST = {"concurrent_small_loads_per_s_vs_k1", "large_stream_vs_raw_full_copy", "serving_bytes_checked"}


def plot_serving(ax: Any, s: dict[str, Any]) -> None:
    """Bars: small-load p50 and p99, unloaded vs mixed, for K=1 and the default K."""
    runs = s["runs"]
    groups = [("unloaded", "unloaded_small"), ("mixed", "mixed")]
    labels, p50, p99 = [], [], []
    for name, r in runs.items():
        k = "K=1" if name == "k1" else f"K={r['receive_slabs']}"
        for g, key in groups:
            st = r[key] if key == "unloaded_small" else r[key]["small"]
            labels.append(f"{k}\n{g}")
            p50.append(st["p50_us"])
            p99.append(st["p99_us"])
    x = list(range(len(labels)))
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="p50", color="#1f77b4")
    ax.bar([i + 0.2 for i in x], p99, width=0.4, label="p99", color="#d62728")
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("small load latency (us, log)")
    ax.set_title(f"Small loads, unloaded vs mixed trace ({s['concurrency']} in flight)")
    ax.legend()


__all__ = ["serving", "serving_targets", "serving_tables", "plot_serving", "config_for", "config_kwargs",
           "slab_counts", "phase_loads", "check_phase", "requests_for", "CONCURRENCY"]

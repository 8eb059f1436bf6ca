"""The serving-load section of ``xavier-async bench``: many loads in flight between processes.

Two topologies (``BenchOptions.serving_topology``; ``auto`` picks ``duplex`` on CUDA and
``three`` on DRAM):

* ``three``: this process is the loader (rank 0); ranks 1 and 2 are sources, each a
  :class:`~xavier_async.testing.PeerProcess` whose caches hold known bytes. The loader
  replays the seed-shaped trace (:func:`~xavier_async.bench.common.make_trace`: a few cold
  loads near the full slab among many warm small ones) as real :meth:`Endpoint.load` calls
  with :data:`CONCURRENCY` requests in flight, each load from one of the two sources.
* ``duplex`` (the GPU pair: one process per GPU): two endpoints that both load and serve
  at once. Rank 0 (this process) replays the trace as loads from rank 1 (a PeerProcess on
  the other GPU) while rank 1 replays a mirrored trace (same sizes, its own seed) as loads
  from rank 0, each with :data:`CONCURRENCY` in flight. Each side's caches are split: the
  low slots hold its pattern bytes (published, served to the other side), the high slots
  are the destination of its own loads. Rank 1's figures are under ``"peer"``.

It runs three times, side by side (:data:`RUNS`): ``seed``, one receive slab and one send
slab per endpoint with nothing merged (the seed's one-batch-at-a-time design); ``k1``, one
slab each way with batches that wait for it merged (``EndpointConfig.merge_loads``, the
default); ``default``, the endpoint's defaults (``receive_slabs``/``send_slabs`` K, merging
on). The targets compare ``default`` with ``seed``; ``k1`` shows what merging alone gives.
With ``BenchOptions.serving_rounds`` N > 1 the three runs are repeated N times, alternated
(round r starts r runs later), and each figure is the median over the rounds
(:func:`median_run`); the throughput target is the median of the rounds' own ratios, and
``"spread"`` gives every target's value per round (hosts whose runs differ by 2x need it).

Per run, phases (each with its own destination slots, all checked byte for byte after
the phase, outside the timings, on both sides in duplex):

* warm-up: a round of large loads all in flight at once, the start of the trace and a
  round of concurrent small loads (both views used on every slab, from every source; in
  duplex both directions at once); registrations and RSS of every process are sampled
  after it;
* unloaded: the trace's small loads alone, one at a time (latency p50/p99; in duplex
  rank 0's, then rank 1's, never both at once);
* mixed: the whole trace, 16 in flight (useful GB/s, loads/s, small-load p50/p99);
* concurrent small: the trace's small loads, 16 in flight (loads/s);
* large stream: full-slab loads, 16 in flight, aggregate useful bandwidth against the
  raw NIXL full-copy rate measured in the same run (rank 0 to its first peer).
"""

from __future__ import annotations

import functools
import os
import random
import statistics
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
import torch

from ..endpoint import Endpoint, EndpointConfig
from ..slabs import MiB
from ..stages import LoadStages
from ..testing.devices import peer_device
from ..testing.hostprof import ENV as HOST_PROFILE_ENV
from ..testing.hostprof import HostProfile
from ..testing.peer_process import LayoutSpec, PeerProcess, PeerSpec, check_requests, pattern_caches, \
    replay_loads, replay_open_loop, split_caches, zero_caches
from ..transports.nixl_bulk import default_bulk_bytes
from ..transports.nixl_copies import PIECE_BYTES
from . import schedstat
from .raw import RAW_COPIES, raw_floor
from .soak import _rss_kib
from .common import BenchOptions, bench_layout, make_trace, nearest_rank, stats, target

#: loads in flight, as in the seed's deployment
CONCURRENCY = 16
SOURCES = (1, 2)
#: the serving topologies (module docstring)
TOPOLOGIES = ("three", "duplex")
#: the EndpointConfig fields of the slab counts
SLAB_FIELDS = ("receive_slabs", "send_slabs")
#: the runs, side by side: (name, slabs each way (None: the default, or --serving-slabs), merge_loads)
RUNS = (("seed", 1, False), ("k1", 1, True), ("default", None, True))
#: seconds a peer process may take for one phase (its replay or its check)
PEER_TIMEOUT = 600.0

Request = dict[int, dict[int, dict[int, int]]]
Timing = tuple[list[float], float]


def resolve_topology(o: BenchOptions, device: str) -> str:
    """``o.serving_topology``, with ``auto``: duplex on CUDA (one process per GPU), else three."""
    t = o.serving_topology
    if t == "auto":
        return "duplex" if device == "cuda" else "three"
    if t not in TOPOLOGIES:
        raise ValueError(f"serving topology must be auto, three or duplex, got {t!r}")
    return t


# -- configuration ----------------------------------------------------------------------------
def config_kwargs(k: int | None, merge: bool = True, **base: Any) -> dict[str, Any]:
    """EndpointConfig keyword arguments: ``base`` plus ``receive_slabs=k, send_slabs=k``
    (``k=None`` keeps the engine's defaults) and ``merge_loads=merge``."""
    out = dict(base, merge_loads=merge)
    if k is not None:
        out.update({name: k for name in SLAB_FIELDS})
    return out


def config_for(k: int | None, merge: bool = True, **base: Any) -> EndpointConfig:
    """The loader's and the sources' config for ``k`` slabs (see :func:`config_kwargs`)."""
    return EndpointConfig(**config_kwargs(k, merge, **base))


def endpoint_base(o: BenchOptions, merge: bool) -> dict[str, Any]:
    """The EndpointConfig fields of every endpoint of a run, before K and merging: the
    sizes, ``--serving-trimmed``, ``--serving-copy-threads``, ``--serving-split-copies``,
    ``--serving-direct-write-regions``, ``--serving-merge-small`` and ``--serving-small-trips``
    (merged runs only), and every
    (send slab, view, receive slab) mapped as peers join, as a serving engine would
    configure it (registrations are then flat whatever pairs the traffic uses)."""
    base: dict[str, Any] = dict(full_bytes=o.full_bytes, small_bytes=o.small_bytes, map_eagerly=True)
    if o.serving_trimmed:
        base["trimmed"] = True
    if o.serving_copy_threads is not None:
        base["copy_threads"] = o.serving_copy_threads
    if o.serving_split_copies:
        base["split_copies"] = True
    if o.serving_direct_write_regions is not None:
        base["direct_write_regions"] = o.serving_direct_write_regions
    if merge and o.serving_merge_small is not None:
        base["merge_small_bytes"] = o.serving_merge_small
    if merge and o.serving_small_trips is not None:
        base["small_round_trips"] = o.serving_small_trips
    return base


def transport_kwargs(o: BenchOptions) -> dict[str, Any]:
    """The NixlTransport keyword arguments of every serving endpoint
    (``--serving-piece-bytes``, ``--serving-bulk-bytes``)."""
    out: dict[str, Any] = {}
    if o.serving_piece_bytes is not None:
        out["piece_bytes"] = o.serving_piece_bytes
    if o.serving_bulk_bytes is not None:
        out["bulk_bytes"] = o.serving_bulk_bytes
    return out


def slab_counts(cfg: EndpointConfig) -> dict[str, Any]:
    """Receive and send slabs per endpoint, how waiting batches are merged, and whether
    copies are trimmed."""
    return {"receive_slabs": cfg.receive_slabs, "send_slabs": cfg.send_slabs,
            "merge_loads": cfg.merge_loads, "merge_small_bytes": cfg.merge_small_bytes,
            "small_round_trips": cfg.small_round_trips,
            "trimmed": cfg.trimmed, "copy_threads": cfg.copy_threads,
            "split_copies": cfg.split_copies, "direct_write_regions": cfg.direct_write_regions}


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


def trace_loads(o: BenchOptions, src_layout: LayoutSpec, sources: Sequence[int] = SOURCES,
                seed: int | None = None) -> list[Load]:
    """The seed-shaped trace as loads, each from a random one of ``sources`` (seeded by
    ``seed``, default ``o.seed``: the trace's sizes and order and the keys chosen)."""
    seed = o.seed if seed is None else seed
    rng = random.Random(seed + 11)
    out = []
    for b in make_trace(o.trace_batches, o.trace_large, src_layout, o.full_bytes, o.small_bytes, seed):
        layers = range(src_layout.layers) if b.large else sorted(rng.sample(range(src_layout.layers),
                                                                             b.layers))
        out.append(Load(rng.choice(sources), tuple(rng.sample(range(src_layout.num_slots), b.keys)),
                        tuple(layers), b.large))
    return out


def large_stream(n: int, src_layout: LayoutSpec, sources: Sequence[int] = SOURCES) -> list[Load]:
    """``n`` full-slab loads (every published block x every layer), sources alternating."""
    keys = tuple(range(src_layout.num_slots // 2))
    return [Load(sources[i % len(sources)], keys, tuple(range(src_layout.layers)), True) for i in range(n)]


def phase_loads(o: BenchOptions, src_layout: LayoutSpec, sources: Sequence[int] = SOURCES,
                seed: int | None = None) -> dict[str, list[Load]]:
    """The loads of each phase, in the order they run (the same for every K)."""
    mixed = trace_loads(o, src_layout, sources, seed)
    small = [x for x in mixed if not x.large]
    stream = large_stream(16 if o.quick else 32, src_layout, sources)
    # warm-up: a whole round of large loads in flight at once (every slab takes a full
    # copy from every source), then the start of the trace and a round of small loads
    warm = stream[:CONCURRENCY] + mixed[: 2 * CONCURRENCY] + small[:CONCURRENCY]
    return {"warm": warm, "unloaded": small, "mixed": mixed, "concurrent_small": small,
            "large_stream": stream}


def duplex_phases(o: BenchOptions, src_layout: LayoutSpec) -> tuple[dict[str, list[Load]], dict[str, list[Load]]]:
    """Duplex: rank 0's phases (the trace of ``o.seed``, from rank 1) and rank 1's mirrored
    phases (the trace of ``o.seed + 1``: same counts, its own sizes and keys, from rank 0)."""
    return phase_loads(o, src_layout, (1,)), phase_loads(o, src_layout, (0,), o.seed + 1)


def slots_needed(loads: Sequence[Load]) -> int:
    return sum(len(x.keys) for x in loads)


def requests_for(loads: Sequence[Load], base: int = 0) -> list[Request]:
    """One request per load, each into its own destination slots (consecutive from
    ``base``), so loads in flight never share a slot and every slot's final bytes are known."""
    out, slot = [], base
    for x in loads:
        dests = dict(zip(x.keys, range(slot, slot + len(x.keys))))
        slot += len(x.keys)
        out.append({x.src: {layer: dests for layer in x.layers}})
    return out


#: every block of every request against the source's bytes (raises naming the first wrong one)
check_phase = check_requests

#: the requests with ``concurrency`` workers; per-load seconds and the wall time
replay = replay_loads


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 in microseconds (nearest rank), and the count."""
    s = sorted(samples)
    return {"p50_us": nearest_rank(s, 0.50) * 1e6, "p99_us": nearest_rank(s, 0.99) * 1e6,
            "n": len(s)}


# -- one run (one K) ----------------------------------------------------------------------------
@asynccontextmanager
async def sources(specs: Sequence[PeerSpec]) -> AsyncIterator[list[PeerProcess]]:
    """Start the peer processes together; close every one that started."""
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


@asynccontextmanager
async def installed(profile: HostProfile | None) -> AsyncIterator[HostProfile | None]:
    """``profile`` installed in this process for the block (nothing when None)."""
    if profile is None:
        yield None
        return
    profile.install()
    try:
        yield profile
    finally:
        profile.uninstall()


async def _peer_call(p: PeerProcess, cmd: str, arg: Any = None) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(p.call, cmd, arg, PEER_TIMEOUT))


class Phases:
    """Run phases on this endpoint (loads into slots ``base`` and up), checking each
    phase's bytes afterwards, then zeroing those slots so a later check cannot pass on
    them. With a ``peer`` (duplex), the peer process replays its own loads at the same
    time (``replay``) and checks them afterwards (``check_replay``)."""

    def __init__(self, ep: Endpoint, expected: dict[int, dict[int, torch.Tensor]], base: int = 0,
                 peer: PeerProcess | None = None) -> None:
        self.ep, self.expected, self.base, self.peer = ep, expected, base, peer
        self.blocks_checked = self.loads_checked = 0
        self.peer_checked = {"loads": 0, "blocks": 0}

    async def run(self, loads: Sequence[Load], concurrency: int,
                  peer_loads: Sequence[Load] | None = None,
                  replayed: Callable[[], Awaitable[None]] | None = None,
                  rate: float | None = None) -> tuple[Timing, Timing | None]:
        """This side's timing and (with ``peer_loads``) the peer's, both sides' loads in
        flight at once; an empty ``loads`` runs the peer's alone. ``replayed`` is awaited
        once both sides are done, before the bytes are checked. With ``rate``, this
        side's loads arrive open loop (Poisson, ``rate`` per second) instead of through
        ``concurrency`` workers."""
        reqs = requests_for(loads, self.base)
        theirs: list[Timing] = []

        async def peer_side(p: PeerProcess, requests: list[Request]) -> None:
            r = await _peer_call(p, "replay", {"requests": requests, "concurrency": concurrency})
            theirs.append((r["latencies"], r["wall"]))

        async with anyio.create_task_group() as tg:
            if peer_loads is not None:
                assert self.peer is not None, "peer loads need a peer"
                # the same destination layout on the peer: its loads land from ``base`` up
                tg.start_soon(peer_side, self.peer, requests_for(peer_loads, self.base))
            if not reqs:
                mine: Timing = ([], 0.0)
            elif rate is not None:
                mine = await replay_open_loop(self.ep, reqs, rate, seed=len(reqs))
            else:
                mine = await replay(self.ep, reqs, concurrency)
        if replayed is not None:
            await replayed()
        self.blocks_checked += check_phase(self.ep.caches, reqs, self.expected)
        self.loads_checked += len(reqs)
        for t in self.ep.caches.values():
            t[self.base:].zero_()
        _sync(self.ep.caches)  # zeroed before the next phase's loads write there
        if peer_loads is not None:
            assert self.peer is not None
            c = await _peer_call(self.peer, "check_replay")
            self.peer_checked = {k: self.peer_checked[k] + c[k] for k in ("loads", "blocks")}
        return mine, (theirs[0] if theirs else None)


def _sync(caches: Any) -> None:
    """On CUDA, wait for the caches' device (work queued on its current stream)."""
    for device in {t.device for t in caches.values() if t.is_cuda}:
        torch.cuda.synchronize(device)


def side_figures(ph: dict[str, list[Load]], t: dict[str, Timing], layout: LayoutSpec) -> dict[str, Any]:
    """One loading side's latencies and rates from its phases' timings."""
    mixed, stream, conc = ph["mixed"], ph["large_stream"], ph["concurrent_small"]
    (unloaded, _), (mixed_lat, mixed_wall) = t["unloaded"], t["mixed"]
    small_wall, stream_wall = t["concurrent_small"][1], t["large_stream"][1]
    useful, stream_useful = _useful(mixed, layout), _useful(stream, layout)
    unloaded_small = percentiles(unloaded)
    mixed_small = percentiles([s for s, x in zip(mixed_lat, mixed) if not x.large])
    return {
        "unloaded_small": unloaded_small,
        "mixed": {"loads": len(mixed), "useful_bytes": useful, "seconds": mixed_wall,
                  "useful_gbps": useful / mixed_wall / 1e9, "loads_per_s": len(mixed) / mixed_wall,
                  "small": mixed_small,
                  "large": percentiles([s for s, x in zip(mixed_lat, mixed) if x.large])},
        "small_p99_mixed_over_unloaded_p50": mixed_small["p99_us"] / unloaded_small["p50_us"],
        "concurrent_small": {"loads": len(conc), "seconds": small_wall,
                             "loads_per_s": len(conc) / small_wall},
        "large_stream": {"loads": len(stream), "useful_bytes": stream_useful, "seconds": stream_wall,
                         "useful_gbps": stream_useful / stream_wall / 1e9},
    }


async def run_k(o: BenchOptions, k: int | None, phases: dict[str, list[Load]], src_layout: LayoutSpec,
                device: str, peer_phases: dict[str, list[Load]] | None = None,
                merge: bool = True) -> dict[str, Any]:
    """All phases with ``k`` slabs per endpoint (None: the engine's default) and
    ``merge_loads=merge``. Without ``peer_phases``: the three-process topology; with them:
    duplex, rank 1 replaying them."""
    base = endpoint_base(o, merge)
    cfg = config_for(k, merge, **base)
    cuda, duplex = device == "cuda", peer_phases is not None
    published = src_layout.num_slots
    dest = max(slots_needed(p) for p in [*phases.values(), *(peer_phases or {}).values()])
    ranks, dest_base = ((1,), published) if duplex else (SOURCES, 0)
    layout = replace(src_layout, num_slots=dest_base + dest)
    profile = HostProfile() if o.serving_host_profile else None
    transport = transport_kwargs(o)
    specs = [PeerSpec(rank=r, layout=layout if duplex else src_layout, seed=o.seed,
                      device=peer_device(1, device).device, config=config_kwargs(k, merge, **base),
                      transport=transport,
                      env={HOST_PROFILE_ENV: "1"} if profile is not None else None,
                      hello_extras={RAW_COPIES: True}, torch_threads=None if cuda else 1,
                      published=published if duplex else None) for r in ranks]
    expected = {r: pattern_caches(src_layout, r, o.seed) for r in ranks}
    here = peer_device(0, device).device
    caches = split_caches(layout, published, 0, o.seed, here) if duplex else zero_caches(layout, here)
    from ..transports.nixl import NixlTransport
    # (the profile is installed before this process's NIXL agent is made: its calls count)
    async with installed(profile), sources(specs) as peers:
        async with Endpoint(0, caches, NixlTransport(**transport), cfg) as ep:
            if duplex:
                for slot in range(published):
                    ep.publish(slot, slot)
            for p in peers:
                await ep.connect(p.address)
            if duplex:  # rank 1 loads from rank 0 only once it knows rank 0
                with anyio.fail_after(30):
                    while 0 not in await _peer_call(peers[0], "peers"):
                        await anyio.sleep(0.01)
            floor = stats(raw_floor(ep, ranks[0], o.full_bytes, 20 if o.quick else 50))
            ph = Phases(ep, expected, dest_base, peers[0] if duplex else None)
            names = {0: "rank0" if duplex else "loader",
                     **{p.spec.rank: f"rank{p.spec.rank}" if duplex else f"source{p.spec.rank}" for p in peers}}
            pids = {names[0]: os.getpid(), **{names[p.spec.rank]: p.proc.pid for p in peers}}

            async def registrations() -> dict[str, int]:
                out = {names[0]: ep.snapshot_metrics()["registrations"]}
                for p in peers:
                    out[names[p.spec.rank]] = (await _peer_call(p, "metrics"))["registrations"]
                return out

            def rss() -> dict[str, int]:
                return {name: _rss_kib(pid) for name, pid in pids.items()}

            def theirs(name: str) -> list[Load] | None:
                return None if peer_phases is None else peer_phases[name]

            async def stage_snapshots() -> dict[str, LoadStages]:
                out = {names[0]: LoadStages.from_dict(ep.snapshot_metrics().get("stages", {}))}
                for p in peers:
                    out[names[p.spec.rank]] = LoadStages.from_dict(
                        (await _peer_call(p, "metrics")).get("stages", {}))
                return out

            async def host_times(reset: bool) -> dict[str, Any]:
                """Each process's host-time profile since its last reset (then reset)."""
                if profile is None:
                    return {}
                out = {names[0]: profile.snapshot()}
                for p in peers:
                    out[names[p.spec.rank]] = await _peer_call(p, "host_time", reset)
                if reset:
                    profile.reset()
                return out

            mine: dict[str, Timing] = {}
            peer_t: dict[str, Timing] = {}
            stages: dict[str, Any] = {}
            host_time: dict[str, Any] = {}
            cpu: dict[str, Any] = {}   # per phase, per process: on a core / waiting for one
            await ph.run(phases["warm"], CONCURRENCY, theirs("warm"))
            regs0, mem0 = await registrations(), rss()
            with schedstat.measured(pids, cpu, "unloaded"):
                mine["unloaded"], _ = await ph.run(phases["unloaded"], 1)
            if duplex:  # rank 1's unloaded latencies: its loads alone, one at a time
                _, pt = await ph.run([], 1, theirs("unloaded"))
                assert pt is not None
                peer_t["unloaded"] = pt
            for name in ("mixed", "concurrent_small", "large_stream"):
                before = await stage_snapshots()
                await host_times(reset=True)

                async def replayed(phase: str = name) -> None:
                    if profile is not None:
                        host_time[phase] = await host_times(reset=False)

                with schedstat.measured(pids, cpu, name):
                    mine[name], pt = await ph.run(phases[name], CONCURRENCY, theirs(name), replayed)
                after = await stage_snapshots()
                stages[name] = {proc: stage_summary(after[proc].minus(before[proc]).as_dict())
                                for proc in after}
                if pt is not None:
                    peer_t[name] = pt
            # the mixed trace again, open loop: Poisson arrivals at half the rate it ran at
            # closed loop above (issue 24's latency under load)
            rate = 0.5 * len(phases["mixed"]) / mine["mixed"][1]
            with schedstat.measured(pids, cpu, "open_loop"):
                mine["open_loop"], _ = await ph.run(phases["mixed"], CONCURRENCY, rate=rate)
            regs1, mem1 = await registrations(), rss()
            # WRITEs each process posted through its bulk agent (nixl_bulk)
            bulk_posts = {names[0]: getattr(ep.transport, "bulk_posts", 0)}
            for p in peers:
                bulk_posts[names[p.spec.rank]] = (await _peer_call(p, "transport_stats"))["bulk_posts"]
    full_rate = o.full_bytes / (floor["median_us"] * 1e-6)
    out = {**slab_counts(cfg), "topology": "duplex" if duplex else "three",
           "piece_bytes": transport.get("piece_bytes", PIECE_BYTES),
           "bulk_bytes": transport.get("bulk_bytes", default_bulk_bytes()),
           "raw_full_copy": {**floor, "gbps": full_rate / 1e9},
           **side_figures(phases, mine, src_layout)}
    ls = out["large_stream"]
    ls["vs_raw_full_copy"] = ls["useful_bytes"] / ls["seconds"] / full_rate
    open_lat = [x for x, load in zip(mine["open_loop"][0], phases["mixed"]) if not load.large]
    out["open_loop"] = {"rate_per_s": rate, "loads": len(phases["mixed"]),
                        "small": percentiles(open_lat),
                        "small_p99_over_unloaded_p50":
                            percentiles(open_lat)["p99_us"] / out["unloaded_small"]["p50_us"]}
    # 16 small loads in flight against one at a time (the unloaded phase's p50 per load)
    out["concurrent_small"]["vs_one_at_a_time"] = (
        out["concurrent_small"]["loads_per_s"] * out["unloaded_small"]["p50_us"] * 1e-6)
    out.update({
        "registrations_after_warmup": {name: regs1[name] - regs0[name] for name in regs0},
        "rss_growth_bytes": {name: (mem1[name] - mem0[name]) * 1024 for name in pids},
        "loader_slots": dest,
        "bulk_posts": bulk_posts,
        # per phase, per process: each stage's host time during that phase
        "stages": stages,
        **({"host_time": host_time} if profile is not None else {}),
        # per phase, per process: cpu seconds and seconds runnable but waiting for a core
        **({"cpu": cpu} if cpu else {}),
        # check_phase raises on a wrong byte: reaching here means every block matched
        "bytes_checked": {"loads": ph.loads_checked, "blocks": ph.blocks_checked, "ok": True},
    })
    if peer_phases is not None:
        peer = side_figures(peer_phases, peer_t, src_layout)
        peer["bytes_checked"] = {**ph.peer_checked, "ok": True}  # check_replay raises on a wrong byte
        out["peer"] = peer
        # both directions at once: the useful bytes of both sides over the longer side's time
        out["both_directions"] = {
            f"{name}_useful_gbps": (out[name]["useful_bytes"] + peer[name]["useful_bytes"])
            / max(out[name]["seconds"], peer[name]["seconds"]) / 1e9 for name in ("mixed", "large_stream")}
    return out


def stage_summary(stages: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """The stages that ran, as ``n``, ``p50_us`` and ``mean_us`` (no buckets)."""
    return {side: {name: {k: h[k] for k in ("n", "p50_us", "mean_us")} for name, h in d.items() if h.get("n")}
            for side, d in stages.items()}


def _useful(loads: Sequence[Load], layout: LayoutSpec) -> int:
    return sum(x.blocks for x in loads) * layout.block_nbytes


# -- the section --------------------------------------------------------------------------------
async def serving(o: BenchOptions, report: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The section: the :data:`RUNS` side by side (the default K, or ``o.serving_slabs``),
    with the issue's targets."""
    if o.transport != "nixl":
        return {"skipped": "the serving section runs two or three processes over NIXL (--transport nixl)"}
    device = o.resolved_device()
    topology = resolve_topology(o, device)
    src_layout = bench_layout(o.full_bytes)
    phases, peer_phases = (duplex_phases(o, src_layout) if topology == "duplex"
                           else (phase_loads(o, src_layout), None))
    mixed = phases["mixed"]
    default_k = slab_counts(config_for(o.serving_slabs, **endpoint_base(o, merge=True)))
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(o.serving_rounds):
        # round r starts r places later in RUNS: each run takes every position in turn, so
        # that a host that drifts (warms up, or gets busier) favours none of them
        order = RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]
        rounds.append({})
        for name, k, merge in order:
            report(f"serving {name}" + (f" (round {r + 1} of {o.serving_rounds})"
                                        if o.serving_rounds > 1 else ""))
            rounds[-1][name] = await run_k(o, o.serving_slabs if k is None else k, phases, src_layout,
                                           device, peer_phases, merge)
    runs = {name: median_run([rd[name] for rd in rounds]) for name, _, _ in RUNS}
    out: dict[str, Any] = {
        "concurrency": CONCURRENCY, "device": device, "topology": topology,
        "small_bytes": o.small_bytes,
        "default_slabs": default_k,
        "slabs_default": o.serving_slabs is None,
        "trace": {"loads": len(mixed), "large": sum(x.large for x in mixed),
                  "useful_bytes": _useful(mixed, src_layout), "block_bytes": src_layout.block_nbytes,
                  "layers": src_layout.layers},
        "rounds": len(rounds),
        "runs": runs,
        # the target: against the seed's design; and what the slab pools add to merging
        # (each the median of the ratios within a round, whose runs were back to back)
        "concurrent_small_default_over_seed": _median_ratio(rounds, "default", "seed"),
        "concurrent_small_default_over_k1": _median_ratio(rounds, "default", "k1"),
    }
    if len(rounds) > 1:
        out["round_runs"] = rounds
        out["spread"] = round_spread(rounds)
    out["targets"] = serving_targets(out, o.full_bytes)
    return out


def _loads_per_s(run: dict[str, Any]) -> float:
    return float(run["concurrent_small"]["loads_per_s"])


def _median_ratio(rounds: Sequence[dict[str, dict[str, Any]]], a: str, b: str) -> float:
    return statistics.median(_loads_per_s(rd[a]) / _loads_per_s(rd[b]) for rd in rounds)


#: the figures whose spread over rounds is reported: (name, its value in one round)
SPREAD: tuple[tuple[str, Callable[[dict[str, dict[str, Any]]], float]], ...] = (
    ("small_p99_mixed_vs_unloaded_p50", lambda rd: rd["default"]["small_p99_mixed_over_unloaded_p50"]),
    ("concurrent_small_loads_per_s_vs_seed", lambda rd: _loads_per_s(rd["default"]) / _loads_per_s(rd["seed"])),
    ("large_stream_vs_raw_full_copy", lambda rd: rd["default"]["large_stream"]["vs_raw_full_copy"]),
    ("default_concurrent_small_loads_per_s", lambda rd: _loads_per_s(rd["default"])),
    ("seed_concurrent_small_loads_per_s", lambda rd: _loads_per_s(rd["seed"])),
)


def round_spread(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per target figure: its value in each round, and the least and the most."""
    out = {}
    for name, get in SPREAD:
        values = [float(get(rd)) for rd in rounds]
        out[name] = {"values": values, "min": min(values), "max": max(values)}
    return out


#: counters whose worst round is kept (flatness must hold in every round), not the median
_WORST = frozenset({"registrations_after_warmup", "rss_growth_bytes"})
#: counters summed over rounds (every round's bytes were checked)
_SUMMED = frozenset({"bytes_checked"})
_WORST_OR_SUM = {**{k: "worst" for k in _WORST}, **{k: "sum" for k in _SUMMED}}
#: kept from the first round (tables of their own, not figures)
_KEPT = frozenset({"stages", "host_time"})


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from several rounds of it: each number the median over the rounds
    (an ``int`` stays an ``int``: the lower median); registrations and RSS growth the worst
    round's; the blocks checked summed (``ok`` only if every round's were); anything else
    (stage tables, host-time rows, text) the first round's."""
    if len(runs) == 1:
        return runs[0]

    def merge(values: list[Any], how: str) -> Any:
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values if isinstance(v, dict) and k in v],
                             _WORST_OR_SUM.get(k, how)) for k in first}
        if isinstance(first, bool):  # "ok": every round's, where checks are summed
            return all(values) if how == "sum" else first
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return first
        if how == "worst":
            return max(values)
        if how == "sum":
            return sum(values)
        if all(type(v) is int for v in values):
            return statistics.median_low(values)
        return statistics.median(values)

    return {k: merge([r[k] for r in runs], _WORST_OR_SUM.get(k, "median"))
            if k not in _KEPT else runs[0][k] for k in runs[0]}



def serving_targets(s: dict[str, Any], full_bytes: int) -> dict[str, dict[str, Any]]:
    """The issue's targets, as ratios measured in this run (docs/benchmarks.md)."""
    d, runs = s["runs"]["default"], s["runs"].values()
    return {
        "small_p99_mixed_vs_unloaded_p50": target(d["small_p99_mixed_over_unloaded_p50"], 3.0),
        "concurrent_small_loads_per_s_vs_seed": target(s["concurrent_small_default_over_seed"], 3.0,
                                                       le=False),
        "large_stream_vs_raw_full_copy": target(d["large_stream"]["vs_raw_full_copy"], 0.70, le=False),
        # issue 24: open-loop Poisson arrivals at half the measured rate, and 16 in flight
        # against one at a time (the latter needs >= 8 cores to mean anything)
        "small_p99_open_loop_half_rate_vs_unloaded_p50": target(
            d["open_loop"]["small_p99_over_unloaded_p50"], 3.0),
        "concurrent_small_vs_one_at_a_time": target(d["concurrent_small"]["vs_one_at_a_time"], 3.0,
                                                    le=False),
        "serving_registrations_after_warmup": target(
            max(v for r in runs for v in r["registrations_after_warmup"].values()), 0),
        # flat: less than one full slab over all phases, in every process
        "serving_rss_growth_bytes": target(max(v for r in runs for v in r["rss_growth_bytes"].values()),
                                           full_bytes),
        # every block checked, on both sides in duplex
        "serving_bytes_checked": target(sum(r["bytes_checked"]["blocks"]
                                            + r.get("peer", {}).get("bytes_checked", {}).get("blocks", 0)
                                            for r in runs), 1, le=False),
    }


# -- report -------------------------------------------------------------------------------------
def serving_tables(s: dict[str, Any]) -> list[tuple[str, list[list[str]], list[str]]]:
    """(title, rows, header) for the report: the runs side by side, the targets."""
    for why in ("skipped", "error"):
        if why in s:
            return [("Serving load", [[s[why]]], [why])]
    seed, k1, d = s["runs"]["seed"], s["runs"]["k1"], s["runs"]["default"]

    def row(label: str, get: Callable[[dict[str, Any]], Any], fmt: str = "{:.1f}") -> list[str]:
        a, m, b = get(seed), get(k1), get(d)
        return [label, fmt.format(a), fmt.format(m), fmt.format(b), f"{b / a:.2f}x" if a else "-"]

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
        row(f"{s['concurrency']} concurrent small / one at a time",
            lambda r: r["concurrent_small"]["vs_one_at_a_time"], "{:.2f}"),
        row("open loop (mixed, Poisson at half its rate): small p99 (us)",
            lambda r: r["open_loop"]["small"]["p99_us"]),
        row("open loop small p99 / p50 unloaded", lambda r: r["open_loop"]["small_p99_over_unloaded_p50"],
            "{:.2f}"),
        row("large stream useful GB/s", lambda r: r["large_stream"]["useful_gbps"], "{:.3f}"),
        row("raw NIXL full copy GB/s", lambda r: r["raw_full_copy"]["gbps"], "{:.3f}"),
        row("large stream / raw full copy", lambda r: r["large_stream"]["vs_raw_full_copy"], "{:.2f}"),
        row("registrations after warm-up", lambda r: sum(r["registrations_after_warmup"].values()), "{}"),
        row("max RSS growth (KiB)", lambda r: max(r["rss_growth_bytes"].values()) / 1024, "{:.0f}"),
        row("blocks checked", lambda r: r["bytes_checked"]["blocks"], "{}"),
    ]
    if any(sum(r.get("bulk_posts", {}).values()) for r in (seed, k1, d)):
        rows.append(row("WRITEs through the bulk agent",
                        lambda r: sum(r.get("bulk_posts", {}).values()), "{}"))
    if all("cpu" in r and "open_loop" in r["cpu"] for r in (seed, k1, d)):
        # the host itself: how many cores the processes kept busy, and how long their
        # threads sat runnable without one (Linux schedstat), over the open-loop phase
        rows += [
            row("open loop: cores busy (cpu s / wall s, all processes)",
                lambda r: sum(p["cpu_of_wall"] for p in r["cpu"]["open_loop"].values()), "{:.2f}"),
            row("open loop: threads waiting for a core (s / wall s)",
                lambda r: sum(p["runqueue_wait_of_wall"] for p in r["cpu"]["open_loop"].values()), "{:.2f}"),
        ]
    duplex = s.get("topology") == "duplex"
    if duplex:  # rank 1's own loads, run at the same time as rank 0's
        rows += [
            row("rank 1: small p50 unloaded (us)", lambda r: r["peer"]["unloaded_small"]["p50_us"]),
            row("rank 1: small p99 mixed (us)", lambda r: r["peer"]["mixed"]["small"]["p99_us"]),
            row("rank 1: small p99 mixed / p50 unloaded",
                lambda r: r["peer"]["small_p99_mixed_over_unloaded_p50"], "{:.2f}"),
            row("rank 1: mixed useful GB/s", lambda r: r["peer"]["mixed"]["useful_gbps"], "{:.3f}"),
            row(f"rank 1: {s['concurrency']} concurrent small: loads/s",
                lambda r: r["peer"]["concurrent_small"]["loads_per_s"], "{:.0f}"),
            row("rank 1: large stream useful GB/s", lambda r: r["peer"]["large_stream"]["useful_gbps"], "{:.3f}"),
            row("rank 1: blocks checked", lambda r: r["peer"]["bytes_checked"]["blocks"], "{}"),
            row("both directions: mixed useful GB/s", lambda r: r["both_directions"]["mixed_useful_gbps"],
                "{:.3f}"),
            row("both directions: large stream GB/s",
                lambda r: r["both_directions"]["large_stream_useful_gbps"], "{:.3f}"),
        ]
    t = s["trace"]
    where = ("duplex: rank 0 loads from rank 1 while rank 1 loads from rank 0 (a mirrored trace)"
             if duplex else "from 2 sources")
    title = (f"Serving load: {t['loads']} loads ({t['large']} large, {t['useful_bytes'] / 1e6:.1f} MB) {where}, "
             f"{s['concurrency']} in flight, {s['device']}; K=1 vs K={d['receive_slabs']} "
             f"(receive/send slabs {d['receive_slabs']}/{d['send_slabs']}"
             f"{'' if s.get('slabs_default', True) else ', set by --serving-slabs'})"
             + (f"; merged groups of small batches up to {d['merge_small_bytes'] // 1024} KiB"
                if d.get("merge_small_bytes", s.get("small_bytes")) != s.get("small_bytes") else "")
             + ("; trimmed copies" if d.get("trimmed") else "")
             + ("; host copies posted whole" if d.get("piece_bytes") == 0 else
                f"; host copies over {d['piece_bytes'] / MiB:g} MiB posted in pieces"
                if d.get("piece_bytes") else "")
             + (f"; host WRITEs of {d['bulk_bytes'] / MiB:g} MiB or more through a second agent"
                if d.get("bulk_bytes") and s.get("device") == "cpu" else "")
             + (f"; {d['copy_threads']} copy threads" if d.get("copy_threads", EndpointConfig.copy_threads) != EndpointConfig.copy_threads else "")
             + ("; large host copies cut across the copy threads" if d.get("split_copies") else "")
             + (f"; direct writes of up to {d['direct_write_regions']} regions"
                if d.get("direct_write_regions") else "")
             + (f"; at most {d['small_round_trips']} small round trips per source"
                if d.get("small_round_trips") else "")
             + (f"; the median of {s['rounds']} alternating rounds" if s.get("rounds", 1) > 1 else ""))
    spread = s.get("spread", {})
    target_rows = [[k, f"{v['value']:.3g}", f"{'<=' if k not in _AT_LEAST else '>='} {v['limit']:.3g}",
                    "met" if v["met"] else "MISSED"]
                   + ([f"{spread[k]['min']:.3g} - {spread[k]['max']:.3g}" if k in spread else ""]
                      if spread else [])
                   for k, v in s["targets"].items()]
    return [(title, rows, ["", "seed K=1", "K=1 merged", f"K={d['receive_slabs']}",
                           f"K={d['receive_slabs']} / seed"]),
            ("Serving targets" + (f" (median of {s['rounds']} rounds)" if spread else ""), target_rows,
             ["target", "value", "limit", ""] + (["rounds: least - most"] if spread else []))]


_AT_LEAST = {"concurrent_small_loads_per_s_vs_seed", "large_stream_vs_raw_full_copy", "serving_bytes_checked",
             "concurrent_small_vs_one_at_a_time"}


def plot_serving(ax: Any, s: dict[str, Any]) -> None:
    """Bars: small-load p50 and p99, unloaded vs mixed, for K=1 and the default K."""
    runs = s["runs"]
    groups = [("unloaded", "unloaded_small"), ("mixed", "mixed")]
    labels, p50, p99 = [], [], []
    for name, r in runs.items():
        k = {"seed": "seed K=1", "k1": "K=1 merged"}.get(name, f"K={r['receive_slabs']}")
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
    who = ", duplex: rank 0's loads" if s.get("topology") == "duplex" else ""
    ax.set_title(f"Small loads, unloaded vs mixed trace ({s['concurrency']} in flight{who})")
    ax.legend()


__all__ = ["serving", "serving_targets", "serving_tables", "plot_serving", "config_for", "config_kwargs",
           "slab_counts", "phase_loads", "duplex_phases", "check_phase", "requests_for", "resolve_topology",
           "CONCURRENCY", "TOPOLOGIES"]

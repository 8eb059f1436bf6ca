"""The snapshot-store section of ``xavier-async bench`` (issue 23, item 8): a source that
serves published blocks from two tiers it owns (:mod:`xavier_async.snapshots`), measured
against floors taken in the same run.

Processes (NIXL, each a :class:`~xavier_async.testing.PeerProcess`; this process is the
loader, rank 0, with no store of its own):

* rank 1, ``store``: the snapshot store on, with small tiers (``device_blocks`` and
  ``host_blocks`` blocks of every layer), ``direct_write_regions=0`` (always gather);
* rank 2, ``store_direct``: the same store with ``direct_write_regions=1`` (a serve of
  one region is written straight from the store);
* rank 3, ``live``: no store (``snapshot_gpu_bytes=0, snapshot_cpu_bytes=0``): blocks are
  served from the engine's live slots, as before the store.

Every endpoint copies only the payload (``trimmed``): a direct write moves exactly the
payload whatever the view, so without it the comparison would be about view sizes. On
CUDA the tiers are the store's own: the device tier in VRAM, the host tier in pinned
DRAM; the loader is on ``cuda:0`` and the sources on ``cuda:1``, or all on ``cuda:0``
when one GPU is visible (it then time-slices them: the report says so,
:func:`~xavier_async.testing.devices.peer_device`).

Parts, in order:

1. **Floors.** The raw NIXL WRITE of one block hash over every layer (the payload of a
   one-hash load) between the loader and rank 1, on the endpoints' own registrations
   (:func:`~.raw.raw_floor`), at the start and again at the end; a torch copy of the bytes
   of one publish batch on the device (the floor of staging) and from the device into
   host memory (pinned on CUDA: the floor of demotion).
2. **One hash over every layer, three ways** (the issue's "Done when"): the same load
   from each source, interleaved in rounds (the sources not measured left to nap, the one
   measured woken by a few untimed loads, so four processes do not spin on a small
   machine); per source the load's total (loader) and the
   source's ``pack`` and ``post_to_done`` stage p50s (its ``snapshot_metrics()["stages"]``
   over those loads), each over the floor. The store's loads must come from its device
   tier (``LoadResult.device_tier_blocks``), and ``store_direct``'s must be direct writes.
3. **Tiers.** Rank 1 publishes a working set of ``3 x device_blocks`` new blocks in
   batches (the peer's ``publish_blocks``: its slots re-filled with their pattern,
   published, then zeroed), so its device tier overflows into the host tier and, once
   that is full, blocks are evicted (*cold*: the tiers' memory written for the first
   time); then it publishes again the blocks its host tier holds (*warm*: the store moves
   blocks into memory it wrote before). From the staging and demotion counters of its store
   (``snapshot_metrics()["snapshot"]``: ``stage_ns``, ``staged_blocks``, ``demote_ns``,
   ``demoted``): staging cost per block and demotion cost per block against the torch
   copies, demotions per second. Then loads of random keys of the working set, one at a
   time: each is served from the device tier, from the host tier, or refused (evicted);
   hit rate and latency per tier over the floor, and each outcome compared with what the
   publish results predicted (``available``/``demoted``/``evicted``).
4. **Registrations** of all four processes, after the warm-up and at the end: 0 more.
5. **Direct write vs gather on pool memory** (:mod:`.pool_paths`, raw NIXL, after the
   processes above are gone): the rule, "a direct write beats a gather up to N regions",
   which is what ``EndpointConfig.direct_write_regions`` compares a serve with.

Every load's bytes are checked, outside the timings: its destination slots are zeroed
before it and compared with the source's pattern after it (a refused load's must still be
zero). A wrong byte fails the section and names the block.
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import torch

from ..endpoint import Endpoint, EndpointConfig
from ..errors import RemoteError
from ..stages import LoadStages
from ..testing.devices import gpu_facts, peer_device
from ..testing.peer_process import LayoutSpec, PeerProcess, PeerSpec, pattern_caches, zero_caches
from .common import BenchOptions, bench_layout, stats
from .raw import RAW_COPIES, raw_floor
from .serving import sources

#: the sources, by rank
STORE, STORE_DIRECT, LIVE = 1, 2, 3
NAMES = {STORE: "store", STORE_DIRECT: "store_direct", LIVE: "live"}
#: the tiers a load is served from (or refused: its block was evicted)
OUTCOMES = ("device", "host", "refused")
#: seconds a source may take for one command
CALL_TIMEOUT = 300.0


@dataclass(frozen=True)
class SnapshotSizes:
    """The section's sizes: the tiers (in blocks of every layer), the working set, the
    keys per publish, the loads of the tier part and per source of the comparison."""

    device_blocks: int
    host_blocks: int
    working_set: int
    batch: int
    tier_loads: int
    compare_loads: int

    @classmethod
    def of(cls, o: BenchOptions, layout: LayoutSpec) -> SnapshotSizes:
        device = 8 if o.quick else 16
        batch = max(1, min(4 if o.quick else 8, layout.num_slots))
        return cls(device_blocks=device, host_blocks=device, working_set=3 * device, batch=batch,
                   tier_loads=60 if o.quick else max(120, o.loads),
                   compare_loads=30 if o.quick else max(60, o.loads))


def copy_floor(nbytes: int, src: str, dst: str, reps: int, pinned: bool = False) -> dict[str, float]:
    """A torch copy of ``nbytes`` contiguous bytes from device ``src`` to ``dst`` (the
    destination pinned when ``pinned``), synchronized on CUDA: per-copy stats."""
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst, pin_memory=pinned and dst == "cpu")
    cuda = torch.device(src).type == "cuda" or torch.device(dst).type == "cuda"
    perf = time.perf_counter
    out = []
    for i in range(5 + reps):
        t = perf()
        b.copy_(a)
        if cuda:
            torch.cuda.synchronize()
        if i >= 5:
            out.append(perf() - t)
    return stats(out)


class Loads:
    """The loader's side: one load of one key over every layer into one destination slot,
    timed, then its bytes checked against the source's pattern (outside the timing)."""

    def __init__(self, ep: Endpoint, layout: LayoutSpec, seed: int, ranks: Sequence[int]) -> None:
        self.ep, self.layout = ep, layout
        self.slots = layout.num_slots
        #: per source: [slot, layer, bytes] of its pattern (the bytes every key must carry)
        self.want = {r: torch.stack([t.reshape(self.slots, -1).view(torch.uint8)
                                     for t in pattern_caches(layout, r, seed).values()], dim=1)
                     for r in ranks}
        self.blocks_checked = 0
        self.loads_checked = 0
        #: refused loads whose destination was checked untouched (counted in loads_checked)
        self.refused_checked = 0

    def _got(self, dest: int) -> torch.Tensor:
        return torch.stack([c[dest].reshape(-1).view(torch.uint8) for c in self.ep.caches.values()]).cpu()

    async def one(self, rank: int, key: int, dest: int) -> tuple[float, Any]:
        """Seconds, and the :class:`LoadResult` (None: refused because the key is not
        published there). The bytes are checked after the timing."""
        for c in self.ep.caches.values():
            c[dest].zero_()
        req = {rank: {layer: {key: dest} for layer in self.ep.caches}}
        t = time.perf_counter()
        try:
            res = await self.ep.load(req)
        except RemoteError as exc:
            if "not published" not in str(exc):
                raise
            dt = time.perf_counter() - t
            if self._got(dest).any():
                raise AssertionError(f"a refused load of key {key} from rank {rank} wrote slot {dest}")
            self.loads_checked += 1
            self.refused_checked += 1
            return dt, None
        dt = time.perf_counter() - t
        got, want = self._got(dest), self.want[rank][key % self.slots]
        if not torch.equal(got, want):
            bad = next(i for i in range(got.shape[0]) if not torch.equal(got[i], want[i]))
            raise AssertionError(f"key {key} from rank {rank}: layer {bad} differs in slot {dest}")
        self.blocks_checked += got.shape[0]
        self.loads_checked += 1
        return dt, res


#: a NIXL endpoint polls hot (spinning) this long after its last message, then naps
#: (``NixlTransport.hot_window``, 50 ms): a pause longer than that lets the sources not
#: being measured go quiet, so that four processes do not spin on a small machine
QUIET_S = 0.06
#: how long a quiet source naps between polls (NixlTransport's ``idle_poll``; 0.5 ms by
#: default): two sources napping at 5 ms take next to nothing from the one measured, and
#: the load that wakes it is not timed
IDLE_POLL_S = 0.005
#: untimed (checked) loads that wake a source before its timed ones
WAKE_LOADS = 3


async def quiet(loads: Loads, rank: int, dest: int) -> None:
    """Let every source nap, then wake ``rank`` with a few loads (checked, not timed): its
    timed loads then find it polling, as under traffic."""
    await anyio.sleep(QUIET_S)
    for _ in range(WAKE_LOADS):
        await loads.one(rank, 0, dest)


async def _call(p: PeerProcess, cmd: str, arg: Any = None) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(p.call, cmd, arg, CALL_TIMEOUT))


def _ratio(x: float, floor: float) -> float:
    return x / floor if floor > 0 else float("nan")


def _stage(st: LoadStages, name: str, floor: float) -> dict[str, float]:
    h = st[name]
    return {"n": h.n, "p50_us": h.p50_us, "p99_us": h.p99_us, "mean_us": h.mean_us,
            "p50_over_floor": _ratio(h.p50_us, floor)}


async def compare_sources(loads: Loads, peers: dict[int, PeerProcess], n: int, floor: float,
                          dest: int) -> dict[str, Any]:
    """Key 0 over every layer from each source, interleaved in rounds: the load's total,
    the source's stages, over the floor."""
    ranks = sorted(peers)
    layers = len(loads.ep.caches)
    before = {r: await _call(peers[r], "metrics") for r in ranks}
    times: dict[int, list[float]] = {r: [] for r in ranks}
    tiers: dict[int, list[tuple[int, int]]] = {r: [] for r in ranks}
    wire: dict[int, list[int]] = {r: [] for r in ranks}
    rounds = 3  # each source's loads in a few long blocks, interleaved: drift hits all alike
    per = max(1, n // rounds)
    for _ in range(rounds):
        for r in ranks:
            await quiet(loads, r, dest)
            for _ in range(per):
                dt, res = await loads.one(r, 0, dest)
                if res is None:
                    raise AssertionError(f"key 0 is not published on {NAMES[r]}")
                times[r].append(dt)
                tiers[r].append((res.device_tier_blocks, res.host_tier_blocks))
                wire[r].append(res.wire_bytes)
    out: dict[str, Any] = {}
    for r in ranks:
        after = await _call(peers[r], "metrics")
        st = LoadStages.from_dict(after["stages"]).minus(LoadStages.from_dict(before[r]["stages"]))
        s = stats(times[r])
        pack, ptd = _stage(st, "pack", floor), _stage(st, "post_to_done", floor)
        snap0, snap1 = before[r].get("snapshot"), after.get("snapshot")
        out[NAMES[r]] = {
            "loads": len(times[r]), "load": s, "load_median_over_floor": _ratio(s["median_us"], floor),
            "queue": _stage(st, "queue", floor), "lookup": _stage(st, "lookup", floor),
            "pack": pack, "post_to_done": ptd,
            "pack_plus_post_to_done_p50_us": pack["p50_us"] + ptd["p50_us"],
            "pack_plus_post_to_done_over_floor": _ratio(pack["p50_us"] + ptd["p50_us"], floor),
            # the histograms' p50s are bucket middles (within ~6%): the means are exact
            "pack_plus_post_to_done_mean_us": pack["mean_us"] + ptd["mean_us"],
            "device_tier_loads": sum(d == layers and h == 0 for d, h in tiers[r]),
            "host_tier_loads": sum(h > 0 for _, h in tiers[r]),
            "wire_bytes_per_load": statistics.median(wire[r]),
            "direct_writes": (None if snap0 is None or snap1 is None
                              else snap1["direct_writes"] - snap0["direct_writes"]),
            "store": snap1 is not None}
    return out


async def publish_pass(peer: PeerProcess, keys: Sequence[int], sz: SnapshotSizes, slots: int,
                       predicted: dict[int, str | None], copies: dict[str, dict[str, float]],
                       ) -> dict[str, Any]:
    """Publish ``keys`` to ``peer`` in batches of ``sz.batch`` (key ``k`` from slot ``k %
    slots``), updating ``predicted`` (key -> the tier its block is in, None: not stored)
    from each result; the store's staging and demotion counters over the pass, per block,
    against the torch copies of the same bytes."""
    s0 = (await _call(peer, "metrics"))["snapshot"]
    calls: list[float] = []
    t0 = time.perf_counter()
    for i in range(0, len(keys), sz.batch):
        batch = list(keys[i:i + sz.batch])
        t = time.perf_counter()
        r = await _call(peer, "publish_blocks", {"keys": batch, "slots": [k % slots for k in batch]})
        calls.append(time.perf_counter() - t)
        for k in (*r["evicted"], *r["skipped"], *r["failed"]):
            predicted[int(k)] = None
        for k in r["demoted"]:
            predicted[int(k)] = "host"
        for k in r["available"]:  # a new block goes to the device tier (nothing is leased here)
            predicted[int(k)] = "device"
    wall = time.perf_counter() - t0
    s1 = (await _call(peer, "metrics"))["snapshot"]

    def d(name: str) -> int:
        return int(s1[name]) - int(s0[name])

    staged, stage_ns, demoted, demote_ns = d("staged_blocks"), d("stage_ns"), d("demoted"), d("demote_ns")
    stage_copy = copies["stage_batch"]["median_us"] * 1e3 / sz.batch
    demote_copy = copies["demote_block"]["median_us"] * 1e3
    return {"published": len(keys), "calls": len(calls), "blocks_per_call": sz.batch,
            "publish_call_ms": stats(calls)["median_us"] / 1e3, "wall_ms": wall * 1e3,
            "staged_blocks": staged,
            "stage_ns_per_block": stage_ns / staged if staged else None,
            "stage_copy_ns_per_block": stage_copy,
            "stage_ratio_to_copy": stage_ns / staged / stage_copy if staged else None,
            "demoted": demoted, "evicted": d("evicted"), "skipped": d("skipped"),
            "demote_ns_per_block": demote_ns / demoted if demoted else None,
            "demote_copy_ns_per_block": demote_copy,
            "demote_ratio_to_copy": demote_ns / demoted / demote_copy if demoted else None,
            # the demotion passes' own rate, and the rate over the pass's wall time (which
            # includes the peer re-filling its slots with their pattern for every call)
            "demotions_per_s": demoted / (demote_ns * 1e-9) if demote_ns else None,
            "demotions_per_s_of_wall": demoted / wall if wall > 0 else None}


async def tier_workload(loads: Loads, peer: PeerProcess, sz: SnapshotSizes, floor: float,
                        copies: dict[str, dict[str, float]], seed: int, dest: int) -> dict[str, Any]:
    """Two publish passes into ``peer``'s store, then loads of random keys of the working
    set one at a time; per tier: hit rate, latency over the floor, and whether each outcome
    is the one the publish results predicted.

    ``cold``: the working set, ``3 x device_blocks`` new blocks: the device tier fills, its
    least recently used blocks are demoted into the host tier until that is full, then
    dropped; the tiers' pages are written for the first time (on the CPU, page faults).
    ``warm``: the blocks the host tier holds are published again: each moves to the device
    tier, its host slot is freed and takes a later victim (the first batch's victims find
    no room and are dropped), so the store demotes into memory it has written before."""
    layout = loads.layout
    predicted: dict[int, str | None] = {}
    cold = await publish_pass(peer, range(sz.working_set), sz, layout.num_slots, predicted, copies)
    again = sorted(k for k, t in predicted.items() if t == "host")
    warm = await publish_pass(peer, again, sz, layout.num_slots, predicted, copies)
    # loads of random keys of the working set, one at a time
    rng = random.Random(seed + 23)
    await quiet(loads, STORE, dest)
    m1 = await _call(peer, "metrics")
    st0 = LoadStages.from_dict(m1["stages"])
    lat: dict[str, list[float]] = {k: [] for k in OUTCOMES}
    mismatched: list[tuple[int, str, str]] = []
    layers = len(loads.ep.caches)
    for _ in range(sz.tier_loads):
        key = rng.randrange(sz.working_set)
        dt, res = await loads.one(STORE, key, dest)
        if res is None:
            got = "refused"
        elif res.device_tier_blocks == layers and not res.host_tier_blocks:
            got = "device"
        elif res.host_tier_blocks == layers and not res.device_tier_blocks:
            got = "host"
        else:
            raise AssertionError(f"key {key}: one block from two tiers ({res})")
        lat[got].append(dt)
        want = predicted.get(key) or "refused"
        if want != got:
            mismatched.append((key, want, got))
    m2 = await _call(peer, "metrics")
    st = LoadStages.from_dict(m2["stages"]).minus(st0)
    n = sz.tier_loads
    tiers: dict[str, Any] = {}
    for name in OUTCOMES:
        xs = lat[name]
        row: dict[str, Any] = {"loads": len(xs), "share": len(xs) / n}
        if xs:
            s = stats(xs)
            row.update(s, median_over_floor=_ratio(s["median_us"], floor))
        tiers[name] = row
    end = m2["snapshot"]
    return {"publish": {"cold": cold, "warm": warm}, "tiers": tiers, "loads": n,
            "as_predicted": not mismatched, "mismatched": mismatched[:10],
            "store_after": {k: end[k] for k in ("device_used", "host_used", "leased", "stored", "demoted",
                                                "evicted", "skipped", "staged_blocks", "direct_writes")},
            "source_stages": {"pack": _stage(st, "pack", floor),
                              "post_to_done": _stage(st, "post_to_done", floor)}}


async def snapshot_section(o: BenchOptions, report: Callable[[str], None] = lambda s: None,
                           ) -> dict[str, Any]:
    """Parts 1-4 of the module docstring (processes over NIXL), then part 5."""
    device = o.resolved_device()
    layout = bench_layout(o.full_bytes)
    block = layout.layers * layout.block_nbytes
    if block > o.full_bytes:
        raise ValueError(f"one block over every layer ({block} B) exceeds the full slab")
    sz = SnapshotSizes.of(o, layout)
    here, there = peer_device(0, device).device, peer_device(1, device).device
    cuda = device == "cuda"
    base: dict[str, Any] = dict(full_bytes=o.full_bytes, small_bytes=o.small_bytes, trimmed=True)
    tiers = dict(snapshot_gpu_bytes=sz.device_blocks * block, snapshot_cpu_bytes=sz.host_blocks * block)
    configs = {STORE: dict(base, **tiers, direct_write_regions=0),
               STORE_DIRECT: dict(base, **tiers, direct_write_regions=1),
               LIVE: dict(base, snapshot_gpu_bytes=0, snapshot_cpu_bytes=0)}
    # the store's sources publish one block at start (key 0 from slot 0, into the device
    # tier): the tiers start empty but for it, and the working set fills them
    specs = [PeerSpec(rank=r, layout=layout, seed=o.seed, device=there, config=cfg,
                      hello_extras={RAW_COPIES: True}, torch_threads=None if cuda else 1,
                      published=None if r == LIVE else 1, transport={"idle_poll": IDLE_POLL_S})
             for r, cfg in configs.items()]
    reps = max(20, o.copies // 2)
    out: dict[str, Any] = {"device": device, **gpu_facts(device),
                           "sources": {NAMES[r]: cfg for r, cfg in configs.items()},
                           "sizes": asdict(sz), "block_bytes": block, "layer_block_bytes": layout.block_nbytes,
                           "layers": layout.layers,
                           "tier_bytes": {"device": sz.device_blocks * block, "host": sz.host_blocks * block,
                                          "host_pinned": cuda},
                           "working_set_over_device_tier": sz.working_set / sz.device_blocks}
    from ..transports.nixl import NixlTransport
    report("snapshot store: starting three sources")
    async with sources(specs) as started:
        peers = {p.spec.rank: p for p in started}
        caches = zero_caches(layout, here)
        cfg = EndpointConfig(**base, snapshot_gpu_bytes=0, snapshot_cpu_bytes=0)
        async with Endpoint(0, caches, NixlTransport(), cfg) as ep:
            for p in started:
                await ep.connect(p.address)
            loads = Loads(ep, layout, o.seed, list(peers))
            dest = layout.num_slots - 1
            for r in peers:  # warm-up: every source's path and view used
                for _ in range(3):
                    await loads.one(r, 0, dest)
            regs0 = {"loader": ep.snapshot_metrics()["registrations"],
                     **{NAMES[r]: (await _call(p, "metrics"))["registrations"] for r, p in peers.items()}}
            report("snapshot store: floors")
            floor = stats(raw_floor(ep, STORE, block, reps))
            copies = {"stage_batch": copy_floor(sz.batch * block, here, here, reps),
                      "demote_block": copy_floor(block, here, "cpu", reps, pinned=cuda)}
            f = floor["median_us"]
            report("snapshot store: one hash, three ways")
            out["compare"] = await compare_sources(loads, peers, sz.compare_loads, f, dest)
            report("snapshot store: tiers")
            out.update(await tier_workload(loads, peers[STORE], sz, f, copies, o.seed, dest))
            regs1 = {"loader": ep.snapshot_metrics()["registrations"],
                     **{NAMES[r]: (await _call(p, "metrics"))["registrations"] for r, p in peers.items()}}
            out["registrations_after_warmup"] = {k: regs1[k] - regs0[k] for k in regs0}
            out["floor"] = {"one_hash": floor, "one_hash_after": stats(raw_floor(ep, STORE, block, reps)),
                            "bytes": block, "kind": "raw NIXL WRITE"}
            out["copy_floors"] = copies
            out["loads_checked"], out["blocks_checked"] = loads.loads_checked, loads.blocks_checked
            out["refused_loads_checked"] = loads.refused_checked
            out["bytes_verified"] = True  # every load was checked (a wrong byte raises)
    c = out["compare"]
    live = c["live"]["pack_plus_post_to_done_p50_us"]
    live_mean = c["live"]["pack_plus_post_to_done_mean_us"]
    out["done_when"] = {name: {"pack_plus_post_to_done_p50_us": c[name]["pack_plus_post_to_done_p50_us"],
                               "live_p50_us": live,
                               "ratio_to_live": _ratio(c[name]["pack_plus_post_to_done_p50_us"], live),
                               "smaller_than_live": c[name]["pack_plus_post_to_done_p50_us"] < live,
                               "mean_ratio_to_live": _ratio(c[name]["pack_plus_post_to_done_mean_us"],
                                                            live_mean)}
                        for name in ("store", "store_direct")}
    report("snapshot store: direct write vs gather on pool memory")
    from .pool_paths import run_pool_paths
    out["pool_paths"] = await anyio.to_thread.run_sync(
        lambda: run_pool_paths(o.full_bytes, device, iters=max(8, o.copies // 2),
                               warmup=min(o.warmup, 10), seed=o.seed, quick=o.quick))
    out["direct_write_regions"] = out["pool_paths"]["direct_write_regions"]
    return out


# -- the report ------------------------------------------------------------------------------
def _us(x: dict[str, Any]) -> str:
    return f"{x['p50_us']:.1f} ({x['p50_over_floor']:.2f}x)"


def snapshot_tables(s: dict[str, Any]) -> list[tuple[str, list[list[str]], list[str]]]:
    """(title, rows, header) for each table of the section."""
    if "error" in s:
        return [("Snapshot store (did not run)", [[s["error"]]], ["error"])]
    f = s["floor"]["one_hash"]["median_us"]
    fa = s["floor"]["one_hash_after"]["median_us"]
    sz = s["sizes"]
    regs = s["registrations_after_warmup"]
    head = (f"floor: raw NIXL WRITE of one hash over every layer ({s['block_bytes'] // 1024} KiB) "
            f"{f:.1f} us (at the end {fa:.1f} us); registrations after warm-up: "
            + ", ".join(f"{k} {v}" for k, v in regs.items())
            + f"; {s['loads_checked']} loads, {s['blocks_checked']} blocks checked")
    note = f" [{s['note']}]" if s.get("note") else ""
    names = {"store": "store, gather (direct_write_regions=0)",
             "store_direct": "store, direct (direct_write_regions=1)",
             "live": "live slots (no store)"}
    cmp_rows = []
    for key, label in names.items():
        x = s["compare"][key]
        ptd = x["pack_plus_post_to_done_p50_us"]
        tier = (f"device {x['device_tier_loads']}/{x['loads']}" if x["store"] else "live slots")
        cmp_rows.append([label, f"{x['load']['median_us']:.1f} ({x['load_median_over_floor']:.2f}x)",
                         _us(x["pack"]), _us(x["post_to_done"]),
                         f"{ptd:.1f} ({x['pack_plus_post_to_done_over_floor']:.2f}x); "
                         f"mean {x['pack_plus_post_to_done_mean_us']:.1f}",
                         tier, "-" if x["direct_writes"] is None else str(x["direct_writes"]),
                         f"{x['wire_bytes_per_load'] // 1024:.0f} KiB"])
    dw = s["done_when"]
    verdict = "; ".join(f"{k}: {v['ratio_to_live']:.2f}x of live's p50 "
                        f"({'smaller' if v['smaller_than_live'] else 'NOT smaller'}), "
                        f"{v['mean_ratio_to_live']:.2f}x of its mean" for k, v in dw.items())
    t = s["tiers"]
    tier_rows = []
    for name in OUTCOMES:
        x = t[name]
        tier_rows.append([name, str(x["loads"]), f"{x['share']:.0%}",
                          "-" if not x["loads"] else f"{x['median_us']:.1f}",
                          "-" if not x["loads"] else f"{x['p95_us']:.1f}",
                          "-" if not x["loads"] else f"{x['median_over_floor']:.2f}x"])

    def ns(v: float | None) -> str:
        return "-" if v is None else f"{v / 1e3:.1f} us"

    def times(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    def rate(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}/s"
    cost_rows = []
    for name, ps in s["publish"].items():
        cost_rows.append([f"staging, {name}", str(ps["staged_blocks"]), ns(ps["stage_ns_per_block"]),
                          ns(ps["stage_copy_ns_per_block"]), times(ps["stage_ratio_to_copy"]), "",
                          f"{ps['calls']} publish_blocks of {ps['blocks_per_call']}"])
        cost_rows.append([f"demotion, {name}", str(ps["demoted"]), ns(ps["demote_ns_per_block"]),
                          ns(ps["demote_copy_ns_per_block"]), times(ps["demote_ratio_to_copy"]),
                          rate(ps["demotions_per_s"]),
                          f"evicted {ps['evicted']}, skipped {ps['skipped']}"])
    tables = [
        (f"Snapshot store{note}: one hash over every layer from the device tier vs live slots "
         f"(p50 us, x the floor; {head}). pack + post_to_done: {verdict}", cmp_rows,
         ["source", "load total", "source.pack", "source.post_to_done", "pack + post_to_done",
          "served from", "direct writes", "wire/load"]),
        (f"Snapshot store tiers: {sz['device_blocks']} + {sz['host_blocks']} blocks, working set "
         f"{sz['working_set']} blocks ({s['working_set_over_device_tier']:.0f}x the device tier), "
         f"{s['loads']} loads of random keys, one at a time; "
         f"outcomes as the publish results predicted: {'yes' if s['as_predicted'] else 'NO'}",
         tier_rows, ["served from", "loads", "hit rate", "p50 us", "p95 us", "p50 / floor"]),
        ("Snapshot store: staging and demotion per block against a torch copy of the same bytes "
         "(staging: a batch's bytes on the device, per block; demotion: one block into host memory). "
         "cold: the tiers' memory written for the first time; warm: written before. Demotions per "
         "second: blocks over the time of the store's demotion passes",
         cost_rows, ["pass", "blocks", "per block", "torch copy", "ratio", "demotions/s", "note"]),
    ]
    pp = s.get("pool_paths")
    if pp is not None:
        from .pool_paths import POOL_HEADER, pool_rows
        tables.append((f"Direct write vs gather on pool memory ({pp['memory']}, raw NIXL, two processes; "
                       f"median us per transfer to DONE; raw: the same bytes from the send slab, "
                       f"nothing gathered; registrations {pp['registrations_at_start']} at start, "
                       f"{pp['registrations_after_warmup']} after warm-up). Rule (engine layout): "
                       f"{pp['rule']['text']}; with cached handles: {pp['rule_cached']['text']}. "
                       f"Block-major: {pp['rule_block_major']['text']}. "
                       f"=> direct_write_regions = {pp['direct_write_regions']} on this machine",
                       pool_rows(pp), POOL_HEADER))
    return tables


def plot_snapshot(ax: Any, s: dict[str, Any]) -> None:
    """Bars, as multiples of the floor: each source's one-hash load (total, and its
    pack + post_to_done), and the tier workload's loads per outcome (p50)."""
    if "error" in s:
        ax.text(0.5, 0.5, f"snapshot store: {s['error']}", ha="center", wrap=True)
        return
    f = s["floor"]["one_hash"]["median_us"]
    labels, totals, source = [], [], []
    for key in NAMES.values():
        x = s["compare"][key]
        labels.append(key)
        totals.append(x["load"]["median_us"] / f)
        source.append(x["pack_plus_post_to_done_p50_us"] / f)
    for name in OUTCOMES:
        x = s["tiers"][name]
        if x["loads"]:
            labels.append(f"{name} ({x['share']:.0%})")
            totals.append(x["median_us"] / f)
            source.append(0.0)
    pos = list(range(len(labels)))
    ax.bar([i - 0.2 for i in pos], totals, width=0.4, label="load total (p50)", color="#1f77b4")
    ax.bar([i + 0.2 for i in pos], source, width=0.4, label="source pack + post_to_done (p50)",
           color="#e377c2")
    ax.set_xticks(pos, labels, rotation=20)
    ax.set_ylabel("x the raw NIXL floor of one hash")
    ax.set_title(f"Snapshot store ({s['device']}): one hash over every layer; tiers "
                 f"(floor {f:.1f} us)")
    ax.legend()


__all__ = ["snapshot_section", "plot_snapshot", "snapshot_tables", "SnapshotSizes", "copy_floor", "NAMES", "OUTCOMES"]

"""Direct write vs gather from store memory, per batch shape, over raw NIXL between two
processes: the packed-vs-descriptor comparison of :mod:`.descriptors`, re-measured where
the source memory is a snapshot tier (:mod:`xavier_async.snapshots`).

The source memory here is a store-like pool: one tensor ``[slots, block_bytes]``
registered once, every layer of a block contiguous in its slot (layer ``l`` at ``l *
layer_block_bytes``), so one block over every layer is one region. A batch is served the
two ways the engine's source serves a batch from the store (:meth:`Source._post
<xavier_async.source.Source>`):

* ``gather``: the run table from the store into the send slab
  (:meth:`StoreTable.pack_table <xavier_async.snapshots.StoreTable.pack_table>`: the
  runs the engine's ``SnapshotStore.serve`` lays out, a test holds them equal), executed in one pass (memmoves on the CPU, one fused launch and its event
  on CUDA), then ONE contiguous WRITE of the payload (a handle made once per size, as the
  transport keeps them);
* ``direct``: the same table's runs as regions, written straight from the pool into the
  peer's slab by one WRITE with one descriptor per region and a new transfer handle (what
  ``Transport.post_regions`` does for regions it has not written before); ``direct
  cached``: the same with the handle made once and re-posted (its LRU hit: the same block
  served again into the same receive slab).

Beside them ``raw``, the floor of both: a WRITE of the same number of bytes from the send
slab on a handle made once, nothing gathered.

Shapes: in the engine's slab layout (layer-major: every layer's blocks together, which is
where the receiver unpacks them from), one block hash over every layer is ONE region; a
hash over some layers is one region per run of consecutive layers; two or more hashes over
every layer are one region per (hash, layer), because consecutive store slots are a whole
block apart in any one layer. So a few block-major shapes follow (``n`` hashes landing
whole, in slot order, as a block-major receive slab would take them, in runs of 1, 4, 16,
``n`` consecutive slots), where consecutive blocks merge into one region as the issue's
design intends. The rule: up to how many regions a direct write beats a gather, in the
engine's layout (what ``EndpointConfig.direct_write_regions`` compares with).

Every path's bytes are checked: the peer's slab is zeroed before each path and compared
after its warm-up and after its timed runs with the blocks read straight from the pool
(``torch`` slicing, independent of the run tables). Registrations: the pool and the send
slab once, at start; none after.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import CacheLayout, LayerId
from ..packing import DeviceRuns, RunTable, merged_runs, run_host
from ..planning import Planner
from ..snapshots import StoreTable
from ..testing.devices import gpu_facts, peer_device
from ..testing.peer_process import DTYPES, LayoutSpec, digest
from .common import bench_layout, stats
from .descriptors import _Peer, runs_of_slots, transfer_to_done

#: the paths timed per shape (``raw``: the floor, a WRITE of the same bytes, nothing gathered)
POOL_PATHS = ("raw", "gather", "direct", "direct_cached")


@dataclass(frozen=True)
class PoolShape:
    """A batch: these store slots (block hashes) over these layers. ``block_major``: the
    blocks land whole and in slot order (a block-major receive slab), else layer-major
    (the engine's receive slab)."""

    name: str
    slots: tuple[int, ...]
    layers: tuple[int, ...]
    block_major: bool = False
    #: runs of consecutive slots (block-major shapes)
    run: int = 1


def layer_runs(layers: int, runs: int) -> tuple[int, ...]:
    """Layers of one hash that form exactly ``runs`` runs of consecutive layers (each run
    ``layers // runs - 1`` long, one layer skipped after it)."""
    width = layers // runs
    if runs < 1 or width < 2:
        raise ValueError(f"{layers} layers cannot form {runs} runs with gaps")
    return tuple(i * width + j for i in range(runs) for j in range(width - 1))


def pool_shapes(layout: LayoutSpec, full_bytes: int, seed: int = 0) -> list[PoolShape]:
    """Layer-major: one hash over every layer (1 region), one hash over layers in 2, 4, 8
    and ``layers // 2`` runs, 2, 4 and ``n`` hashes over every layer (``n``: as many as fit
    the slab, at most 64); block-major: ``n`` hashes in runs of 1, 4, 16 and ``n``
    consecutive slots."""
    L, block = layout.layers, layout.layers * layout.block_nbytes
    n = max(1, min(64, full_bytes // block))
    rng = random.Random(seed)
    every = tuple(range(L))
    out = [PoolShape("1 hash x all layers", (1,), every)]
    for r in sorted({2, 4, 8, L // 2}):
        if L // r >= 2:
            ls = layer_runs(L, r)
            out.append(PoolShape(f"1 hash x {len(ls)} layers in {r} runs", (1,), ls))
    scattered = list(range(0, 2 * n, 2))
    rng.shuffle(scattered)
    for k in sorted({2, 4, n}):
        if k <= n and k > 1:
            out.append(PoolShape(f"{k} hashes x all layers", tuple(scattered[:k]), every))
    for run in sorted({1, 4, 16, n}):
        if run > n:
            continue
        name, slots = runs_of_slots(n, run, rng)
        out.append(PoolShape(f"block-major: {name}", slots, every, True, run))
    return out


class PoolSource:
    """This process's side: the pool and the send slab, registered once with one agent
    (counted), the engine's planner and store table over the pool."""

    def __init__(self, layout: LayoutSpec, full_bytes: int, device: str, peer: _Peer,
                 pool_slots: int, seed: int = 0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config
        self.layout, self.peer = layout, peer
        self.device = torch.device(device)
        self.bn = layout.block_nbytes
        self.block = layout.layers * self.bn
        g = torch.Generator().manual_seed(seed + 991)
        self.pool = torch.randint(0, 256, (pool_slots, self.block), generator=g,
                                  dtype=torch.uint8).to(self.device)
        self.slab = torch.zeros(full_bytes, dtype=torch.uint8, device=self.device)
        self.slab_ptr = self.slab.data_ptr()
        cuda = self.device.type == "cuda"
        self.runs: DeviceRuns | None = DeviceRuns(self.device) if cuda else None
        self.mem, self.dev_id = ("VRAM", self.device.index or 0) if cuda else ("DRAM", 0)
        self.agent = nixl_agent("pool-source", nixl_agent_config(enable_prog_thread=False,
                                                                 backends=["UCX"]))
        self.registrations = 0
        for t in (self.pool, self.slab):
            self.agent.register_memory(self.agent.get_reg_descs(
                [(t.data_ptr(), t.numel(), self.dev_id, "")], self.mem))
            self.registrations += 1
        self.peer_name = self.agent.add_remote_agent(peer.meta)
        offsets: dict[LayerId, int] = {layer: layer * self.bn for layer in range(layout.layers)}
        # the engine's table: every slot in the "device tier" (split = the pool's size)
        empty = torch.empty(0, dtype=torch.uint8)
        self.table = StoreTable(self.pool, empty, offsets, pool_slots, self.block)
        meta = {layer: torch.empty((pool_slots, *layout.block_shape), dtype=DTYPES[layout.dtype],
                                   device="meta") for layer in range(layout.layers)}
        self.planner = Planner(CacheLayout.of(meta), full_bytes)
        self._handles: dict[Any, Any] = {}

    def close(self) -> None:
        for h in self._handles.values():
            self.agent.release_xfer_handle(h)
        self._handles.clear()
        self.agent.remove_remote_agent(self.peer_name)

    # -- the batch
    def run_table(self, shape: PoolShape) -> Callable[[], RunTable]:
        """A function computing the shape's run table from the pool into the send slab,
        as the source does per serve (``StoreTable.pack_table``, the runs of the engine's
        ``SnapshotStore.serve``; block-major:
        whole blocks in slot order, consecutive ones merged by the same rule)."""
        if shape.block_major:
            base, b, slab = self.pool.data_ptr(), self.block, self.slab_ptr

            def blocks() -> RunTable:
                return merged_runs((slab + i * b, base + slot * b, b)
                                   for i, slot in enumerate(shape.slots))
            return blocks
        req = {1: {layer: {s: s for s in shape.slots} for layer in shape.layers}}
        batches = self.planner.plan(req)
        if len(batches) != 1:
            raise ValueError(f"{shape.name}: {len(batches)} batches (raise full_bytes)")
        segments = batches[0].segments
        slot_lists = [[int(k) for k in seg.keys] for seg in segments]
        pack_table, slab_ptr = self.table.pack_table, self.slab_ptr
        return lambda: pack_table(slab_ptr, segments, slot_lists)

    def expected(self, shape: PoolShape) -> str:
        """The bytes the peer's slab must hold, read straight from the pool."""
        idx = torch.tensor(shape.slots, dtype=torch.long, device=self.device)
        rows = self.pool.index_select(0, idx)
        if shape.block_major:
            return digest(rows.reshape(-1))
        bn = self.bn
        return digest(torch.cat([rows[:, layer * bn:(layer + 1) * bn].reshape(-1)
                                 for layer in shape.layers]))

    # -- the paths: each one transfer to DONE
    def _wait(self, h: Any) -> None:
        transfer_to_done(self.agent, h)

    def _slab_handle(self, nbytes: int) -> Any:
        h = self._handles.get(nbytes)
        if h is None:  # once per size, as the transport's handle cache
            h = self._handles[nbytes] = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs([(self.slab_ptr, nbytes, self.dev_id)], self.mem),
                self.agent.get_xfer_descs([(self.peer.ptr, nbytes, self.peer.dev)], self.peer.mem),
                self.peer_name)
        return h

    def _region_handle(self, table: RunTable) -> Any:
        peer, slab = self.peer, self.slab_ptr
        return self.agent.initialize_xfer(
            "WRITE", self.agent.get_xfer_descs([(s, n, self.dev_id) for s, n in zip(table[1], table[2])],
                                               self.mem),
            self.agent.get_xfer_descs([(peer.ptr + d - slab, n, peer.dev) for d, n in zip(table[0], table[2])],
                                      peer.mem),
            self.peer_name)

    def raw(self, nbytes: int) -> None:
        self._wait(self._slab_handle(nbytes))

    def gather(self, make: Callable[[], RunTable], nbytes: int) -> None:
        table = make()
        if self.runs is None:
            run_host(table)
        else:
            event = self.runs.run(table)
            if event is not None:  # NIXL does not order against CUDA streams
                event.synchronize()
        self._wait(self._slab_handle(nbytes))

    def direct(self, make: Callable[[], RunTable]) -> None:
        h = self._region_handle(make())
        try:
            self._wait(h)
        finally:
            self.agent.release_xfer_handle(h)

    def direct_cached(self, make: Callable[[], RunTable]) -> None:
        table = make()
        key = ("regions", tuple(zip(*table)))
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = self._region_handle(table)
        self._wait(h)


def measure_pool_shape(src: PoolSource, shape: PoolShape, iters: int, warmup: int) -> dict[str, Any]:
    """Median per transfer of each path (interleaved in rounds), each path's bytes checked
    after its warm-up and after its timed runs, registrations made meanwhile."""
    make = src.run_table(shape)
    table = make()
    nbytes = sum(table[2])
    want = src.expected(shape)
    calls: dict[str, Callable[[], None]] = {
        "raw": lambda: src.raw(nbytes),
        "gather": lambda: src.gather(make, nbytes),
        "direct": lambda: src.direct(make),
        "direct_cached": lambda: src.direct_cached(make),
    }
    peer = src.peer
    checked: dict[str, bool] = {}
    regs0 = src.registrations
    for p in POOL_PATHS[1:]:  # warm-up, and each path's bytes checked from a zeroed slab
        peer.call("zero", nbytes)
        for _ in range(warmup):
            calls[p]()
        checked[p] = peer.call("digest", nbytes) == want
    for _ in range(warmup):
        calls["raw"]()
    times: dict[str, list[float]] = {p: [] for p in POOL_PATHS}
    rounds = 8
    per = max(1, iters // rounds)
    perf = time.perf_counter
    for _ in range(rounds):
        for p, f in calls.items():
            for _ in range(per):
                t = perf()
                f()
                times[p].append(perf() - t)
    for p in POOL_PATHS[1:]:
        peer.call("zero", nbytes)
        calls[p]()
        checked[p] = checked[p] and peer.call("digest", nbytes) == want
    row: dict[str, Any] = {"shape": shape.name, "block_major": shape.block_major,
                           "hashes": len(shape.slots), "layers": len(shape.layers), "bytes": nbytes,
                           "regions": len(table[2]),
                           "registrations_after_warmup": src.registrations - regs0}
    for p in POOL_PATHS:
        row[p] = stats(times[p])
        if p != "raw":
            row[p]["bytes_verified"] = checked[p]
    raw = row["raw"]["median_us"]
    for p in POOL_PATHS[1:]:
        row[f"ratio_{p}_to_raw"] = row[p]["median_us"] / raw
    row["ratio_direct_to_gather"] = row["direct"]["median_us"] / row["gather"]["median_us"]
    row["ratio_direct_cached_to_gather"] = row["direct_cached"]["median_us"] / row["gather"]["median_us"]
    return row


def derive_region_rule(rows: Sequence[dict[str, Any]], path: str = "direct",
                       block_major: bool = False) -> dict[str, Any]:
    """Up to how many regions ``path`` beats ``gather``: the largest region count ``N``
    measured such that the direct write was faster for every shape of at most ``N``
    regions (0: it lost already at the fewest). Among the engine's layer-major shapes, or
    the block-major ones."""
    mine = sorted((r for r in rows if r["block_major"] == block_major), key=lambda r: r["regions"])
    wins = [r[path]["median_us"] < r["gather"]["median_us"] for r in mine]
    best = 0
    lost_at: int | None = None
    for r, won in zip(mine, wins):
        if not won:
            lost_at = r["regions"]
            break
        best = r["regions"]
    counts = sorted({r["regions"] for r in mine})
    handle = "a new handle" if path == "direct" else "a cached handle"
    if not mine:
        text = "no shape measured"
    elif best == 0:
        text = f"gather always: a direct write ({handle}) lost already at {lost_at} region(s)"
    elif lost_at is None:
        text = f"direct write ({handle}) for every shape measured (up to {counts[-1]} regions)"
    else:
        text = (f"direct write ({handle}) up to {best} region(s), gather from {lost_at} "
                f"(measured: {', '.join(map(str, counts))})")
    return {"max_regions": best, "lost_at": lost_at, "path": path, "block_major": block_major,
            "region_counts": counts, "text": text}


def run_pool_paths(full_bytes: int = 12 << 20, device: str = "cpu", iters: int = 200,
                   warmup: int = 10, seed: int = 0, quick: bool = False,
                   report: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every shape, every path, the rules; registrations. Synchronous: its own peer
    process, no event loop."""
    if quick:
        iters, warmup = min(iters, 24), min(warmup, 3)
    here, there = peer_device(0, device).device, peer_device(1, device).device
    layout = bench_layout(full_bytes)
    shapes = pool_shapes(layout, full_bytes, seed)
    slots = 2 + max(max(s.slots) for s in shapes)
    peer = _Peer(full_bytes, there, layout)
    try:
        src = PoolSource(layout, full_bytes, here, peer, slots, seed)
        try:
            rows = []
            for shape in shapes:
                report(f"pool paths: {shape.name}")
                big = len(shape.slots) * len(shape.layers) * layout.block_nbytes >= (1 << 20)
                rows.append(measure_pool_shape(src, shape, max(8, iters // 2) if big else iters, warmup))
            out: dict[str, Any] = {
                "device": device, "memory": src.mem, **gpu_facts(device),
                "layer_block_bytes": layout.block_nbytes, "block_bytes": src.block,
                "layers": layout.layers, "pool_slots": slots,
                "registrations_at_start": src.registrations,
                "registrations_after_warmup": sum(r["registrations_after_warmup"] for r in rows),
                "shapes": rows,
                "rule": derive_region_rule(rows),
                "rule_cached": derive_region_rule(rows, "direct_cached"),
                "rule_block_major": derive_region_rule(rows, block_major=True),
                "rule_block_major_cached": derive_region_rule(rows, "direct_cached", block_major=True)}
            out["direct_write_regions"] = out["rule"]["max_regions"]
        finally:
            src.close()
    finally:
        peer.close()
    return out


POOL_HEADER = ["shape", "bytes", "regions", "raw us", "gather us", "direct us", "direct cached us",
               "gather/raw", "direct/gather", "cached/gather", "bytes ok"]


def pool_rows(d: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in d["shapes"]:
        ok = all(r[p]["bytes_verified"] for p in POOL_PATHS[1:])
        out.append([r["shape"], f"{r['bytes'] // 1024} KiB", str(r["regions"]),
                    f"{r['raw']['median_us']:.1f}", f"{r['gather']['median_us']:.1f}",
                    f"{r['direct']['median_us']:.1f}", f"{r['direct_cached']['median_us']:.1f}",
                    f"{r['ratio_gather_to_raw']:.2f}x", f"{r['ratio_direct_to_gather']:.2f}x",
                    f"{r['ratio_direct_cached_to_gather']:.2f}x", "yes" if ok else "NO"])
    return out


__all__ = ["POOL_PATHS", "PoolShape", "PoolSource", "pool_shapes", "layer_runs", "measure_pool_shape",
           "derive_region_rule", "run_pool_paths", "pool_rows", "POOL_HEADER"]

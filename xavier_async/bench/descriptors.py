"""Packed path vs descriptor path, per batch shape, over raw NIXL between two processes.

The engine ships one source path: gather the batch into the registered send slab (one
pass of :func:`~xavier_async.packing.pack` over a run table, as the endpoint does) and post
ONE contiguous WRITE of it. The other path registers the caches with NIXL once and, per
batch, posts a prepared descriptor list straight from them (``prep_xfer_dlist`` made once
for every ``(layer, slot)`` block, ``make_prepped_xfer`` with numpy index arrays per batch,
as vLLM does). This section measures, for each batch shape (see :data:`PATHS`): packed;
prepped into the peer's slab; one descriptor per contiguous run (``initialize_xfer`` from
the run table) into the peer's slab; prepped straight into the peer's cache slots; and
the engine's unpack (measured here, the receiver's share of the packed path). From the
figures it derives which path to use when, into the slab and into the slots.

This process is the source (caches, send slab, one NIXL agent); a child process owns the
destination slab and caches (its own agent). The slab paths land the batch layer-major,
exactly where the packed slab puts it, so one check covers them: the peer's slab, zeroed
before each path, equals the blocks read straight from the caches (``torch.cat``,
independent of the packing code) after it; the direct path is checked the same way on
the peer's zeroed slots. Device-generic: on CUDA the caches are on ``cuda:0`` and the
peer's memory on ``cuda:1`` (VRAM, CUDA IPC through UCX; ``cuda:0`` too with one GPU:
:func:`~xavier_async.testing.devices.peer_device`); on the CPU both are DRAM.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..layout import CacheLayout
from ..packing import CacheTable, DeviceRuns, SlabRows, byte_rows, pack, pack_table, unpack
from ..planning import PlannedBatch, Planner
from ..testing.devices import gpu_facts, peer_device
from ..testing.peer_process import LayoutSpec, digest, pattern_caches
from .common import bench_layout, stats

PATHS = ("packed", "prepped", "runs", "direct")
#: ``packed``: pack + one WRITE into the peer's slab; ``prepped``: ``make_prepped_xfer``
#: per batch from the block descriptors prepared once, into the peer's slab; ``runs``:
#: ``initialize_xfer`` per batch with one descriptor per run, into the peer's slab;
#: ``direct``: prepped, into the peer's cache slots (no unpack needed at the receiver)


@dataclass(frozen=True)
class Shape:
    """A batch: these source slots (block hashes) in these layers, layer-major."""

    name: str
    slots: tuple[int, ...]
    layers: tuple[int, ...]
    #: the length of its runs of consecutive slots in each layer
    run: int

    @property
    def blocks(self) -> int:
        return len(self.slots) * len(self.layers)


def runs_of_slots(n: int, run: int, rng: random.Random) -> tuple[str, tuple[int, ...]]:
    """``n`` slots in runs of ``run`` consecutive ones with a gap after each, the runs in
    shuffled order, and the shape's name (1: scattered, ``n``: consecutive)."""
    starts = list(range(0, 2 * n, 2 * run))[: -(-n // run)]
    rng.shuffle(starts)
    slots = tuple(s + i for s in starts for i in range(run))[:n]
    name = (f"{n} hashes consecutive" if run == n else
            f"{n} hashes scattered" if run == 1 else f"{n} hashes in runs of {run}")
    return name, slots


def shapes(layout: LayoutSpec, full_bytes: int, seed: int = 0) -> list[Shape]:
    """One hash x all layers, one layer block, then ``n`` hashes x all layers (``n`` = 64,
    or as many as fit the slab) in runs of 1 (scattered), 4, 16 and ``n`` consecutive slots."""
    layers = tuple(range(layout.layers))
    n = max(1, min(64, full_bytes // (layout.layers * layout.block_nbytes), layout.num_slots // 2))
    rng = random.Random(seed)
    out = [Shape("one hash x all layers", (0,), layers, 1),
           Shape("one layer block", (0,), (0,), 1)]
    for run in sorted({1, 4, 16, n}):
        if run > n:
            continue
        name, slots = runs_of_slots(n, run, rng)
        out.append(Shape(name, slots, layers, run))
    return out


def derive_rule(results: Sequence[dict[str, Any]], to_slots: bool = False) -> dict[str, Any]:
    """The choice the measurements support, from the rows of :func:`run_descriptors`
    (each with ``slots``, ``run`` and per path ``median_us``).

    Into the peer's slab (default): the descriptor path is the faster of ``prepped`` and
    ``runs``, against ``packed``. Into the peer's slots (``to_slots``): ``direct`` against
    ``packed`` plus the ``unpack`` the receiver then needs. Among the multi-hash shapes
    (same bytes, runs of different lengths), ``min_run`` is the shortest run length from
    which the descriptor path is faster for that and every longer run measured (None:
    never). Single-hash shapes are judged one by one."""
    kinds = ("direct",) if to_slots else ("prepped", "runs")

    def best_desc(r: dict[str, Any]) -> tuple[str, float]:
        return min(((p, r[p]["median_us"]) for p in kinds if p in r), key=lambda x: x[1])

    def packed(r: dict[str, Any]) -> float:
        cost = float(r["packed"]["median_us"])
        return cost + float(r["unpack"]["median_us"]) if to_slots else cost

    multi = sorted((r for r in results if len(r["slots"]) > 1), key=lambda r: r["run"])
    min_run: int | None = None
    for i, r in enumerate(multi):
        if all(best_desc(x)[1] < packed(x) for x in multi[i:]):
            min_run = r["run"]
            break
    singles = {r["shape"]: (f"descriptor ({best_desc(r)[0]})" if best_desc(r)[1] < packed(r) else "packed")
               for r in results if len(r["slots"]) == 1}
    if not multi:
        text = "no multi-hash shape measured"
    elif min_run is None:
        text = "packed for every multi-hash shape measured (no run length where descriptors win)"
    elif min_run == multi[0]["run"]:
        text = f"descriptor path for every multi-hash shape measured (runs >= {min_run})"
    else:
        text = (f"descriptor path when runs per layer are >= {min_run} consecutive slots, "
                f"packed otherwise")
    single_text = "; ".join(f"{k}: {v}" for k, v in singles.items())
    return {"min_run": min_run, "single_hash": singles, "to_slots": to_slots,
            "text": text + (f"; single hash: {single_text}" if single_text else "")}


# -- the peer: one agent, one destination slab ------------------------------------------------
def _peer_main(conn: Any, nbytes: int, device: str, layers: int, num_slots: int, bn: int) -> None:
    """Child process: register a zeroed slab of ``nbytes`` and zeroed caches (``layers``
    tensors of ``num_slots`` blocks of ``bn`` bytes); answer zero/digest requests."""
    import logging
    logging.getLogger("nixl").setLevel(logging.WARNING)
    from nixl._api import nixl_agent, nixl_agent_config
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    slab = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    caches = [torch.zeros((num_slots, bn), dtype=torch.uint8, device=dev) for _ in range(layers)]
    mem, dev_id = ("VRAM", dev.index or 0) if dev.type == "cuda" else ("DRAM", 0)
    # its progress thread drives the target side while this process waits on the pipe
    agent = nixl_agent("dpath-peer", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(agent.get_reg_descs([(slab.data_ptr(), nbytes, dev_id, "")], mem))
    agent.register_memory(agent.get_reg_descs([(c.data_ptr(), c.numel(), dev_id, "") for c in caches],
                                              mem))
    conn.send((agent.get_agent_metadata(), slab.data_ptr(), [c.data_ptr() for c in caches], dev_id, mem))

    def blocks(ls: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
        idx = torch.tensor(list(slots), dtype=torch.long, device=dev)
        return torch.cat([caches[layer].index_select(0, idx).reshape(-1) for layer in ls])

    while True:
        msg = conn.recv()
        if msg[0] == "zero":
            slab[: msg[1]].zero_()
        elif msg[0] == "digest":
            conn.send(digest(slab[: msg[1]]))
            continue
        elif msg[0] == "zero_slots":
            for layer in msg[1]:
                caches[layer][torch.tensor(list(msg[2]), dtype=torch.long, device=dev)] = 0
        elif msg[0] == "digest_slots":
            conn.send(digest(blocks(msg[1], msg[2])))
            continue
        else:
            conn.send(True)
            return
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        conn.send(True)


def transfer_to_done(agent: Any, h: Any) -> None:
    """Post the prepared transfer ``h`` and check it until it is terminal (anything but
    DONE raises)."""
    state = agent.transfer(h)
    while state == "PROC":
        state = agent.check_xfer_state(h)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed: {state}")


class _Peer:
    def __init__(self, nbytes: int, device: str, layout: LayoutSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, daemon=True,
                                args=(theirs, nbytes, device, layout.layers, layout.num_slots,
                                      layout.block_nbytes))
        self.proc.start()
        deadline = time.monotonic() + 120
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the descriptor-path peer process did not start")
        self.meta, self.ptr, self.cache_ptrs, self.dev, self.mem = self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        return self.conn.recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close")
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# -- the source ---------------------------------------------------------------------------------
class Source:
    """This process's side: caches and send slab registered with one agent (counted),
    block descriptor lists prepared once, a packed-WRITE handle per size (as the
    transport keeps them)."""

    def __init__(self, layout: LayoutSpec, full_bytes: int, device: str, peer: _Peer,
                 seed: int = 0) -> None:
        from nixl._api import nixl_agent, nixl_agent_config
        self.layout, self.full_bytes, self.peer = layout, full_bytes, peer
        self.device = torch.device(device)
        self.caches = pattern_caches(layout, 0, seed, self.device)
        self.rows = byte_rows(self.caches)
        self.table = CacheTable(self.rows)
        self.bn = layout.block_nbytes
        self.slab = torch.zeros(full_bytes, dtype=torch.uint8, device=self.device)
        self.slab_rows = SlabRows(self.slab, [self.bn])
        self.planner = Planner(CacheLayout.of(self.caches), full_bytes)
        self.device_runs: DeviceRuns | None = None
        cuda = self.device.type == "cuda"
        if cuda:
            try:
                self.device_runs = DeviceRuns(self.device)
            except Exception:  # no Triton: the tensor path, synchronized (as the endpoint)
                self.device_runs = None
        self.mem, self.dev_id = ("VRAM", self.device.index or 0) if cuda else ("DRAM", 0)
        # telemetry: how many descriptors NIXL posted after merging (same cost on all paths)
        self.agent = nixl_agent("dpath-source", nixl_agent_config(enable_prog_thread=False,
                                                                  capture_telemetry=True,
                                                                  backends=["UCX"]))
        self.registrations = 0           # register_memory calls
        self.registered_descs = 0        # regions in them
        self._register([(t.data_ptr(), t.numel(), self.dev_id, "") for t in self.rows.values()])
        self.cache_registrations = self.registrations
        self._register([(self.slab.data_ptr(), full_bytes, self.dev_id, "")])
        self.peer_name = self.agent.add_remote_agent(peer.meta)
        # every (layer, slot) block of the caches; index = layer * num_slots + slot
        S = layout.num_slots
        local = np.array([(self.table.base[layer] + s * self.bn, self.bn, self.dev_id)
                          for layer in range(layout.layers) for s in range(S)], dtype=np.uint64)
        self.local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, self.mem)
        # the peer's slab in block-sized descriptors
        nrem = full_bytes // self.bn
        remote = np.array([(peer.ptr + j * self.bn, self.bn, peer.dev) for j in range(nrem)],
                          dtype=np.uint64)
        self.remote_dlist = self.agent.prep_xfer_dlist(self.peer_name, remote, peer.mem)
        # every (layer, slot) block of the peer's caches, indexed as ours
        rcaches = np.array([(peer.cache_ptrs[layer] + s * self.bn, self.bn, peer.dev)
                            for layer in range(layout.layers) for s in range(S)], dtype=np.uint64)
        self.remote_caches = self.agent.prep_xfer_dlist(self.peer_name, rcaches, peer.mem)
        self.prepped_descriptors = (len(local), nrem, len(rcaches))
        self._handles: dict[int, Any] = {}

    def _register(self, regions: list[tuple[int, int, int, str]]) -> None:
        self.agent.register_memory(self.agent.get_reg_descs(regions, self.mem))
        self.registrations += 1
        self.registered_descs += len(regions)

    def close(self) -> None:
        for h in self._handles.values():
            self.agent.release_xfer_handle(h)
        self._handles.clear()
        for d in (self.local_dlist, self.remote_dlist, self.remote_caches):
            self.agent.release_dlist_handle(d)
        self.agent.remove_remote_agent(self.peer_name)

    # -- helpers
    def plan(self, shape: Shape) -> PlannedBatch:
        req = {1: {layer: {s: s for s in shape.slots} for layer in shape.layers}}
        batches = self.planner.plan(req)
        if len(batches) != 1:
            raise ValueError(f"{shape.name}: {len(batches)} batches, the bench needs one "
                             "(raise full_bytes)")
        return batches[0]

    def expected(self, shape: Shape) -> str:
        """The bytes the peer must hold, read straight from the caches."""
        idx = torch.tensor(shape.slots, dtype=torch.long, device=self.device)
        return digest(torch.cat([self.rows[layer].index_select(0, idx).reshape(-1)
                                  for layer in shape.layers]))

    def _wait(self, h: Any) -> None:
        transfer_to_done(self.agent, h)

    def _packed_handle(self, nbytes: int) -> Any:
        h = self._handles.get(nbytes)
        if h is None:  # made once per size, like the transport's handle cache
            h = self._handles[nbytes] = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs([(self.slab.data_ptr(), nbytes, self.dev_id)], self.mem),
                self.agent.get_xfer_descs([(self.peer.ptr, nbytes, self.peer.dev)], self.peer.mem),
                self.peer_name)
        return h

    # -- the three paths: each one transfer of a batch, to DONE
    def packed(self, batch: PlannedBatch, slot_lists: Sequence[Sequence[int]]) -> None:
        event = pack(self.slab_rows, batch.segments, slot_lists, self.table, self.device_runs)
        if event is not None:  # NIXL does not order against CUDA streams
            event.synchronize()
        self._wait(self._packed_handle(batch.nbytes))

    def prepped(self, layers: np.ndarray, slots: np.ndarray, telemetry: bool = False,
                dest: np.ndarray | None = None) -> int | None:
        """One batch through the prepared lists: into the peer's slab (layer-major), or
        with ``dest`` into those slots of the peer's caches. With ``telemetry``, returns how
        many descriptors NIXL posted (after merging adjacent ones), or None if it cannot say."""
        S = self.layout.num_slots
        local = (layers[:, None] * S + slots[None, :]).astype(np.int32).ravel()
        if dest is None:
            remote, side = np.arange(local.size, dtype=np.int32), self.remote_dlist
        else:
            remote, side = (layers[:, None] * S + dest[None, :]).astype(np.int32).ravel(), self.remote_caches
        h = self.agent.make_prepped_xfer("WRITE", self.local_dlist, local, side, remote)
        try:
            self._wait(h)
            if telemetry:
                try:
                    return int(self.agent.get_xfer_telemetry(h).descCount)
                except Exception:  # an older NIXL, or telemetry off
                    return None
            return None
        finally:
            self.agent.release_xfer_handle(h)

    def unpack(self, batch: PlannedBatch) -> None:
        """The receiver's share of the packed path, estimated here: the engine's
        ``unpack`` of the batch from the slab into its slots (the same slots the slab's
        blocks came from, so the caches keep their bytes)."""
        unpack(self.slab_rows, batch, self.table, self.device_runs, wait=True)

    def runs(self, batch: PlannedBatch, slot_lists: Sequence[Sequence[int]]) -> int:
        dst, src, ns = pack_table(self.slab.data_ptr(), batch.segments, slot_lists, self.table)
        n = np.asarray(ns, dtype=np.uint64)
        dev_l = np.full(n.size, self.dev_id, dtype=np.uint64)
        dev_r = np.full(n.size, self.peer.dev, dtype=np.uint64)
        local = np.stack([np.asarray(src, dtype=np.uint64), n, dev_l], axis=1)
        remote = np.stack([np.asarray(dst, dtype=np.uint64) - np.uint64(self.slab.data_ptr())
                           + np.uint64(self.peer.ptr), n, dev_r], axis=1)
        h = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self.mem),
                                       self.agent.get_xfer_descs(remote, self.peer.mem), self.peer_name)
        try:
            self._wait(h)
        finally:
            self.agent.release_xfer_handle(h)
        return int(n.size)


def measure_shape(src: Source, shape: Shape, iters: int, warmup: int) -> dict[str, Any]:
    """Median per transfer of each path and of the engine's unpack (interleaved in
    rounds), with the peer's bytes checked after each path's warm-up and again after its
    timed runs, and the registrations made while measuring."""
    batch = src.plan(shape)
    slot_lists = [[int(k) for k in seg.keys] for seg in batch.segments]  # key = source slot
    # the descriptor indices assume the slab is layer-major, consecutive blocks: check it once
    offs = [seg.offset + i * seg.block_nbytes for seg in batch.segments for i in range(len(seg.keys))]
    if offs != [j * src.bn for j in range(shape.blocks)]:
        raise AssertionError(f"{shape.name}: the packed slab is not layer-major blocks")
    layers = np.asarray(shape.layers, dtype=np.int64)
    slots = np.asarray(shape.slots, dtype=np.int64)
    calls: dict[str, Callable[[], Any]] = {
        "packed": lambda: src.packed(batch, slot_lists),
        "prepped": lambda: src.prepped(layers, slots),
        "runs": lambda: src.runs(batch, slot_lists),
        "direct": lambda: src.prepped(layers, slots, dest=slots),  # into the same slots there
        "unpack": lambda: src.unpack(batch),
    }
    want = src.expected(shape)
    nbytes = batch.nbytes
    times: dict[str, list[float]] = {p: [] for p in calls}
    checked: dict[str, bool] = {}
    regs0 = src.registrations
    rounds = 8  # interleaved, so that drift and a neighbour's burst hit every path alike
    per = max(1, iters // rounds)
    perf = time.perf_counter
    peer = src.peer

    def zero(p: str) -> None:
        if p == "direct":
            peer.call("zero_slots", list(shape.layers), list(shape.slots))
        else:
            peer.call("zero", nbytes)

    def landed(p: str) -> bool:
        got = (peer.call("digest_slots", list(shape.layers), list(shape.slots)) if p == "direct"
               else peer.call("digest", nbytes))
        return bool(got == want)

    for p in PATHS:  # warm-up, and each path's bytes checked from a zeroed destination
        zero(p)
        for _ in range(warmup):
            calls[p]()
        checked[p] = landed(p)
    for _ in range(warmup):
        calls["unpack"]()
    for _ in range(rounds):
        for p, f in calls.items():
            for _ in range(per):
                t = perf()
                f()
                times[p].append(perf() - t)
    for p in PATHS:  # after the timed runs too
        zero(p)
        calls[p]()
        checked[p] = checked[p] and landed(p)
    row: dict[str, Any] = {"shape": shape.name, "slots": list(shape.slots), "layers": len(shape.layers),
                           "run": shape.run, "blocks": shape.blocks, "bytes": nbytes,
                           "run_descriptors": src.runs(batch, slot_lists),
                           "block_descriptors": shape.blocks,
                           "nixl_posted_descriptors": src.prepped(layers, slots, telemetry=True),
                           "registrations_after_warmup": src.registrations - regs0,
                           # the source's caches must be unchanged by the unpack estimate
                           "source_caches_intact": src.expected(shape) == want}
    for p in PATHS:
        row[p] = {**stats(times[p]), "bytes_verified": checked[p]}
    row["unpack"] = stats(times["unpack"])
    best = min(("prepped", "runs"), key=lambda p: row[p]["median_us"])
    row["best_descriptor_path"] = best
    row["ratio_descriptor_to_packed"] = row[best]["median_us"] / row["packed"]["median_us"]
    row["ratio_prepped_to_packed"] = row["prepped"]["median_us"] / row["packed"]["median_us"]
    row["packed_plus_unpack_us"] = row["packed"]["median_us"] + row["unpack"]["median_us"]
    row["ratio_direct_to_packed_plus_unpack"] = row["direct"]["median_us"] / row["packed_plus_unpack_us"]
    return row


def run_descriptors(full_bytes: int = 12 << 20, device: str = "auto", iters: int = 200,
                    warmup: int = 10, seed: int = 0, quick: bool = False,
                    report: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every shape, both paths (three variants); the rule; registrations. Synchronous: it
    runs its own peer process and no event loop."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if quick:
        iters, warmup = min(iters, 20), min(warmup, 3)
    here, there = peer_device(0, device).device, peer_device(1, device).device
    layout = bench_layout(full_bytes)
    peer = _Peer(full_bytes, there, layout)
    try:
        src = Source(layout, full_bytes, here, peer, seed)
        try:
            rows = []
            for shape in shapes(layout, full_bytes, seed):
                report(f"descriptors: {shape.name}")
                big = shape.blocks * layout.block_nbytes >= (1 << 20)
                rows.append(measure_shape(src, shape, max(8, iters // 2) if big else iters, warmup))
            out: dict[str, Any] = {
                "device": device, "memory": src.mem, **gpu_facts(device),
                "block_bytes": layout.block_nbytes,
                "layers": layout.layers, "num_slots": layout.num_slots,
                "cache_registrations": src.cache_registrations,
                "cache_regions_registered": len(src.rows),
                "registrations_at_start": src.registrations,
                "registrations_after_warmup": sum(r["registrations_after_warmup"] for r in rows),
                "prepped_descriptors": {"local": src.prepped_descriptors[0],
                                        "remote_slab": src.prepped_descriptors[1],
                                        "remote_caches": src.prepped_descriptors[2]},
                "shapes": rows, "rule": derive_rule(rows),
                "rule_to_slots": derive_rule(rows, to_slots=True)}
        finally:
            src.close()
    finally:
        peer.close()
    return out


def print_descriptors(d: dict[str, Any]) -> list[list[str]]:
    """The section's table rows: shape, bytes, runs of consecutive slots, descriptors NIXL
    posted for the prepped transfer (after merging), the medians into the peer's slab and
    the best descriptor variant over packed, then into the peer's slots: direct against
    packed plus the unpack, and whether every path's bytes were right."""
    out = []
    for r in d["shapes"]:
        ok = all(r[p]["bytes_verified"] for p in PATHS) and r.get("source_caches_intact", True)
        posted = r.get("nixl_posted_descriptors")
        out.append([r["shape"], f"{r['bytes'] // 1024} KiB", str(r["run_descriptors"]),
                    "-" if posted is None else f"{posted} of {r['block_descriptors']}",
                    f"{r['packed']['median_us']:.1f}", f"{r['prepped']['median_us']:.1f}",
                    f"{r['runs']['median_us']:.1f}", f"{r['ratio_descriptor_to_packed']:.2f}x",
                    f"{r['unpack']['median_us']:.1f}", f"{r['direct']['median_us']:.1f}",
                    f"{r['ratio_direct_to_packed_plus_unpack']:.2f}x", "yes" if ok else "NO"])
    return out


HEADER = ["shape", "bytes", "runs", "NIXL posted", "packed", "prepped", "runs path",
          "best desc/packed", "unpack", "direct", "direct/(packed+unpack)", "bytes ok"]


__all__ = ["Shape", "shapes", "derive_rule", "run_descriptors", "measure_shape", "print_descriptors",
           "PATHS", "HEADER"]

"""The plain-Python floor of a load's protocol over NIXL, with no library around it: what
any Python engine that moves KV blocks through registered slabs pays at least, measured
beside the library's loads of the same shapes (issue 24).

Two processes, each with a bare NIXL agent (UCX, NIXL's progress thread off), one cache
tensor ``[layers, slots, block]`` and one registered slab; a WRITE handle per shape is made
once, so nothing is created per load. One load is:

1. the loader sends a request notification (``struct``: mode, shape, sequence number);
2. (``gather`` mode) the source copies the requested blocks of every requested layer into
   its slab with ONE strided torch copy (on CUDA, synchronised by an event);
3. the source posts the shape's WRITE, which carries the done notification, and checks it
   until DONE (the notification waits on that check);
4. the loader polls ``get_new_notifs`` until the done notification arrives and
   (``gather`` mode) copies the blocks out of its slab into its cache with ONE strided copy.

Modes: ``notify`` (steps 1, 3, 4, tight polling), ``asyncio`` (the same, the loader
yielding to an asyncio loop between polls) and ``gather`` (all four steps, tight polling).
Shapes: the bench's load rows (one block hash over every layer, one layer block, a full
slab of hashes). The gathered bytes are checked against the source's cache after the
timed runs.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import struct
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from ..testing.devices import peer_device
from ..testing.peer_process import LayoutSpec
from .common import stats

#: mode, shape index, sequence number
_REQ = struct.Struct("<BBI")
_DONE = struct.Struct("<I")
_QUIT = b"quit"
MODES = ("notify", "asyncio", "gather")
_GATHER = 1


def floor_shapes(layout: LayoutSpec, full_bytes: int) -> dict[str, tuple[int, int]]:
    """The load rows' shapes as (layers, blocks): ``small`` one hash over every layer,
    ``small_one_layer`` one layer block, ``large`` as many hashes as fill the slab."""
    per_hash = layout.layers * layout.block_nbytes
    return {"small": (layout.layers, 1), "small_one_layer": (1, 1),
            "large": (layout.layers, max(1, min(layout.num_slots // 2, full_bytes // per_hash)))}


def _cache(layout: LayoutSpec, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 256, (layout.layers, layout.num_slots, layout.block_nbytes),
                      dtype=torch.uint8, generator=g)
    return c.to(device)


def _name(agent: bytes | str) -> str:
    return agent.decode() if isinstance(agent, bytes) else agent


class _Side:
    """One process's agent, cache and registered slab."""

    def __init__(self, name: str, index: int, device: str, layout: LayoutSpec,
                 full_bytes: int, seed: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config
        self.device = torch.device(peer_device(index, device).device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # no OpenMP threads spinning against the polling loop
        self.cache = _cache(layout, seed, self.device)
        self.slab = torch.zeros(full_bytes, dtype=torch.uint8, device=self.device)
        self.mem, self.dev_id = (("VRAM", self.device.index or 0) if self.device.type == "cuda"
                                 else ("DRAM", 0))
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False,
                                                        backends=["UCX"]))
        self.agent.register_memory(self.agent.get_reg_descs(
            [(self.slab.data_ptr(), full_bytes, self.dev_id, "")], self.mem))
        self.event = torch.cuda.Event() if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def sync(self) -> None:
        if self.event is not None:
            self.event.record()
            self.event.synchronize()

    def meta(self) -> tuple[bytes, int, int, str]:
        return self.agent.get_agent_metadata(), self.slab.data_ptr(), self.dev_id, self.mem


def _source_main(conn: Any, device: str, layout: LayoutSpec, full_bytes: int, seed: int,
                 cpus: Sequence[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    side = _Side("floor-source", 1, device, layout, full_bytes, seed)
    agent, slab, cache = side.agent, side.slab, side.cache
    conn.send(side.meta())
    meta, ptr, dev, mem = conn.recv()
    loader = _name(agent.add_remote_agent(meta))  # get_new_notifs keys by str
    shapes = list(floor_shapes(layout, full_bytes).values())
    bn = layout.block_nbytes
    handles = [agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs([(slab.data_ptr(), ls * n * bn, side.dev_id)], side.mem),
        agent.get_xfer_descs([(ptr, ls * n * bn, dev)], mem), loader) for ls, n in shapes]
    views = [slab[: ls * n * bn].view(ls, n, bn) for ls, n in shapes]
    conn.send(("ready", sorted(os.sched_getaffinity(0))))
    poll = agent.get_new_notifs
    while True:
        for msg in poll().get(loader, ()):
            if msg == _QUIT:
                conn.send("bye")
                return
            mode, shape, seq = _REQ.unpack(msg)
            if mode == _GATHER:
                ls, n = shapes[shape]
                views[shape].copy_(cache[:ls, :n])
                side.sync()
            h = handles[shape]
            state = agent.transfer(h, _DONE.pack(seq))
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                conn.send(f"WRITE ended {state}")
                return


class _Loader:
    """This process's side of the floor, and the source process it drives."""

    def __init__(self, device: str, layout: LayoutSpec, full_bytes: int, seed: int,
                 source_cpus: Sequence[int] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_source_main, daemon=True,
                                args=(theirs, device, layout, full_bytes, seed, source_cpus))
        self.proc.start()
        self.layout, self.seed = layout, seed
        self.side = _Side("floor-loader", 0, device, layout, full_bytes, seed + 1)
        meta = self._recv(120)
        self.conn.send(self.side.meta())
        self.source = _name(self.side.agent.add_remote_agent(meta[0]))
        ready = self._recv(60)
        if not isinstance(ready, tuple) or ready[0] != "ready":
            raise RuntimeError("the protocol-floor source did not start")
        #: the CPUs the source process may run on
        self.source_cpus: list[int] = ready[1]
        while not self.side.agent.check_remote_metadata(self.source):
            time.sleep(0.001)
        self.shapes = list(floor_shapes(layout, full_bytes).values())
        bn = layout.block_nbytes
        self.views = [self.side.slab[: ls * n * bn].view(ls, n, bn) for ls, n in self.shapes]
        self.seq = 0

    def _recv(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the protocol-floor source process did not answer")
        return self.conn.recv()

    def _request(self, shape: int, mode: int) -> bytes:
        self.seq += 1
        self.side.agent.send_notif(self.source, _REQ.pack(mode, shape, self.seq))
        return _DONE.pack(self.seq)

    def _land(self, shape: int) -> None:
        """Step 4's copy: the blocks out of the slab into slots 1.. of the cache."""
        ls, n = self.shapes[shape]
        self.side.cache[:ls, 1:1 + n].copy_(self.views[shape])
        self.side.sync()

    def load(self, shape: int, gather: bool) -> None:
        want = self._request(shape, _GATHER if gather else 0)
        poll, src = self.side.agent.get_new_notifs, self.source
        while want not in poll().get(src, ()):
            pass
        if gather:
            self._land(shape)

    async def load_async(self, shape: int) -> None:
        want = self._request(shape, 0)
        poll, src = self.side.agent.get_new_notifs, self.source
        while want not in poll().get(src, ()):
            await asyncio.sleep(0)

    def check(self, shape: int) -> bool:
        """The gathered blocks equal the source's cache (regenerated from its seed)."""
        ls, n = self.shapes[shape]
        expected = _cache(self.layout, self.seed, torch.device("cpu"))[:ls, :n]
        return bool(torch.equal(self.side.cache[:ls, 1:1 + n].cpu(), expected))

    def close(self) -> None:
        try:
            self.side.agent.send_notif(self.source, _QUIT)
            self._recv(10)
        except Exception:  # noqa: BLE001 - the process is killed below either way
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _timed(fn: Callable[[], None], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


async def _timed_async(fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


def protocol_floor(layout: LayoutSpec, full_bytes: int, device: str, iters: int,
                   warmup: int = 20, seed: int = 0,
                   names: Sequence[str] | None = None,
                   cpus: tuple[Sequence[int], Sequence[int]] | None = None) -> dict[str, Any]:
    """Per shape (the load rows' names): p50/p95/mean of each mode, the shape's bytes, and
    whether the gathered bytes were right. Runs its own two processes (call it with no
    other bench process polling). ``cpus``: (the loader's, the source's) CPUs; the loader
    is the calling thread, whose affinity is restored afterwards. Both poll without
    yielding: sharing one CPU they would take turns a timeslice at a time."""
    shapes = floor_shapes(layout, full_bytes)
    wanted = list(names or shapes)
    before = os.sched_getaffinity(0) if cpus is not None else None
    if cpus is not None:
        os.sched_setaffinity(0, cpus[0])
    loader: _Loader | None = None
    try:
        loader = _Loader(device, layout, full_bytes, seed, cpus[1] if cpus is not None else None)
        out: dict[str, Any] = {}
        for i, (name, (ls, n)) in enumerate(shapes.items()):
            if name not in wanted:
                continue
            reps = iters if name != "large" else max(10, iters // 4)
            row: dict[str, Any] = {"layers": ls, "blocks": n, "bytes": ls * n * layout.block_nbytes}
            row["notify"] = stats(_timed(partial(loader.load, i, False), reps, warmup))
            row["asyncio"] = stats(asyncio.run(_timed_async(partial(loader.load_async, i),
                                                            reps, warmup)))
            row["gather"] = stats(_timed(partial(loader.load, i, True), reps, warmup))
            row["bytes_ok"] = loader.check(i)
            out[name] = row
        return out
    finally:
        if loader is not None:
            loader.close()
        if before is not None:
            os.sched_setaffinity(0, before)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -c 'from xavier_async.bench.protocol_floor import main; main()' [cpu|cuda]``:
    the floor alone, for the bench's default layout (12 MiB slab, 24 layers of 8 KiB)."""
    import sys

    from .common import bench_layout
    args = list(sys.argv[1:] if argv is None else argv)
    device = args[0] if args else "cpu"
    full = 12 << 20
    res = protocol_floor(bench_layout(full), full, device, iters=300)
    print(f"plain-Python protocol floor over NIXL, {device}, p50 us (300 iterations; large: 75)")
    for name, row in res.items():
        print(f"{name:16s} {row['bytes'] / 1024:8.0f} KiB  " +
              "  ".join(f"{m} {row[m]['median_us']:9.1f}" for m in MODES) +
              f"  bytes {'ok' if row['bytes_ok'] else 'WRONG'}")


__all__ = ["protocol_floor", "floor_shapes", "main", "MODES"]

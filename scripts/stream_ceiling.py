"""Raw NIXL: how fast a stream of large scattered loads can go, by design (issue 34, point 3).

A load is RUNS runs of RUN bytes (12 MiB of 8 KiB runs by default, the serving bench's large
load), scattered in both processes' "caches" (every other RUN-sized slot, as an engine's
blocks are). No xavier-async code; two processes, DRAM, UCX; both caches and both slabs
registered. Each design streams loads one after another with two slabs in flight (a credit
per slab), and reports GB/s of useful bytes against the raw floor measured in the same run
(one contiguous WRITE of the same bytes, slab to slab, two in flight):

- ``push via slabs`` (today's path): A gathers the runs into a send slab, WRITEs the slab
  into B's receive slab, B scatters them into its cache and returns the credit;
- ``pull into cache``: A gathers into its send slab and tells B; B READs the slab straight
  into its cache runs (one descriptor a run; B owns the transfer, so it can be fenced);
- ``pull into cache, new handle``: the same with the READ's handle made for every load, as
  loads of different blocks need (``initialize_xfer`` of RUNS descriptors each time);
- ``push into cache``: A gathers and WRITEs the slab straight into B's cache runs (the
  issue's direct write; the receiver cannot fence it, shown for reference);
- ``pull cache to cache``: B READs A's cache runs into its own (no gather at all; the source
  would have to hold its blocks until the READ is done).

B's cache is zeroed before each design and compared with A's bytes after it.

Usage: python scripts/stream_ceiling.py [seconds per design [runs [run bytes]]]   (numpy, nixl)"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

SLABS = 2


def _agent(name: str, np, cache_bytes: int, slab_bytes: int):  # type: ignore[no-untyped-def]
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    cache = np.zeros(cache_bytes, dtype=np.uint8)
    slab = np.zeros(slab_bytes * SLABS, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs(
        [(cache.ctypes.data, cache.nbytes, 0, ""), (slab.ctypes.data, slab.nbytes, 0, "")], "DRAM"))
    return agent, cache, slab


def _runs(base: int, runs: int, run: int) -> list[int]:
    return [base + 2 * i * run for i in range(runs)]


def _wait(agent, h, s: str) -> None:  # type: ignore[no-untyped-def]
    while s == "PROC":
        s = agent.check_xfer_state(h)
    if s != "DONE":
        raise RuntimeError(s)


def _notifs(agent, want: int, out: list[bytes]) -> None:  # type: ignore[no-untyped-def]
    give_up = time.perf_counter() + 10
    while len(out) < want:
        for msgs in agent.get_new_notifs().values():
            out.extend(msgs)
        if time.perf_counter() > give_up:
            raise RuntimeError(f"{len(out)} of {want} notifications in 10 s")


def _gather(mm, dst: int, srcs: list[int], run: int) -> None:
    for i, s in enumerate(srcs):
        mm(dst + i * run, s, run)


def _source(conn, runs: int, run: int) -> None:  # type: ignore[no-untyped-def]
    import ctypes

    import numpy as np
    mm = ctypes.memmove
    load = runs * run
    agent, cache, slab = _agent("A", np, 2 * load, load)
    cache[:] = (np.arange(cache.nbytes, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)
    conn.send((agent.get_agent_metadata(), cache.ctypes.data, slab.ctypes.data))
    meta, b_cache, b_slab = conn.recv()
    agent.add_remote_agent(meta)
    while not agent.check_remote_metadata("B"):
        time.sleep(0.01)
    mine = _runs(cache.ctypes.data, runs, run)
    slabs = [slab.ctypes.data + k * load for k in range(SLABS)]

    def descs(pairs):  # type: ignore[no-untyped-def]
        return agent.get_xfer_descs([(a, n, 0) for a, n in pairs], "DRAM")

    to_slab = [agent.initialize_xfer("WRITE", descs([(s, load)]), descs([(b_slab + k * load, load)]), "B")
               for k, s in enumerate(slabs)]
    to_cache = [agent.initialize_xfer(
        "WRITE", descs([(s + i * run, run) for i in range(runs)]),
        descs([(a, run) for a in _runs(b_cache, runs, run)]), "B") for s in slabs]
    conn.send("ready")
    while (cmd := conn.recv()) != "stop":
        design, count = cmd
        credits = list(range(SLABS))
        got: list[bytes] = []
        for seq in range(count):
            if not credits:              # wait for B to hand a slab back
                _notifs(agent, 1, got)
                credits.append(int(got.pop(0)))
            k = credits.pop(0)
            if design != "raw":
                _gather(mm, slabs[k], mine, run)
            if design in ("raw", "push via slabs"):
                h = to_slab[k]
                _wait(agent, h, agent.transfer(h, b"%d" % k))
            elif design == "push into cache":
                h = to_cache[k]
                _wait(agent, h, agent.transfer(h, b"%d" % k))
            else:        # the pulls: B READs on its own once told which slab is ready
                agent.send_notif("B", b"%d" % k)
        _notifs(agent, SLABS - len(credits), got)
        conn.send("done")


def main(seconds: float, runs: int, run: int) -> None:
    import ctypes

    import numpy as np
    mm = ctypes.memmove
    load = runs * run
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(there, runs, run))
    proc.start()
    agent, cache, slab = _agent("B", np, 2 * load, load)
    meta, a_cache, a_slab = here.recv()
    agent.add_remote_agent(meta)
    here.send((agent.get_agent_metadata(), cache.ctypes.data, slab.ctypes.data))
    assert here.recv() == "ready"
    while not agent.check_remote_metadata("A"):
        time.sleep(0.01)
    want = (np.arange(2 * load, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)
    mine = _runs(cache.ctypes.data, runs, run)
    slabs = [slab.ctypes.data + k * load for k in range(SLABS)]

    def descs(pairs):  # type: ignore[no-untyped-def]
        return agent.get_xfer_descs([(a, n, 0) for a, n in pairs], "DRAM")

    def read_slab(k: int):  # type: ignore[no-untyped-def]
        return agent.initialize_xfer("READ", descs([(a, run) for a in mine]),
                                     descs([(a_slab + k * load + i * run, run) for i in range(runs)]), "A")

    reads = [read_slab(k) for k in range(SLABS)]
    cache_to_cache = agent.initialize_xfer("READ", descs([(a, run) for a in mine]),
                                           descs([(a, run) for a in _runs(a_cache, runs, run)]), "A")

    def stream(design: str, count: int) -> float:
        cache[:] = 0
        here.send((design, count))
        t0 = time.perf_counter()
        got: list[bytes] = []
        for _ in range(count):
            _notifs(agent, 1, got)
            k = int(got.pop(0))
            if design == "push via slabs":
                base = slabs[k]
                for i, d in enumerate(mine):
                    mm(d, base + i * run, run)
            elif design == "pull into cache":
                _wait(agent, reads[k], agent.transfer(reads[k]))
            elif design == "pull into cache, new handle":
                h = read_slab(k)
                _wait(agent, h, agent.transfer(h))
                agent.release_xfer_handle(h)
            elif design == "pull cache to cache":
                _wait(agent, cache_to_cache, agent.transfer(cache_to_cache))
            agent.send_notif("A", b"%d" % k)
        assert here.recv() == "done"
        wall = time.perf_counter() - t0
        if design != "raw":
            if not np.array_equal(cache.reshape(-1, 2, run)[:, 0], want.reshape(-1, 2, run)[:, 0]):
                raise RuntimeError(f"{design}: wrong bytes")
        return count * load / wall / 1e9

    designs = ("raw", "push via slabs", "pull into cache", "pull into cache, new handle",
               "push into cache", "pull cache to cache")
    stream("raw", 20)                                    # warm-up
    rates = {}
    for d in designs:
        count = max(8, int(seconds * stream(d, 8) * 1e9 / load))
        rates[d] = stream(d, count)
    raw = stream("raw", max(8, int(seconds * rates["raw"] * 1e9 / load)))
    floor = (rates["raw"] + raw) / 2
    print(f"raw NIXL, DRAM, two processes: loads of {runs} x {run} B ({load / 2**20:g} MiB), "
          f"{SLABS} slabs in flight, bytes checked; raw floor {rates['raw']:.2f} then {raw:.2f} GB/s")
    print(f"{'design':<30} {'GB/s':>6} {'/ raw':>6}")
    for d in designs:
        print(f"{d:<30} {rates[d]:6.2f} {rates[d] / floor:6.2f}")
    here.send("stop")
    proc.join()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(float(a[0]) if a else 2.0, int(a[1]) if len(a) > 1 else 1536,
         int(a[2]) if len(a) > 2 else 8192)

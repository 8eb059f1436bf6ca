"""Raw NIXL: can a large WRITE be posted from a second thread while the loop serves small ones?

Issue 34's first point asks for "posts of large WRITEs" off the event loop: over UCX's
shared-memory path a WRITE is copied inside ``agent.transfer`` by the thread that posts
it (2.8-3.0 ms for 12 MiB in the 2-core serving bench's profile), so a small request that
arrives meanwhile waits. NIXL releases the GIL in ``transfer``; whether a second thread may
call it while the first polls depends on the agent's ``sync_mode``. No xavier-async code:

- A (the source) streams 12 MiB WRITEs into B back to back (each polled to DONE, its
  notification attached) and serves B's small requests (a 64 KiB WRITE with a notification
  per request notification);
- ``inline``: one thread does both, a large post at a time between polls (as the loop does
  today); ``thread <mode>``: a second thread posts the large WRITEs, the main thread only
  serves small ones, the agent built with ``sync_mode`` ``<mode>`` (``NONE``, ``STRICT``,
  ``RW``);
- ``agents``: the second thread posts the large WRITEs through a second agent of A's own
  (registered over the same memory, its own UCX worker), so that the two threads share no
  agent; B knows both;
- B sends a small request after a gap uniform in 0-4 ms and measures request -> landed; it checks the bytes of
  both regions at the end.

Usage: python scripts/post_thread.py [seconds per mode] [agents]   (numpy, nixl;
``agents``: only inline and the second agent)"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import sys
import threading
import time

LARGE, SMALL = 12 * 1024 * 1024, 64 * 1024
PERIOD_S = 0.002


def _pattern(np, n: int, salt: int):  # type: ignore[no-untyped-def]
    return ((np.arange(n, dtype=np.uint64) + salt) * 2654435761 >> 13).astype(np.uint8)


def _agent(name: str, np, sync: str | None):  # type: ignore[no-untyped-def]
    from nixl._api import nixl_agent, nixl_agent_config
    from nixl._api import nixl_thread_sync_t
    mode = None if sync is None else getattr(nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{sync}")
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                               sync_mode=mode))
    buf = np.zeros(LARGE + SMALL, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    return agent, buf


def _wait(agent, h, s: str) -> None:  # type: ignore[no-untyped-def]
    while s == "PROC":
        s = agent.check_xfer_state(h)
    if s != "DONE":
        raise RuntimeError(s)


def _source(conn, design: str, sync: str | None, seconds: float) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    agent, buf = _agent("A", np, sync)
    buf[:LARGE] = _pattern(np, LARGE, 1)
    buf[LARGE:] = _pattern(np, SMALL, 2)
    bulk = agent
    if design == "agents":   # a second agent of A's own, over the same memory, for the large
        from nixl._api import nixl_agent, nixl_agent_config
        bulk = nixl_agent("A2", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        bulk.register_memory(bulk.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    agents = [agent] if bulk is agent else [agent, bulk]
    conn.send(([a.get_agent_metadata() for a in agents], buf.ctypes.data))
    meta, dst = conn.recv()
    for a in agents:
        a.add_remote_agent(meta)
        while not a.check_remote_metadata("B"):
            time.sleep(0.01)
    d = agent.get_xfer_descs
    large = bulk.initialize_xfer("WRITE", bulk.get_xfer_descs([(buf.ctypes.data, LARGE, 0)], "DRAM"),
                                 bulk.get_xfer_descs([(dst, LARGE, 0)], "DRAM"), "B")
    small = agent.initialize_xfer("WRITE", d([(buf.ctypes.data + LARGE, SMALL, 0)], "DRAM"),
                                  d([(dst + LARGE, SMALL, 0)], "DRAM"), "B")
    conn.send("ready")
    stop = threading.Event()
    larges = [0]

    def stream() -> None:       # as a copy thread would: post, then yield while not DONE
        while not stop.is_set():
            s = bulk.transfer(large, b"L")
            while s == "PROC":
                time.sleep(50e-6)
                s = bulk.check_xfer_state(large)
            if s != "DONE":
                raise RuntimeError(s)
            larges[0] += 1

    t = None
    if design in ("thread", "agents"):
        t = threading.Thread(target=stream)
        t.start()
    end = time.perf_counter() + seconds
    served = 0
    while time.perf_counter() < end:
        for msgs in agent.get_new_notifs().values():
            for m in msgs:
                _wait(agent, small, agent.transfer(small, m))
                served += 1
        if design == "inline":
            _wait(agent, large, agent.transfer(large, b"L"))
            larges[0] += 1
    stop.set()
    if t is not None:
        t.join()
    conn.send((served, larges[0]))


def run(design: str, sync: str | None, seconds: float) -> tuple[list[float], float, bool]:
    import numpy as np
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(there, design, sync, seconds))
    proc.start()
    agent, buf = _agent("B", np, None)
    metas, _ = here.recv()
    for meta in metas:
        agent.add_remote_agent(meta)
    here.send((agent.get_agent_metadata(), buf.ctypes.data))
    assert here.recv() == "ready"
    rng = random.Random(7)          # random gaps, so requests do not lock to A's phase
    lat: list[float] = []
    seq, t_end = 0, time.perf_counter() + seconds - 0.05
    while time.perf_counter() < t_end:
        want = b"S%d" % seq
        t0 = time.perf_counter()
        agent.send_notif("A", want)
        while True:
            got = [m for msgs in agent.get_new_notifs().values() for m in msgs]
            if want in got:
                break
            if time.perf_counter() - t0 > 5:
                raise RuntimeError("a small load did not land in 5 s")
        lat.append((time.perf_counter() - t0) * 1e6)
        seq += 1
        rest = rng.uniform(0, 2 * PERIOD_S) - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
    while not here.poll(0.001):      # keep B's agent progressing until A is done
        agent.get_new_notifs()
    served, larges = here.recv()
    proc.join()
    ok = bool(np.array_equal(buf[:LARGE], _pattern(np, LARGE, 1))
              and np.array_equal(buf[LARGE:], _pattern(np, SMALL, 2)) and served >= len(lat))
    return lat, larges * LARGE / seconds / 1e9, ok


def main(seconds: float) -> None:
    print(f"raw NIXL, DRAM: A streams {LARGE >> 20} MiB WRITEs into B and serves B's "
          f"{SMALL >> 10} KiB requests (gaps uniform in 0-{2 * PERIOD_S * 1e3:g} ms); {seconds:g} s a mode")
    print(f"{'design':<14} {'small p50 us':>12} {'p99 us':>9} {'large GB/s':>10} bytes")
    designs = [("inline", None), ("agents", None), ("thread", "STRICT")]
    if len(sys.argv) > 2 and sys.argv[2] == "agents":   # the new design only, beside inline
        designs = designs[:2]
    for design, sync in designs * 2:
        try:
            lat, gbs, ok = run(design, sync, seconds)
        except Exception as e:                       # a mode NIXL refuses, or a hang
            print(f"{design + ' ' + (sync or ''):<14} failed: {e!r}")
            continue
        lat.sort()
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        print(f"{design + ' ' + (sync or ''):<14} {statistics.median(lat):12.0f} {p99:9.0f} "
              f"{gbs:10.2f} {'ok' if ok else 'WRONG'}")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0)

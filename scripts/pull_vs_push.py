"""Raw NIXL: what serving costs the source's own compute, by WRITE (push) or by READ (pull).

Issue 34's vLLM target: a replica that serves a peer's loads at full rate keeps >= 90% of
its own decode throughput. In the vLLM bench it kept 0.54-0.66, and a host profile put 14%
of its core inside ``nixl_agent.transfer``: over UCX's shared-memory path a WRITE is
copied by the process that posts it (CMA), so the source pays for every byte it serves.
A READ posted by the loader is copied by the loader, and the source does nothing per load.
This measures the difference with no xavier-async code, two processes on DRAM:

- A (the source) runs a compute thread (torch matmuls on one thread, the stand-in for its
  decode) and a serve thread (Python, polling its notifications every 50 us, as a poller
  does). In ``push`` it answers each request notification with a WRITE of SIZE bytes into
  B's region, notification attached, polled to DONE; in ``pull`` and ``idle`` it only polls.
- B (the loader) computes the same way on a thread of its own (its own engine) and loads
  from A at a fixed rate, one load at a time: in ``push`` it sends a request and waits for
  the landed notification; in ``pull`` it posts a READ of A's region into its own and
  polls it to DONE; in ``idle`` it loads nothing.

Each round runs the three windows back to back (idle first); the table gives, per SIZE and
mode, the median over rounds of A's and B's matmuls/s over that round's idle window, and
B's loads/s. B's region is zeroed before each window and compared with A's bytes after it.

Usage: python scripts/pull_vs_push.py [rounds [seconds per window]]   (numpy, torch, nixl)"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time

SIZES = (64 * 1024, 2 * 1024 * 1024, 12 * 1024 * 1024)
MODES = ("idle", "push", "pull")
#: loads/s offered per size (the same for push and pull): about 0.07, 0.5 and 0.6 GB/s
RATES = {64 * 1024: 1000.0, 2 * 1024 * 1024: 250.0, 12 * 1024 * 1024: 50.0}
SLOTS = 1
REGION = max(SIZES)
#: how long a poller sleeps between polls when nothing came (A's serve thread, B's push wait)
POLL_S = 50e-6


def _pattern(np):  # type: ignore[no-untyped-def]
    return (np.arange(REGION * SLOTS, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)


def _agent(name: str, np, nbytes: int):  # type: ignore[no-untyped-def]
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = np.zeros(nbytes, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    return agent, buf


def _source(conn) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch
    torch.set_num_threads(1)
    agent, buf = _agent("A", np, REGION * SLOTS)
    buf[:] = _pattern(np)
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    meta, dst = conn.recv()
    agent.add_remote_agent(meta)
    writes = {(k, n): agent.initialize_xfer(
        "WRITE", agent.get_xfer_descs([(buf.ctypes.data + k * REGION, n, 0)], "DRAM"),
        agent.get_xfer_descs([(dst + k * REGION, n, 0)], "DRAM"), "B")
        for k in range(SLOTS) for n in SIZES}
    x = torch.randn(256, 256)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        mode = cmd
        stop = threading.Event()
        served = [0]

        def serve(mode: str, stop: threading.Event, served: list[int]) -> None:
            while not stop.is_set():
                for msgs in agent.get_new_notifs().values():
                    for m in msgs:                       # b"k,n,seq"
                        if mode != "push":
                            continue
                        k, n, seq = (int(v) for v in m.split(b","))
                        h = writes[(k, n)]
                        _wait(agent, h, agent.transfer(h, b"L%d" % seq))
                        served[0] += 1
                time.sleep(POLL_S)

        t = threading.Thread(target=serve, args=(mode, stop, served))
        t.start()
        conn.send("go")
        done, t0 = 0, time.perf_counter()
        while done % 16 or not conn.poll():     # until B's window is over ("end")
            x = torch.tanh(x @ x) * 0.5
            done += 1
        wall = time.perf_counter() - t0
        assert conn.recv() == "end"
        stop.set()
        t.join()
        conn.send((done / wall, served[0]))


def _wait(agent, h, s: str) -> None:  # type: ignore[no-untyped-def]
    while s == "PROC":
        time.sleep(0)
        s = agent.check_xfer_state(h)
    if s != "DONE":
        raise RuntimeError(s)


def _loader(agent, mode: str, n: int, k: int, rate: float, seconds: float,  # type: ignore[no-untyped-def]
            reads: dict) -> int:
    """Rounds of ``k`` loads at ``rate`` loads/s for ``seconds``; the loads done."""
    loads, seq, t0 = 0, 0, time.perf_counter()
    if mode == "idle":
        time.sleep(seconds)
        return 0
    tick = k / rate
    while (now := time.perf_counter()) - t0 < seconds:
        due = t0 + (loads // k) * tick
        if now < due:
            time.sleep(due - now)
        if mode == "pull":
            posted = [(reads[(i, n)], agent.transfer(reads[(i, n)])) for i in range(k)]
            for h, s in posted:
                _wait(agent, h, s)
        else:            # push: k requests out, wait for k landed notifications
            for i in range(k):
                agent.send_notif("A", b"%d,%d,%d" % (i, n, seq))
                seq += 1
            got, give_up = 0, time.perf_counter() + 5
            while got < k:
                for msgs in agent.get_new_notifs().values():
                    got += len(msgs)
                if time.perf_counter() > give_up:
                    raise RuntimeError(f"push: {got} of {k} landed in 5 s")
                time.sleep(POLL_S)
        loads += k
    return loads


def main(rounds: int, seconds: float) -> None:
    import numpy as np
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(there,))
    proc.start()
    agent, buf = _agent("B", np, REGION * SLOTS)
    meta, a_base = here.recv()
    agent.add_remote_agent(meta)
    here.send((agent.get_agent_metadata(), buf.ctypes.data))
    while not agent.check_remote_metadata("A"):
        time.sleep(0.01)
    reads = {(i, n): agent.initialize_xfer(
        "READ", agent.get_xfer_descs([(buf.ctypes.data + i * REGION, n, 0)], "DRAM"),
        agent.get_xfer_descs([(a_base + i * REGION, n, 0)], "DRAM"), "A")
        for i in range(SLOTS) for n in SIZES}
    want = _pattern(np)
    import torch
    torch.set_num_threads(1)
    y = torch.randn(256, 256)
    b_busy = threading.Event()
    b_done = [0]

    def b_compute() -> None:       # B's own engine
        nonlocal y
        while b_busy.is_set():
            y = torch.tanh(y @ y) * 0.5
            b_done[0] += 1

    def window(mode: str, n: int) -> tuple[float, float, int, bool | None]:
        """One window: A's and B's matmuls/s, the loads done, whether the bytes are right."""
        buf[:] = 0
        here.send(mode)
        assert here.recv() == "go"
        b_busy.set()
        b_done[0] = 0
        bt = threading.Thread(target=b_compute)
        bt.start()
        t0 = time.perf_counter()
        loads = _loader(agent, mode, n, 1, RATES[n], seconds, reads)
        here.send("end")
        b_rate = b_done[0] / (time.perf_counter() - t0)
        b_busy.clear()
        bt.join()
        rate, served = here.recv()
        if mode == "push" and served != loads:
            raise RuntimeError(f"A served {served} of {loads} requests")
        ok = None if mode == "idle" else bool(np.array_equal(buf[:n], want[:n]))
        return rate, b_rate, loads, ok

    print(f"raw NIXL, DRAM: A and B each compute (torch, one thread); B loads from A at a "
          f"fixed rate; {rounds} rounds of {seconds:g} s windows, modes interleaved; "
          f"medians, A's and B's rates over the same round's idle window")
    print(f"{'size':>7} {'loads/s':>7} {'mode':>5} {'A / idle':>8} {'B / idle':>8} "
          f"{'B loads/s':>9} bytes")
    wrong = 0
    for n in SIZES:
        ratios: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES[1:]}
        done: dict[str, int] = dict.fromkeys(MODES[1:], 0)
        for _ in range(rounds):
            a0, b0, _, _ = window("idle", n)
            for mode in MODES[1:]:
                a, b, loads, ok = window(mode, n)
                ratios[mode].append((a / a0, b / b0))
                done[mode] += loads
                wrong += not ok
        for mode, rs in ratios.items():
            print(f"{n // 1024:>5}Ki {RATES[n]:>7.0f} {mode:>5} "
                  f"{statistics.median(r[0] for r in rs):>8.2f} "
                  f"{statistics.median(r[1] for r in rs):>8.2f} "
                  f"{done[mode] / (rounds * seconds):>9.0f} {'WRONG' if wrong else 'right'}",
                  flush=True)
    here.send("stop")
    proc.join()
    if wrong:
        raise SystemExit(f"{wrong} window(s) with wrong bytes")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)

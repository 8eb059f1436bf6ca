"""Raw NIXL with K WRITEs in flight to one peer (issue 34: why 16 loads in flight through
4 slabs moved fewer loads/s than through 1 on the 16-core host).

Two processes, DRAM, no xavier-async code: A posts rounds of K WRITEs of SIZE bytes (one
handle per region, made once, like the slabs), each with a notification, without one,
or with one sent on its own once the WRITE is DONE ("after"), then busy-polls them all
to DONE; B drains its notifications in a busy loop and checks
the bytes at the end. For each (K, SIZE, notify): copies/s, the share of posts that came
back PROC (not done inside ``transfer``), and post-to-DONE p50/p99. Compare K=1 with K=4
on the same machine; no library code is involved, so a gap here is UCX's or NIXL's.

Usage: python scripts/nixl_inflight.py [rounds]   (needs numpy and nixl)"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

KS = (1, 2, 4, 8)
SIZES = (64 * 1024, 1024 * 1024)
REGION = max(SIZES)
#: no notification, one with the WRITE, one sent on its own once the WRITE is DONE
MODES: tuple[bool | str, ...] = (False, True, "after")


def _target(conn: object) -> None:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
    b = nixl_agent("B", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = np.zeros(REGION * max(KS), dtype=np.uint8)
    b.register_memory(b.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    conn.send((b.get_agent_metadata(), buf.ctypes.data))   # type: ignore[attr-defined]
    got = 0
    while not conn.poll():                                  # type: ignore[attr-defined]
        for msgs in b.get_new_notifs().values():
            got += len(msgs)
    conn.recv()                                             # type: ignore[attr-defined]
    for msgs in b.get_new_notifs().values():
        got += len(msgs)
    ok = all(bool((buf[k * REGION:k * REGION + 4096] == k + 1).all()) for k in range(max(KS)))
    conn.send((got, ok))                                    # type: ignore[attr-defined]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1e6


def main(rounds: int) -> None:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there,))
    proc.start()
    a = nixl_agent("A", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    src = np.zeros(REGION * max(KS), dtype=np.uint8)
    for k in range(max(KS)):
        src[k * REGION:(k + 1) * REGION] = k + 1
    a.register_memory(a.get_reg_descs([(src.ctypes.data, src.nbytes, 0, "")], "DRAM"))
    meta, dst = here.recv()
    a.add_remote_agent(meta)
    # one handle per mode too: NIXL re-sends a handle's last notification when it is
    # re-posted with an empty one
    handles = {(k, n, mode): a.initialize_xfer(
        "WRITE", a.get_xfer_descs([(src.ctypes.data + k * REGION, n, 0)], "DRAM"),
        a.get_xfer_descs([(dst + k * REGION, n, 0)], "DRAM"), "B")
        for k in range(max(KS)) for n in SIZES for mode in MODES}
    sent = 0
    print(f"raw NIXL, A -> B, DRAM, {rounds} rounds of K WRITEs in flight")
    print(f"{'K':>2} {'size':>8} {'notify':>6} {'copies/s':>9} {'PROC at post':>12} "
          f"{'post->DONE p50 us':>17} {'p99 us':>8}")
    for n in SIZES:
        for notify in MODES:
            for k in KS:
                lat: list[float] = []
                proc_posts = 0
                t0 = time.perf_counter()
                for r in range(rounds):
                    posted = []
                    for i in range(k):
                        h = handles[(i, n, notify)]
                        t = time.perf_counter()
                        s = a.transfer(h, b"n%d" % r if notify is True else b"")
                        sent += bool(notify)
                        if s == "PROC":
                            proc_posts += 1
                        elif s != "DONE":
                            raise RuntimeError(s)
                        posted.append((h, t, s))
                    for h, t, s in posted:
                        while s == "PROC":
                            s = a.check_xfer_state(h)
                        if s != "DONE":
                            raise RuntimeError(s)
                        if notify == "after":   # the notification on its own, once DONE
                            a.send_notif("B", b"n%d" % r)
                        lat.append(time.perf_counter() - t)
                wall = time.perf_counter() - t0
                print(f"{k:>2} {n // 1024:>6}Ki {notify!s:>6} {rounds * k / wall:>9.0f} "
                      f"{proc_posts / (rounds * k):>12.2f} {_pct(lat, 0.5):>17.1f} "
                      f"{_pct(lat, 0.99):>8.1f}")
    here.send("done")
    got, ok = here.recv()
    print(f"B: {got} notifications of {sent} sent; bytes {'right' if ok else 'WRONG'}")
    proc.join()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)

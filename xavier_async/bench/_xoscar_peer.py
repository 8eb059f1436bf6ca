"""Child processes for ``xavier-async bench --compare xoscar`` (see :mod:`.xoscar_anchor`).

Run as ``python -m xavier_async.bench._xoscar_peer ROLE FD SPEC_JSON``. Each process hosts one
xoscar actor pool on ``nixl://127.0.0.1`` (n_process=0: the pool lives in this process):

* ``receiver``: an actor owning the persistent destination buffer (a full tensor and a
  small prefix view of the same allocation, each handed out once as a ``buffer_ref``);
* ``sender``: an actor owning the persistent source buffer (same two views) that runs the
  seed's four cases with ``xoscar.copy_to`` and returns the per-copy times and counts.

This module imports xoscar at the top; only the child processes import it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import xoscar as xo
from nixl._api import nixl_agent
from xoscar.backends.communication.nixl import NixlChannel

from ..testing.child import send_error

RECEIVER_UID = "xavier-bench-xoscar-receiver"
SENDER_UID = "xavier-bench-xoscar-sender"

# -- counters: wrap xoscar's NIXL registration path in this process -----------------------
COUNTS = {"register_calls": 0, "registrations": 0, "remote_agent_loads": 0, "nixl_writes": 0}


def install_counters() -> None:
    if getattr(NixlChannel, "_xavier_counted", False):
        return
    register, write, add_remote = NixlChannel._register, NixlChannel._write, nixl_agent.add_remote_agent

    def _register(self: Any, buffers: Any, descriptions: Any = None) -> Any:
        before = self._generation
        COUNTS["register_calls"] += 1
        try:
            return register(self, buffers, descriptions)
        finally:
            if self._generation != before:
                COUNTS["registrations"] += 1

    async def _write(self: Any, *args: Any, **kwargs: Any) -> Any:
        COUNTS["nixl_writes"] += 1
        return await write(self, *args, **kwargs)

    def add_remote_agent(self: Any, *args: Any, **kwargs: Any) -> Any:
        COUNTS["remote_agent_loads"] += 1
        return add_remote(self, *args, **kwargs)

    NixlChannel._register = _register  # type: ignore[method-assign]
    NixlChannel._write = _write  # type: ignore[method-assign]
    nixl_agent.add_remote_agent = add_remote_agent  # type: ignore[method-assign]
    NixlChannel._xavier_counted = True  # type: ignore[attr-defined]


def _digest(t: torch.Tensor) -> str:
    from ..testing.peer_process import digest
    return digest(t)


def _buffers(spec: dict[str, Any], fill_seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One persistent allocation: the full buffer and a small prefix view of it."""
    dev = torch.device(spec["device"])
    if fill_seed is None:
        full = torch.zeros(spec["full_bytes"], dtype=torch.uint8, device=dev)
    else:
        g = torch.Generator().manual_seed(fill_seed)
        full = torch.randint(0, 256, (spec["full_bytes"],), generator=g, dtype=torch.uint8).to(dev)
    return full, full[: spec["small_bytes"]]


class ReceiverActor(xo.Actor):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.full, self.small = _buffers(spec, None)
        self._refs: tuple[Any, Any] | None = None

    def refs(self) -> tuple[Any, Any]:
        # created once: each view keeps one identity (and one buffer ref) for the whole run
        if self._refs is None:
            self._refs = (xo.buffer_ref(self.address, self.full), xo.buffer_ref(self.address, self.small))
        return self._refs

    def clear(self) -> None:
        self.full.zero_()
        if self.full.is_cuda:
            torch.cuda.synchronize(self.full.device)

    def digest(self, nbytes: int) -> str:
        return _digest(self.full[:nbytes])

    def counts(self) -> dict[str, int]:
        return dict(COUNTS)


class SenderActor(xo.Actor):
    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec = spec
        self.full, self.small = _buffers(spec, spec["seed"] + 77)

    async def run(self, receiver_address: str) -> dict[str, Any]:
        from ..policy import ChannelPolicy

        s = self.spec
        F, S, n, warmup = s["full_bytes"], s["small_bytes"], s["copies"], s["warmup"]
        recv = await xo.actor_ref(receiver_address, RECEIVER_UID)
        full_ref, small_ref = await recv.refs()
        # payload size -> (local view, remote ref); both stable objects for the whole run
        views = {F: ([self.full], [full_ref]), S: ([self.small], [small_ref])}
        t0 = time.perf_counter()

        def size_only(nbytes: int) -> int:
            return S if nbytes <= S else F

        cases = {
            "always_full": ([F] * n, None),
            "alternating_size_only": ([F, S] * max(1, n // 2), "size_only"),
            "alternating_streak": ([F, S] * max(1, n // 2), "streak"),
            "sustained_small": ([S] * n, "streak"),
        }
        out: dict[str, Any] = {}
        copy_to, perf = xo.copy_to, time.perf_counter
        for name, (sizes, how) in cases.items():
            if how == "streak":
                select = ChannelPolicy(F, S, streak=2).select
            elif how == "size_only":
                select = size_only
            else:
                def select(nbytes: int) -> int:
                    return F
            for nbytes in sizes[:warmup]:  # warm-up: both views registered, machine steady
                local, remote = views[select(nbytes)]
                await copy_to(local, remote)
            await recv.clear()            # verification cannot pass on stale bytes
            c0, p0 = dict(COUNTS), await recv.counts()
            times, wire, small_copies = [], 0, 0
            view = F
            for nbytes in sizes:
                t = perf()
                view = select(nbytes)
                local, remote = views[view]
                await copy_to(local, remote)
                times.append(perf() - t)
                wire += view
                small_copies += view == S
            c1, p1 = dict(COUNTS), await recv.counts()
            verified = await recv.digest(view) == _digest(self.full[:view])
            out[name] = {
                "times": times, "sizes": sizes, "selection": how or "always_full",
                "registrations_after_warmup": c1["registrations"] - c0["registrations"],
                "peer_registrations_after_warmup": p1["registrations"] - p0["registrations"],
                "metadata_exchanges_after_warmup": c1["remote_agent_loads"] - c0["remote_agent_loads"],
                "nixl_writes": c1["nixl_writes"] - c0["nixl_writes"],
                "wire_bytes": wire, "useful_bytes": sum(sizes),
                "copies_small": small_copies,
                "bytes_verified": verified, "verified_bytes": view,
            }
        return {"cases": out, "counts": dict(COUNTS), "peer_counts": await recv.counts(),
                "elapsed_s": time.perf_counter() - t0}


async def _pool(spec: dict[str, Any]) -> Any:
    return await xo.create_actor_pool(f"nixl://{spec['host']}:0", n_process=0)


async def _receiver(conn: Connection, spec: dict[str, Any]) -> None:
    pool = await _pool(spec)
    async with pool:
        await xo.create_actor(ReceiverActor, spec, uid=RECEIVER_UID, address=pool.external_address)
        conn.send(("ok", pool.external_address))
        await asyncio.to_thread(conn.recv)  # "close"
    conn.send(("ok", "closed"))


async def _sender(conn: Connection, spec: dict[str, Any]) -> None:
    pool = await _pool(spec)
    async with pool:
        ref = await xo.create_actor(SenderActor, spec, uid=SENDER_UID, address=pool.external_address)
        conn.send(("ok", pool.external_address))
        receiver_address = await asyncio.to_thread(conn.recv)
        res = await ref.run(receiver_address)
        res["event_loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]
    conn.send(("ok", res))


def main(argv: list[str]) -> None:
    fd, role, spec = int(argv[0]), argv[1], json.loads(argv[2])
    conn = Connection(fd)
    try:
        if spec.get("cpus"):
            os.sched_setaffinity(0, spec["cpus"])
        if spec["device"].startswith("cuda"):
            torch.cuda.set_device(torch.device(spec["device"]))
        else:
            torch.set_num_threads(1)
        install_counters()
        coro = (_receiver if role == "receiver" else _sender)(conn, spec)
        try:
            import uvloop  # xoscar's own pools run on uvloop when it is installed
        except ImportError:
            asyncio.run(coro)
        else:
            uvloop.run(coro)
    except BaseException as exc:
        send_error(conn, exc)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])

"""The anchor, measured on your machine: the seed's four channel cases through
``xoscar.copy_to`` over NIXL (``xavier-async bench --compare xoscar``).

What runs: two OS processes, each hosting one xoscar actor pool on ``nixl://127.0.0.1``
(the ``nixl`` scheme makes ``copy_to`` between buffers use xoscar's ``NixlChannel``: the
actor-RPC socket carries a ``prepare`` and a ``finish`` control message per copy, the
bytes move as one NIXL WRITE on a transfer handle created for that copy). The sender
actor owns the source buffer, the receiver actor the destination buffer; each is one
persistent allocation (``full_bytes``) plus a persistent prefix view of it
(``small_bytes``), the seed's "padded views", each with a stable identity (and one
``buffer_ref`` per destination view). Memory is DRAM, or CUDA (cuda:0 -> cuda:1; both on
cuda:0 with one GPU: :func:`~xavier_async.testing.devices.peer_device`) when the bench
runs on CUDA. The cases:

* ``always_full``: full payloads through the full view;
* ``alternating_size_only``: full, small, full, ... with the small view whenever the
  payload fits (xoscar keeps one registration per channel, keyed by buffer identity, so
  every switch re-registers on both ends and re-exchanges agent metadata);
* ``alternating_streak``: the same sizes, view picked by
  ``ChannelPolicy(full, small, streak=2)`` (stays on the full view);
* ``sustained_small``: small payloads; the streak machine settles on the small view.

Registrations are counted by wrapping xoscar's registration path in both processes (see
:data:`COUNTED_BY`); the parent process never imports xoscar. Contents are verified once per case: the
destination is zeroed before the measured copies, and after them the digest of the
destination's last-copied view must equal the source's.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from collections.abc import Mapping
from typing import Any

from ..testing.child import ChildProcess

CASES = ("always_full", "alternating_size_only", "alternating_streak", "sustained_small")

#: how the registration counts are obtained (also written into the results)
COUNTED_BY = (
    "xoscar.backends.communication.nixl.NixlChannel._register wrapped in both processes: a "
    "call that bumps the channel's registration generation (deregister + register_memory of "
    "the new buffers) counts as one registration; metadata exchanges = calls to "
    "nixl_agent.add_remote_agent on the sender; NIXL writes = calls to NixlChannel._write")


def available() -> bool:
    """True when xoscar (with its NIXL channel) and nixl are importable."""
    try:
        return (importlib.util.find_spec("xoscar") is not None
                and importlib.util.find_spec("nixl") is not None
                and importlib.util.find_spec("xoscar.backends.communication.nixl") is not None)
    except (ImportError, ValueError):
        return False


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("xoscar", "nixl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "?"
    return out


def _child(role: str, spec: dict[str, Any]) -> ChildProcess:
    """One ``python -m xavier_async.bench._xoscar_peer`` process and its pipe."""
    return ChildProcess("xavier_async.bench._xoscar_peer", [role, json.dumps(spec)], f"xoscar {role} process")


def _stats(samples: list[float]) -> dict[str, float]:
    from .common import stats
    return stats(samples)


def run_cases_sync(options: Any, floors: Mapping[str, Mapping[str, float]],
                   device: str = "cpu", cpus: list[int] | None = None,
                   timeout: float = 600.0) -> dict[str, Any]:
    """Run the four cases through xoscar's ``copy_to`` in two fresh processes (blocking).

    ``options``: a :class:`~xavier_async.bench.BenchOptions` (``full_bytes``,
    ``small_bytes``, ``copies``, ``warmup``, ``seed``); ``floors``: the bench's
    ``res["floor"]`` (``full``/``small`` medians) the ratios are taken against.
    ``cpus``: two CPUs to pin sender and receiver to (or None)."""
    if not available():
        raise RuntimeError("xoscar is not installed: pip install 'xavier-async[xoscar]'")
    F, S = options.full_bytes, options.small_bytes
    base = {"full_bytes": F, "small_bytes": S, "copies": options.copies, "warmup": options.warmup,
            "seed": options.seed, "host": "127.0.0.1"}
    from ..testing.devices import peer_device
    cuda = device == "cuda"
    (send_dev, _), (recv_dev, shared) = peer_device(0, device), peer_device(1, device)
    recv = _child("receiver", {**base, "device": recv_dev,
                               "cpus": [cpus[1]] if cpus else None})
    send: ChildProcess | None = None
    try:
        address = recv.reply(120)
        send = _child("sender", {**base, "device": send_dev,
                                 "cpus": [cpus[0]] if cpus else None})
        send.reply(120)
        send.send(address)
        raw = send.reply(timeout)
    finally:
        if send is not None:
            send.close()
        try:
            recv.conn.send("close")
        except OSError:
            pass
        recv.close()

    floor_of = {F: floors["full"]["median_us"], S: floors["small"]["median_us"]}
    cases: dict[str, Any] = {}
    for name in CASES:
        c = raw["cases"][name]
        sizes, times = c.pop("sizes"), c.pop("times")
        st = _stats(times)
        floor_mean = statistics.fmean(floor_of[n] for n in sizes)
        cases[name] = {**st, "copies": len(sizes), **c, "floor_mean_us": floor_mean,
                       "ratio_mean_to_floor": st["mean_us"] / floor_mean}
        if len(set(sizes)) == 1:
            cases[name]["ratio_median_to_floor"] = st["median_us"] / floor_of[sizes[0]]
    total_copies = sum(cases[c]["copies"] for c in CASES)
    all_nixl = all(cases[c]["nixl_writes"] == cases[c]["copies"] for c in CASES)
    ver = versions()
    mem = (f"VRAM, {send_dev} -> {recv_dev}{' (one GPU, time-sliced)' if shared else ''}" if cuda
           else "DRAM")
    label = (f"xoscar {ver['xoscar']} copy_to over NIXL {ver['nixl']} (UCX WRITE, {mem}; control "
             f"messages on xoscar's actor socket)" if all_nixl else
             f"xoscar {ver['xoscar']} copy_to (NOT all copies went through NIXL: "
             f"{sum(cases[c]['nixl_writes'] for c in CASES)} NIXL writes for {total_copies} copies)")
    return {
        "transport": label,
        "all_copies_over_nixl": all_nixl,
        "versions": ver,
        "device": device,
        "memory": mem,
        "processes": 2,
        "event_loop": raw.get("event_loop"),
        "pinned_cpus": cpus,
        "registrations_counted_by": COUNTED_BY,
        "cases": cases,
        "alternating_streak_vs_always_full": (cases["alternating_streak"]["mean_us"]
                                              / cases["always_full"]["mean_us"]),
        "totals": {"sender": raw["counts"], "receiver": raw["peer_counts"]},
        "elapsed_s": raw["elapsed_s"],
    }


async def run_cases(options: Any, floors: Mapping[str, Mapping[str, float]], device: str = "cpu",
                    cpus: list[int] | None = None, timeout: float = 600.0) -> dict[str, Any]:
    """:func:`run_cases_sync` in a worker thread (the processes do the work)."""
    import anyio
    return await anyio.to_thread.run_sync(
        lambda: run_cases_sync(options, floors, device=device, cpus=cpus, timeout=timeout))


def compare_with(seed_cases: Mapping[str, Any], xo: Mapping[str, Any]) -> dict[str, Any]:
    """Per case: xoscar's median / mean over ours (how many times faster we are)."""
    out = {}
    for c in CASES:
        a, b = seed_cases[c], xo["cases"][c]
        out[c] = {"median": b["median_us"] / a["median_us"], "mean": b["mean_us"] / a["mean_us"]}
    return out


__all__ = ["CASES", "COUNTED_BY", "available", "compare_with", "run_cases", "run_cases_sync", "versions"]


"""The receive-slab invariants of an idle :class:`~xavier_async.Endpoint`, in one place.

:func:`check_slab_invariants` is what the chaos test (:mod:`xavier_async.testing.chaos`)
checks after every step: the engine's own :meth:`~xavier_async.Endpoint.check_invariants`
plus the buffers behind each slab index; it is the only code in the test support that
reads the engine's private slab state, so that a restructured engine re-points this one
function.

Checked, once every load has settled:

* nothing is lent or waited for: ``in_use == waiting == sends_in_use == 0``;
* every registered receive slab is in exactly one place: in the pool (free or lent), a
  spare, or fenced (``usable + fenced_now + spares == registered``, and no index in two);
* registrations equal the pool: the transport counted one memory registration per send
  slab and per registered receive slab, no more (a registration whose slab never joined
  the pool is a slab a peer may be told about while the loader unpacks another);
* the unpack table and the transport name the same slab as the pool, index by index.

:func:`task_crashes` reads the other private count a fault test must see: how many of an
endpoint's background tasks crashed (a broken invariant in the library, logged and
turned into :class:`~xavier_async.InternalError` on the loads concerned, which
the endpoint survives). A healthy endpoint has none, under any fault.
"""

from __future__ import annotations

from typing import Any

import anyio

__all__ = ["check_slab_invariants", "task_crashes", "wait_settled"]


def check_slab_invariants(ep: Any, *, idle: bool = True) -> list[str]:
    """What is wrong with ``ep``'s slabs (an empty list: nothing). ``idle``: no load or
    copy is in flight, so nothing may be lent or waited for. Reads the engine's private
    state; an engine whose internals moved fails here with a message saying so."""
    problems: list[str] = []
    stats: dict[str, int] = dict(ep.recv_slab_stats)
    if not stats:
        return ["no receive slabs (the endpoint was never opened)"]
    if idle:
        for key in ("in_use", "waiting", "sends_in_use"):
            if stats.get(key, 0) != 0:
                problems.append(f"{key} = {stats.get(key)} with nothing in flight (a slab leaked "
                                "or a waiter was left behind)")
    if stats["usable"] + stats["fenced_now"] + stats["spares"] != stats["registered"]:
        problems.append(f"usable {stats['usable']} + fenced_now {stats['fenced_now']} + spares "
                        f"{stats['spares']} != registered {stats['registered']}")
    regs = ep.transport.memory_registrations
    tiers = stats.get("snapshot_tiers", 0)
    if regs != stats["send_slabs"] + stats["registered"] + tiers:
        problems.append(f"the transport counted {regs} memory registrations, the endpoint has "
                        f"{stats['send_slabs']} send + {stats['registered']} receive slabs + "
                        f"{tiers} snapshot tiers")

    # -- the engine's own checks: one place each, unpack tables, pool accounting --------
    from ..errors import InternalError
    try:
        ep.check_invariants(idle=idle)
    except InternalError as exc:
        problems.append(str(exc))
    # -- the buffers: unpack table and transport name the pooled slab, index by index ---
    receiver = getattr(ep, "_receiver", None)
    if receiver is None or not getattr(receiver, "started", False):
        problems.append("check_slab_invariants cannot read the endpoint's receive slabs "
                        "(Endpoint._receiver.slabs): re-point it at the new internals")
        return problems
    recv = receiver.slabs
    slabs: dict[int, Any] = dict(recv.slabs)
    for index, slab in slabs.items():
        row = recv.rows.get(index)
        if row is not None and row.buf.data_ptr() != slab.tensor.data_ptr():
            problems.append(f"receive slab {index}: the loader unpacks from another buffer than "
                            "the slab in the pool")
    transport = ep.transport
    theirs = getattr(transport, "_recv_slabs", None)   # NIXL
    if theirs is None:
        theirs = getattr(transport, "recv_slabs", None)  # in-process
    inner = getattr(transport, "inner", None)           # a FaultyTransport's wrapped one
    if theirs is None and inner is not None:
        theirs = getattr(inner, "_recv_slabs", None) or getattr(inner, "recv_slabs", None)
    if isinstance(theirs, dict):
        if set(theirs) != set(slabs):
            problems.append(f"the transport has receive slabs {sorted(theirs)}, the pool "
                            f"{sorted(slabs)}")
        for index, slab in slabs.items():
            mine = theirs.get(index)
            if mine is not None and mine.tensor.data_ptr() != slab.tensor.data_ptr():
                problems.append(f"receive slab {index}: the transport registered (and tells peers "
                                "about) another buffer than the slab in the pool")
    return problems


def task_crashes(ep: Any) -> int:
    """How many of ``ep``'s background tasks crashed so far (``Tasks.crashes``: each one a
    bug, logged as "background task ... failed"); 0 for an endpoint that never started.
    The count outlives ``aclose()``, so a crash during close is counted too. Reads the
    engine's private state."""
    rt = getattr(ep, "_rt", None)
    if rt is None or not hasattr(rt, "tasks"):
        raise AttributeError("task_crashes cannot read the endpoint's task guard "
                             "(Endpoint._rt.tasks.crashes): re-point it at the new internals")
    return 0 if rt.tasks is None else int(rt.tasks.crashes)


async def wait_settled(ep: Any, timeout: float = 2.0, interval: float = 0.02) -> bool:
    """Wait until ``ep``'s slab stats and registration count stop changing (a replacement
    registration still under way finishes) and no registration is under way; ``False``
    if they still moved after ``timeout`` seconds."""
    def snapshot() -> tuple[Any, ...]:
        receiver = getattr(ep, "_receiver", None)
        recv = receiver.slabs if receiver is not None and receiver.started else None
        return (tuple(sorted(ep.recv_slab_stats.items())), ep.transport.memory_registrations,
                getattr(recv, "registering", 0))

    with anyio.move_on_after(timeout):
        last = snapshot()
        quiet = 0
        while True:
            await anyio.sleep(interval)
            now = snapshot()
            quiet = quiet + 1 if now == last and now[2] == 0 else 0
            if quiet >= 3:
                return True
            last = now
    return False

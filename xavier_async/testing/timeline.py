"""Where one load's time goes, on both sides at once: a timeline of marks.

:class:`Timeline` wraps the functions on a load's path (the receiver's load, the source's
message handler, parsing, the lookup, packing, unpacking) and the NIXL agent's calls, and
records a mark ``(nanoseconds, tag)`` at each entry (``tag>``) and exit (``tag<``).
``perf_counter_ns`` reads ``CLOCK_MONOTONIC`` on Linux, one clock for every process of a
host, so the receiver's marks and its source's interleave into one timeline per load
(:func:`load_timelines`). :func:`host_time` then splits each side's busy time into
NIXL's calls, the byte copies (on the CPU the memmoves, on CUDA the waits for the
device's copy kernels: ``torch.cuda.Event`` ``synchronize``/``query``), and the rest: the
Python host time a load costs that side, which issue 24 asks to bring to 15 us or less.

A mark costs about a microsecond: compare the stages with each other, not with an
uninstrumented run. ``xavier-async bench --load-timeline`` installs one in both processes
(a :class:`~xavier_async.testing.PeerProcess` installs one when :data:`ENV` is set in its
environment) and prints the breakdown of one-hash loads.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable, Sequence
from statistics import median
from time import perf_counter_ns
from typing import Any

#: set in a peer process's environment to record a timeline there (the bench does)
ENV = "XAVIER_ASYNC_TIMELINE"

#: (module, attribute path, tag) of the functions marked at entry and exit
FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("xavier_async.endpoint", "Endpoint._on_message", "handle"),
    ("xavier_async.endpoint", "decode", "decode"),
    ("xavier_async.source", "parse_load", "parse"),
    ("xavier_async.source", "decide", "lookup"),
    ("xavier_async.source", "Source._post", "serve"),
    ("xavier_async.channel", "PeerChannel.commit", "commit"),
    ("xavier_async.snapshots", "SnapshotStore.serve", "store.serve"),
    ("xavier_async.snapshots", "SnapshotStore.run", "copy"),
    ("xavier_async.source", "pack", "copy"),
    ("xavier_async.receiver", "unpack", "unpack"),
    ("xavier_async.packing", "run_host", "copy"),
    ("xavier_async.packing", "DeviceRuns.run", "launch"),
    ("xavier_async.planning", "Planner.plan", "plan"),
)
#: coroutine methods marked at entry and exit
COROUTINES: tuple[tuple[str, str, str], ...] = (
    ("xavier_async.receiver", "Receiver.load", "load"),
    ("xavier_async.receiver", "Receiver.load_blocks", "load"),
    ("xavier_async.receiver", "Receiver.round_trip", "round_trip"),
    # the unpack and, on CUDA, the wait for its kernel (polled through the event loop)
    ("xavier_async.receiver", "Receiver._unpack", "unpack.all"),
)
#: the NIXL agent's methods marked (on each agent made while installed)
AGENT_METHODS = ("transfer", "send_notif", "get_new_notifs", "check_xfer_state")
#: CUDA event methods marked (waits for the device: not host time)
EVENT_METHODS = ("synchronize", "query")

Mark = tuple[int, str]


class Timeline:
    """The marks of one process while installed (see the module)."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []
        self._undo: list[Callable[[], None]] = []

    def _patch(self, owner: Any, attr: str, value: Any) -> None:
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, value)
        self._undo.append(lambda: setattr(owner, attr, old))

    def _wrap(self, tag: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        marks, now = self.marks, perf_counter_ns
        enter, leave = tag + ">", tag + "<"

        def marked(*args: Any, **kwargs: Any) -> Any:
            marks.append((now(), enter))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((now(), leave))
        return marked

    def _wrap_coroutine(self, tag: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        marks, now = self.marks, perf_counter_ns
        enter, leave = tag + ">", tag + "<"

        async def marked(*args: Any, **kwargs: Any) -> Any:
            marks.append((now(), enter))
            try:
                return await fn(*args, **kwargs)
            finally:
                marks.append((now(), leave))
        return marked

    def _wrap_poll(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """``get_new_notifs``: marked only when it returns something (it spins)."""
        marks, now = self.marks, perf_counter_ns

        def marked() -> Any:
            t = now()
            got = fn()
            if got:
                marks.append((t, "agent.get_new_notifs>"))
                marks.append((now(), "agent.get_new_notifs<"))
            return got
        return marked

    def install(self) -> Timeline:
        """Start marking (idempotent)."""
        if self._undo:
            return self
        for table, wrap in ((FUNCTIONS, self._wrap), (COROUTINES, self._wrap_coroutine)):
            for module, path, tag in table:
                owner: Any = importlib.import_module(module)
                *outer, attr = path.split(".")
                for part in outer:
                    owner = getattr(owner, part)
                self._patch(owner, attr, wrap(tag, getattr(owner, attr)))
        try:
            nixl = importlib.import_module("xavier_async.transports.nixl")
        except ImportError:  # (no NIXL: nothing of it to mark)
            return self
        factory = nixl.nixl_agent_factory

        def agent_factory(*args: Any, **kwargs: Any) -> Any:
            agent = factory(*args, **kwargs)
            for m in AGENT_METHODS:
                fn = getattr(agent, m)
                setattr(agent, m, self._wrap_poll(fn) if m == "get_new_notifs"
                        else self._wrap("agent." + m, fn))
            return agent

        self._patch(nixl, "nixl_agent_factory", agent_factory)
        try:
            import torch
            event = torch.cuda.Event
        except (ImportError, AttributeError):  # pragma: no cover - torch without CUDA stubs
            return self
        for m in EVENT_METHODS:
            self._patch(event, m, self._wrap("device.wait", getattr(event, m)))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def mark_cost_ns(self, n: int = 20000) -> float:
        """What one wrapped call costs beyond the call itself (two marks), measured here:
        :func:`host_time` takes it off each side's Python time, once per pair of marks."""
        def nothing() -> None:
            return None

        marked = Timeline()._wrap("calibrate", nothing)
        best = float("inf")
        for _ in range(3):
            t0 = perf_counter_ns()
            for _ in range(n):
                nothing()
            t1 = perf_counter_ns()
            for _ in range(n):
                marked()
            t2 = perf_counter_ns()
            best = min(best, ((t2 - t1) - (t1 - t0)) / n)
        return max(best, 0.0)

    def take(self) -> list[Mark]:
        """The marks so far (and forget them)."""
        out, self.marks[:] = list(self.marks), []
        return out


def load_timelines(receiver: Sequence[Mark], source: Sequence[Mark]) -> list[list[tuple[int, str]]]:
    """One timeline per load, for loads made one at a time: the receiver's marks from
    ``load>`` to ``load<`` (tags prefixed ``R.``) and the source's in between (``S.``),
    as ``(ns from the load's start, tag)``."""
    merged = sorted([(t, "R." + g) for t, g in receiver] + [(t, "S." + g) for t, g in source])
    out: list[list[tuple[int, str]]] = []
    cur: list[Mark] | None = None
    depth = 0
    for t, g in merged:
        if g == "R.load>":
            depth += 1
            if depth == 1:
                cur = []
        if cur is not None:
            cur.append((t, g))
        if g == "R.load<":
            depth -= 1
            if depth == 0 and cur is not None:
                t0 = cur[0][0]
                out.append([(t - t0, tag) for t, tag in cur])
                cur = None
    return out


def _spans(marks: Sequence[tuple[int, str]], side: str) -> dict[str, int]:
    """Outermost time per tag on one side (nested calls of one tag count once)."""
    open_at: dict[str, list[int]] = {}
    out: Counter[str] = Counter()
    for t, g in marks:
        if not g.startswith(side):
            continue
        tag, edge = g[len(side):-1], g[-1]
        stack = open_at.setdefault(tag, [])
        if edge == ">":
            stack.append(t)
        elif stack:
            start = stack.pop()
            if not stack:
                out[tag] += t - start
    return dict(out)


def _device_waits(marks: Sequence[tuple[int, str]], side: str) -> int:
    """Time one side waited for the device: its ``device.wait`` spans, and (the receiver)
    what its unpack took beyond the ``unpack`` call itself (launching the kernel): the
    polls of the unpack's event, the event loop's passes between them included."""
    total = 0
    inside = 0  # depth inside unpack.all
    unpack_all = unpack_call = 0
    polled = False  # the unpack waited for an event (CUDA): its loop's passes are waiting
    opened: dict[str, int] = {}
    for t, g in marks:
        if not g.startswith(side):
            continue
        tag, edge = g[len(side):-1], g[-1]
        if edge == ">":
            if tag == "unpack.all":
                inside += 1
            opened.setdefault(tag, t)
            continue
        start = opened.pop(tag, None)
        if start is None:
            continue
        if tag == "unpack.all":
            inside -= 1
            unpack_all += t - start
        elif tag == "unpack" and inside:
            unpack_call += t - start
        elif tag == "device.wait":
            if inside:
                polled = True
            else:
                total += t - start
    return total + (max(0, unpack_all - unpack_call) if polled else 0)


def host_time(timelines: Sequence[Sequence[tuple[int, str]]], mark_ns: float = 0.0,
              ) -> dict[str, Any]:
    """Per side, medians over the loads in microseconds: ``busy`` (the receiver: its load
    call less the wait for the reply; the source: handling the request), NIXL's calls,
    the copies, and ``python`` (busy less those two, less ``mark_ns`` per pair of that
    side's marks: what marking cost, :meth:`Timeline.mark_cost_ns`); plus each tag's
    median and the load's end to end time."""
    rows: dict[str, list[float]] = {}

    def add(name: str, ns: float) -> None:
        rows.setdefault(name, []).append(ns / 1e3)

    for tl in timelines:
        total = tl[-1][0]
        add("load", total)
        r, s = _spans(tl, "R."), _spans(tl, "S.")
        # the receiver waits from its request's send to the reply's arrival (its handler)
        sent = next((t for t, g in tl if g == "R.agent.send_notif<"), None)
        replied = next((t for t, g in tl if g == "R.agent.get_new_notifs>"), None)
        wait = (replied - sent) if sent is not None and replied is not None else 0
        r_busy = total - wait
        s_busy = s.get("handle", 0) + s.get("agent.get_new_notifs", 0)
        for side, prefix, spans, busy in (("receiver", "R.", r, r_busy), ("source", "S.", s, s_busy)):
            nixl = sum(v for k, v in spans.items() if k.startswith("agent."))
            copies = spans.get("copy", 0) + _device_waits(tl, prefix)
            marking = mark_ns * sum(1 for _, g in tl if g.startswith(prefix)) / 2
            add(f"{side}.busy", busy)
            add(f"{side}.nixl", nixl)
            add(f"{side}.copy", copies)
            add(f"{side}.marking", marking)
            add(f"{side}.python", busy - nixl - copies - marking)
            for k, v in spans.items():
                add(f"{side}.{k}", v)
    return {"loads": len(timelines), **{k: median(v) for k, v in rows.items()}}


__all__ = ["ENV", "Timeline", "load_timelines", "host_time", "FUNCTIONS", "AGENT_METHODS",
           "EVENT_METHODS"]

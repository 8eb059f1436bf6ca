"""Where an event loop's host time goes: per callback, and per engine function.

The stage table (``snapshot_metrics()["stages"]``) times the stages of a load from start
to end, waits for the event loop included; under load that hides which *work* fills the
loop. :class:`HostProfile` counts the work itself, in one process, while installed:

* every asyncio callback the loop runs, by what it is: ``task:`` and the task's
  coroutine chain where it was suspended (``task:BatchScheduler._run_group>Receiver.take``:
  the step that resumed it there), or the callback's name;
* every call of the engine functions in :data:`FUNCTIONS` (parsing, the lookup, building
  run tables, launches, waiting for CUDA events, NIXL calls), nested inside the
  callbacks above (so the rows do not add up to the wall time).

It wraps ``asyncio.events.Handle._run`` and those functions (``uninstall`` restores
them), so it runs on the asyncio backend only, and it costs about a microsecond per
callback and per wrapped call: compare its rows with each other, not with an unprofiled
run. ``xavier-async bench --serving-host-profile`` installs it in every process of the
serving section (a :class:`~xavier_async.testing.PeerProcess` installs one when :data:`ENV`
is set in its environment) and reports it per phase.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

#: set in a peer process's environment to install a profile there (the bench does)
ENV = "XAVIER_ASYNC_HOST_PROFILE"

#: (module, attribute path) of the functions timed on every call
FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("xavier_async.endpoint", "Endpoint._on_message"),
    ("xavier_async.endpoint", "decode"),
    ("xavier_async.source", "Source.on_load"),
    ("xavier_async.source", "Source._post"),
    ("xavier_async.source", "parse_load"),
    ("xavier_async.source", "decide"),
    ("xavier_async.source", "pack"),
    ("xavier_async.receiver", "Receiver._recv_slab_free"),
    ("xavier_async.receiver", "unpack"),
    ("xavier_async.packing", "pack_table"),
    ("xavier_async.packing", "unpack_table"),
    ("xavier_async.packing", "DeviceRuns.run"),
    ("xavier_async.planning", "Planner.plan"),
    ("xavier_async.transports.nixl", "NixlTransport.post"),
)
#: methods of the NIXL agent timed on every call (wrapped on each agent made while installed)
AGENT_METHODS = ("transfer", "check_xfer_state", "send_notif", "get_new_notifs")


def _label(fn: Any) -> str:
    """``module.qualname`` of a function (``packing.unpack``, ``source.Source._post``)."""
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}"


def _task_name(task: asyncio.Task[Any]) -> str:
    names: list[str] = []
    c: Any = task.get_coro()
    while c is not None and len(names) < 6:
        names.append(getattr(c, "__qualname__", None) or type(c).__name__)
        c = getattr(c, "cr_await", None)
    mine = [n for n in names if not n.endswith("_run_coro")][:2]  # anyio's task wrapper
    return "task:" + ">".join(mine)


class HostProfile:
    """Counts and nanoseconds per callback kind and per wrapped function (see the module)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.started = perf_counter_ns()
        self._undo: list[Callable[[], None]] = []

    def _add(self, name: str, ns: int) -> None:
        row = self.rows.get(name)
        if row is None:
            self.rows[name] = [1, ns]
        else:
            row[0] += 1
            row[1] += ns

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        add = self._add

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                add(name, perf_counter_ns() - t)
        return timed

    def _patch(self, owner: Any, attr: str, value: Any) -> None:
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, value)
        self._undo.append(lambda: setattr(owner, attr, old))

    def install(self) -> HostProfile:
        """Start counting (idempotent per profile: a second call does nothing)."""
        if self._undo:
            return self
        add = self._add
        run = asyncio.events.Handle._run

        def handle_run(handle: asyncio.Handle) -> None:
            cb = handle._callback  # type: ignore[attr-defined]
            owner = getattr(cb, "__self__", None)
            name = (_task_name(owner) if isinstance(owner, asyncio.Task)
                    else "callback:" + str(getattr(cb, "__qualname__", type(cb).__name__)))
            t = perf_counter_ns()
            try:
                run(handle)
            finally:
                add(name, perf_counter_ns() - t)

        self._patch(asyncio.events.Handle, "_run", handle_run)
        for module, path in FUNCTIONS:
            try:
                owner: Any = importlib.import_module(module)
            except ImportError:  # (NIXL not installed: nothing of it to time)
                continue
            *outer, attr = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            fn = getattr(owner, attr)
            self._patch(owner, attr, self._timed(_label(fn), fn))
        try:
            nixl = importlib.import_module("xavier_async.transports.nixl")
        except ImportError:
            self.reset()
            return self
        factory = nixl.nixl_agent_factory

        def agent_factory(*args: Any, **kwargs: Any) -> Any:
            agent = factory(*args, **kwargs)
            for m in AGENT_METHODS:
                setattr(agent, m, self._timed("agent." + m, getattr(agent, m)))
            return agent

        self._patch(nixl, "nixl_agent_factory", agent_factory)
        self.reset()
        return self

    def uninstall(self) -> None:
        """Restore everything :meth:`install` replaced (agents made meanwhile stay timed)."""
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        """Forget what was counted; the wall clock starts again."""
        self.rows = {}
        self.started = perf_counter_ns()

    def snapshot(self, top: int = 25) -> dict[str, Any]:
        """``wall_us`` since the last reset and the ``top`` rows by total time, each
        ``[name, calls, total_us, us_per_call]``."""
        wall = perf_counter_ns() - self.started
        rows = sorted(self.rows.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
        return {"wall_us": wall / 1e3,
                "rows": [[name, n, ns / 1e3, ns / n / 1e3] for name, (n, ns) in rows]}


__all__ = ["ENV", "FUNCTIONS", "AGENT_METHODS", "HostProfile"]

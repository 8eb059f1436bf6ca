"""What an endpoint's roles share: its settings, transport, metrics, lifecycle, task
group and local caches, and the count of work in flight that close drains.

The :class:`~xavier_async.endpoint.Endpoint` facade makes one :class:`Runtime` and hands it
to its receiver and its source; neither knows the facade.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import torch

from .config import EndpointConfig
from .copythreads import CopyThreads
from .errors import EndpointClosedError
from .layout import CacheLayout, LayerId
from .lifecycle import Lifecycle
from .metrics import EndpointMetrics
from .packing import CacheTable, DeviceRuns, byte_rows
from .shielded import wait_terminal
from .tasks import OnCrash, Tasks
from .transports.base import Transport

log = logging.getLogger("xavier_async")

#: how many forks this process descends from (a forked child sees a new value without a
#: getpid() system call on every load)
_forks = 0


def _after_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class Caches:
    """The engine's caches as the roles copy them: raw byte rows (copies are bit-exact),
    their base addresses (run tables), the block size of every layer, and on CUDA the
    fused pack/unpack launcher (made at start; ``None``: the tensor path)."""

    __slots__ = ("layout", "tensors", "rows", "table", "block_sizes", "device_runs")

    def __init__(self, caches: Mapping[Any, torch.Tensor]) -> None:
        self.layout = CacheLayout.of(caches)
        self.tensors: dict[LayerId, torch.Tensor] = dict(caches)
        self.rows = byte_rows(self.tensors)
        self.table = CacheTable(self.rows)
        self.block_sizes = [spec.block_nbytes for spec in self.layout.layers.values()]
        self.device_runs: DeviceRuns | None = None

    def start(self) -> None:
        """On CUDA, make the fused launcher (no Triton: the tensor path); idempotent."""
        if self.layout.device.type == "cuda" and self.device_runs is None:
            try:
                runs = DeviceRuns(self.layout.device)
                runs.warm_up()  # compile at start, not on the first load
                self.device_runs = runs
            except Exception:
                log.info("fused pack/unpack unavailable; using tensor copies", exc_info=True)


class Runtime:
    """One endpoint's shared state: ``rank``, ``config``, ``transport``, ``metrics``,
    ``caches``, ``life`` (its :class:`~xavier_async.lifecycle.Lifecycle`), ``tasks``
    (its guarded task group, from start on) and ``copies`` (its copy threads; none for
    caches on a GPU)."""

    __slots__ = ("rank", "config", "transport", "metrics", "stages", "caches", "life", "tasks",
                 "copies", "inflight", "_idle", "_pid", "_forks")

    def __init__(self, rank: int, config: EndpointConfig, transport: Transport, caches: Caches) -> None:
        self.rank = rank
        self.config = config
        self.transport = transport
        self.metrics = EndpointMetrics()
        self.stages = self.metrics.stages
        self.caches = caches
        self.life = Lifecycle()
        self.tasks: Tasks | None = None
        host = caches.layout.device.type == "cpu"
        self.copies = CopyThreads(config.copy_threads if host else 0, config.copy_thread_bytes,
                                  split=config.split_copies)
        #: loads and copies in flight (close waits for them)
        self.inflight = 0
        self._idle: anyio.Event | None = None
        self._pid = os.getpid()
        self._forks = _forks

    def check_open(self) -> None:
        """Raise :class:`EndpointClosedError` unless the endpoint takes work: open, and in
        the process that made it."""
        self.life.check_open()
        if self._forks != _forks:
            raise EndpointClosedError(
                f"this Endpoint was created in process {self._pid}; a forked child cannot use "
                "it (its event loop, transport and registrations belong to the parent): create "
                "endpoints in the child, and start children with the 'spawn' method")

    @property
    def running(self) -> bool:
        """Open, with its task group: new background work may start."""
        return self.tasks is not None and self.life.open

    def spawn(self, func: Callable[..., Awaitable[Any]], *args: Any,
              on_crash: OnCrash | None = None) -> None:
        """Start a guarded background task (a crash is logged and reported to
        ``on_crash``; it never takes the endpoint down)."""
        if self.tasks is None:
            raise EndpointClosedError("endpoint is not open")
        self.tasks.start_soon(func, *args, on_crash=on_crash)

    def enter_work(self) -> None:
        """A caller's work starts (a load): only while open."""
        self.check_open()
        self.inflight += 1

    def leave_work(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()

    async def drained(self) -> BaseException | None:
        """Wait until no work is in flight (shielded); returns a cancellation that arrived
        meanwhile, for the caller to re-raise once it has finished closing."""
        if not self.inflight:
            return None
        self._idle = anyio.Event()
        return await wait_terminal(self._idle.wait)


__all__ = ["Caches", "Runtime"]

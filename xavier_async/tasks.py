"""The endpoint's background tasks: one anyio task group, every task in it guarded.

A task that raises (anything but a cancellation) is a broken invariant somewhere in the
library or in a transport plugin. It must not take the endpoint down: left alone, the
exception would cancel every other task of the group and come out of ``async with
Endpoint`` as an ``ExceptionGroup``, failing every load in flight. :class:`Tasks` runs
each task under a guard that logs the failure with the task's name and hands an
:class:`~xavier_async.errors.InternalError` to the task's ``on_crash`` callback (which
fails the loads that task concerns); the endpoint carries on serving everything else.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from anyio.abc import TaskGroup

from .errors import InternalError
from .transports.base import TaskSpawner

log = logging.getLogger("xavier_async")

#: called with the typed error when a guarded task crashed
OnCrash = Callable[[InternalError], None]


class Tasks(TaskSpawner):
    """Start tasks in ``group``, each guarded (see the module docstring). ``owner`` names
    the endpoint in log lines."""

    __slots__ = ("group", "owner", "crashes")

    def __init__(self, group: TaskGroup, owner: str) -> None:
        self.group = group
        self.owner = owner
        #: how many tasks crashed (each one logged; a healthy endpoint has 0)
        self.crashes = 0

    def start_soon(self, func: Callable[..., Awaitable[Any]], *args: Any, name: object = None,
                   on_crash: OnCrash | None = None) -> None:
        """Run ``func(*args)`` in the group; if it raises, log it and call ``on_crash``."""
        self.group.start_soon(self._guarded, func, args, on_crash,
                              name=name if name is not None else getattr(func, "__qualname__", func))

    async def _guarded(self, func: Callable[..., Awaitable[Any]], args: tuple[object, ...],
                       on_crash: OnCrash | None) -> None:
        try:
            await func(*args)
        except Exception as exc:  # a cancellation (BaseException) passes through
            self.crashes += 1
            what = getattr(func, "__qualname__", repr(func))
            log.error("%s: background task %s failed; the loads it concerns fail, the endpoint "
                      "carries on (this is a bug: please report it)", self.owner, what,
                      exc_info=True)
            if on_crash is not None:
                err = InternalError(f"{self.owner}: {what} failed: {exc!r}")
                err.__cause__ = exc
                try:
                    on_crash(err)
                except Exception:
                    log.exception("%s: reporting the failure of %s failed", self.owner, what)

    def cancel(self) -> None:
        """Stop every task (the endpoint's shutdown)."""
        self.group.cancel_scope.cancel()

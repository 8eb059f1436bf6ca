"""An endpoint's lifecycle as a state machine (pure: no I/O, no event loop).

Defined once with :mod:`transitions` (:func:`build_lifecycle`); :class:`Lifecycle` reads
a plain table derived from it, as the channel machine does (:mod:`xavier_async.policy`),
and the docs draw the diagram from the same definition.

========== ============= ==========================================================
state      event         next state
========== ============= ==========================================================
new        start         starting (``async with`` allocates, registers, listens)
new        close         closed (closed before it was ever entered)
starting   started       open
starting   start_failed  closed (everything undone)
open       close         closing (drains the loads and copies in flight)
closing    closed        closed
========== ============= ==========================================================

Work is accepted only while ``open`` (:meth:`Lifecycle.check_open`, the one guard).
"""

from __future__ import annotations

import enum
import functools
from typing import Final

from transitions import Machine

from .errors import EndpointClosedError, InternalError


class Phase(str, enum.Enum):
    """Where an endpoint is in its life."""

    NEW = "new"
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


START: Final = "start"
STARTED: Final = "started"
START_FAILED: Final = "start_failed"
CLOSE: Final = "close"
CLOSED: Final = "closed"

#: (source, event, destination): the lifecycle, in one place
TRANSITIONS: Final = (
    (Phase.NEW, START, Phase.STARTING),
    (Phase.NEW, CLOSE, Phase.CLOSED),
    (Phase.STARTING, STARTED, Phase.OPEN),
    (Phase.STARTING, START_FAILED, Phase.CLOSED),
    (Phase.OPEN, CLOSE, Phase.CLOSING),
    (Phase.CLOSING, CLOSED, Phase.CLOSED),
)


def build_lifecycle() -> Machine:
    """The lifecycle as a :mod:`transitions` machine (the definition the table and the
    docs are read from)."""
    return Machine(model="self", states=[p.value for p in Phase],
                   transitions=[{"trigger": e, "source": s.value, "dest": d.value}
                                for s, e, d in TRANSITIONS],
                   initial=Phase.NEW.value, auto_transitions=False, ignore_invalid_triggers=False)


@functools.lru_cache(maxsize=1)
def lifecycle_table() -> dict[tuple[Phase, str], Phase]:
    """``{(state, event): next state}`` read off :func:`build_lifecycle`."""
    machine = build_lifecycle()
    table: dict[tuple[Phase, str], Phase] = {}
    for state in Phase:
        for event in (START, STARTED, START_FAILED, CLOSE, CLOSED):
            found = machine.get_transitions(trigger=event, source=state.value)
            if found:
                table[(state, event)] = Phase(found[0].dest)
    return table


class Lifecycle:
    """An endpoint's phase; :meth:`fire` moves it along :data:`TRANSITIONS` only."""

    __slots__ = ("phase", "_table")

    def __init__(self) -> None:
        self.phase = Phase.NEW
        self._table = lifecycle_table()

    def fire(self, event: str) -> Phase:
        """Take ``event``; an event the current phase has no transition for is a bug."""
        nxt = self._table.get((self.phase, event))
        if nxt is None:
            raise InternalError(f"the endpoint cannot {event!r} while {self.phase.value}")
        self.phase = nxt
        return nxt

    @property
    def open(self) -> bool:
        return self.phase is Phase.OPEN

    @property
    def closed(self) -> bool:
        """Closing or closed: no new work is taken."""
        return self.phase is Phase.CLOSING or self.phase is Phase.CLOSED

    def check_open(self) -> None:
        """The one guard of every entry point: raise unless the endpoint is open."""
        if self.phase is not Phase.OPEN:
            raise EndpointClosedError(
                "endpoint is not open (use `async with Endpoint(...)`)" if self.phase is Phase.NEW
                else "endpoint is not open yet" if self.phase is Phase.STARTING
                else "endpoint is closed")


__all__ = ["Phase", "Lifecycle", "TRANSITIONS", "build_lifecycle", "lifecycle_table",
           "START", "STARTED", "START_FAILED", "CLOSE", "CLOSED"]

"""The peer-channel state machine: which slab view a batch is copied through.

The machine is defined once, with :mod:`transitions`, by :func:`build_machine`. It is the
single source of truth: :class:`ChannelPolicy` derives a plain lookup table from it at
construction (``Machine.trigger`` costs ~20 us, as much as a small copy), and the docs'
state diagram is generated from it (:mod:`xavier_async.diagram`).

With the default streak of 2 the table is exactly:

========== ================================== ===================
state      small batch (payload <= small view) large batch
========== ================================== ===================
full       -> streak_1, full slab             -> full, full slab
streak_1   -> small, small view               -> full, full slab
small      -> small, small view               -> full, full slab
========== ================================== ===================

The view used is the view of the state *after* the event.
"""

from __future__ import annotations

import functools
from typing import Final

from transitions import Machine

from ._checks import check_int
from .errors import InvalidRequestError
from .sizes import FULL, SMALL, SlabSizes, View

SMALL_BATCH: Final = "small_batch"
LARGE_BATCH: Final = "large_batch"
EVENTS: Final = (SMALL_BATCH, LARGE_BATCH)
DEFAULT_STREAK: Final = 2


def state_names(streak: int = DEFAULT_STREAK) -> list[str]:
    """States of the machine for a streak length: ``full, streak_1 .. streak_{n-1}, small``."""
    _check_streak(streak)
    return [FULL, *(f"streak_{i}" for i in range(1, streak)), SMALL]


def state_view(state: str) -> View:
    """The slab view (``"full"`` or ``"small"``) a state copies through."""
    return SMALL if state == SMALL else FULL


def build_machine(streak: int = DEFAULT_STREAK) -> Machine:
    """Build the channel machine with :mod:`transitions`: the one definition of the policy.

    ``streak`` is how many consecutive small batches it takes before the small view is
    used (``1`` = size-only selection). A large batch always returns to ``full``.
    """
    states = state_names(streak)
    transitions = []
    for i, src in enumerate(states):
        nxt = states[min(i + 1, len(states) - 1)]
        transitions.append({"trigger": SMALL_BATCH, "source": src, "dest": nxt})
        transitions.append({"trigger": LARGE_BATCH, "source": src, "dest": FULL})
    return Machine(
        model="self",
        states=states,
        transitions=transitions,
        initial=FULL,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


@functools.lru_cache(maxsize=32)
def transition_table(streak: int = DEFAULT_STREAK) -> dict[tuple[str, str], str]:
    """``{(state, event): next_state}`` read off the :mod:`transitions` machine."""
    machine = build_machine(streak)
    table: dict[tuple[str, str], str] = {}
    for event in EVENTS:
        for src in machine.states:
            found = machine.get_transitions(trigger=event, source=src)
            if len(found) != 1:
                raise AssertionError(f"machine must be deterministic: {src} on {event}")
            table[(src, event)] = str(found[0].dest)
    return table


def _check_streak(streak: object) -> int:
    return check_int("streak", streak, minimum=1)


class ChannelPolicy:
    """Per-peer view selection, driven by the channel state machine.

    >>> p = ChannelPolicy(16, 4)
    >>> [p.select(n) for n in (8, 4, 4, 8, 4)]
    [16, 16, 4, 16, 16]

    ``select`` costs one dict lookup: the table is derived from the :mod:`transitions`
    machine once per streak length.
    """

    __slots__ = ("sizes", "full_bytes", "small_bytes", "streak", "state", "_next", "_view",
                 "_bytes")

    def __init__(self, full_bytes: int, small_bytes: int, streak: int = DEFAULT_STREAK) -> None:
        self._setup(SlabSizes(full_bytes, small_bytes), _check_streak(streak))

    @classmethod
    def of(cls, sizes: SlabSizes, streak: int = DEFAULT_STREAK) -> ChannelPolicy:
        """A policy for already validated sizes (what the endpoint makes per peer)."""
        self = cls.__new__(cls)
        self._setup(sizes, _check_streak(streak))
        return self

    def _setup(self, sizes: SlabSizes, streak: int) -> None:
        self.sizes = sizes
        self.full_bytes, self.small_bytes = sizes.full, sizes.small
        self.streak = streak
        table = transition_table(streak)
        # (state, is_small) -> next state; next state -> its view and that view's bytes
        self._next = {(s, e == SMALL_BATCH): d for (s, e), d in table.items()}
        self._view: dict[str, View] = {s: sizes.view_for(state_view(s)) for s in state_names(streak)}
        self._bytes = {s: sizes.nbytes(v) for s, v in self._view.items()}
        self.state: str = FULL

    def select(self, nbytes: int) -> int:
        """Feed one batch of ``nbytes`` payload; return the bytes of the view to copy through."""
        if type(nbytes) is not int:
            nbytes = check_int("nbytes", nbytes)
        if nbytes <= 0:
            raise InvalidRequestError(f"batch payload must be > 0 bytes, got {nbytes}")
        if nbytes > self.full_bytes:
            raise InvalidRequestError(
                f"batch payload {nbytes} B exceeds the full slab ({self.full_bytes} B)"
            )
        self.state = state = self._next[(self.state, nbytes <= self.small_bytes)]
        return self._bytes[state]

    def peek(self, nbytes: int) -> int:
        """The bytes of the view ``select(nbytes)`` would choose, without changing state."""
        return self._bytes[self._next[(self.state, 0 < nbytes <= self.small_bytes)]]

    def peek_view(self, nbytes: int) -> View:
        """The view ``select(nbytes)`` would choose, by name, without changing state."""
        return self._view[self._next[(self.state, 0 < nbytes <= self.small_bytes)]]

    def commit(self, nbytes: int) -> View:
        """Advance the machine for a batch already validated (``0 < nbytes <= full``) and
        return the view by name: the hot path's single dict lookup."""
        self.state = state = self._next[(self.state, nbytes <= self.small_bytes)]
        return self._view[state]

    def reset(self) -> None:
        """Back to ``full`` (used when the peer's channel is reset after a failure)."""
        self.state = FULL

    def __repr__(self) -> str:
        return (f"ChannelPolicy(full_bytes={self.full_bytes}, small_bytes={self.small_bytes}, "
                f"streak={self.streak}, state={self.state!r})")

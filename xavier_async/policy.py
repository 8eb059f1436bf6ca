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
import operator
from typing import Final

from transitions import Machine

from .errors import InvalidRequestError

SMALL_BATCH: Final = "small_batch"
LARGE_BATCH: Final = "large_batch"
EVENTS: Final = (SMALL_BATCH, LARGE_BATCH)
FULL: Final = "full"
SMALL: Final = "small"
DEFAULT_STREAK: Final = 2


def state_names(streak: int = DEFAULT_STREAK) -> list[str]:
    """States of the machine for a streak length: ``full, streak_1 .. streak_{n-1}, small``."""
    _check_streak(streak)
    return [FULL, *(f"streak_{i}" for i in range(1, streak)), SMALL]


def state_view(state: str) -> str:
    """The slab view (``"full"`` or ``"small"``) a state copies through."""
    return SMALL if state == SMALL else FULL


def build_machine(streak: int = DEFAULT_STREAK, model: object | None = None) -> Machine:
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
        model=model if model is not None else "self",
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


def _check_streak(streak: int) -> None:
    if isinstance(streak, bool) or not isinstance(streak, int) or streak < 1:
        raise InvalidRequestError(f"streak must be an integer >= 1, got {streak!r}")


def check_size(name: str, value: object, *, minimum: int = 1) -> int:
    """Validate a byte count/budget: an int (not bool) >= ``minimum``."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if not isinstance(value, int):
        try:
            value = operator.index(value)  # type: ignore[arg-type]  # numpy / torch ints
        except TypeError:
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}") from None
    if value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value}")
    return value


class ChannelPolicy:
    """Per-peer view selection, driven by the channel state machine.

    >>> p = ChannelPolicy(16, 4)
    >>> [p.select(n) for n in (8, 4, 4, 8, 4)]
    [16, 16, 4, 16, 16]

    ``select`` costs one dict lookup: the table is derived from the :mod:`transitions`
    machine once per streak length.
    """

    __slots__ = ("full_bytes", "small_bytes", "streak", "state", "_next", "_bytes")

    def __init__(self, full_bytes: int, small_bytes: int, streak: int = DEFAULT_STREAK) -> None:
        self.full_bytes = check_size("full_bytes", full_bytes)
        self.small_bytes = check_size("small_bytes", small_bytes)
        if self.small_bytes > self.full_bytes:
            raise InvalidRequestError(
                f"small_bytes ({self.small_bytes}) must not exceed full_bytes ({self.full_bytes})"
            )
        _check_streak(streak)
        self.streak = streak
        table = transition_table(streak)
        # (state, is_small) -> next state; next state -> bytes of its view
        self._next = {(s, e == SMALL_BATCH): d for (s, e), d in table.items()}
        self._bytes = {s: self.small_bytes if state_view(s) == SMALL else self.full_bytes
                       for s in state_names(streak)}
        self.state: str = FULL

    def select(self, nbytes: int) -> int:
        """Feed one batch of ``nbytes`` payload; return the bytes of the view to copy through."""
        if type(nbytes) is not int:
            nbytes = check_size("nbytes", nbytes)
        if nbytes <= 0:
            raise InvalidRequestError(f"batch payload must be > 0 bytes, got {nbytes}")
        if nbytes > self.full_bytes:
            raise InvalidRequestError(
                f"batch payload {nbytes} B exceeds the full slab ({self.full_bytes} B)"
            )
        self.state = state = self._next[(self.state, nbytes <= self.small_bytes)]
        return self._bytes[state]

    def peek(self, nbytes: int) -> int:
        """The view ``select(nbytes)`` would choose, without changing state."""
        small = 0 < nbytes <= self.small_bytes
        return self._bytes[self._next[(self.state, small)]]

    def reset(self) -> None:
        """Back to ``full`` (used when the peer's channel is reset after a failure)."""
        self.state = FULL

    def __repr__(self) -> str:
        return (f"ChannelPolicy(full_bytes={self.full_bytes}, small_bytes={self.small_bytes}, "
                f"streak={self.streak}, state={self.state!r})")

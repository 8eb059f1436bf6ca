"""Waiting for a started copy to reach its terminal state, whatever the caller does.

anyio's shield holds back anyio cancellation but not a native ``asyncio`` ``Task.cancel()``
(or a cancellation from outside anyio's scopes). :func:`wait_terminal` keeps waiting
through such a cancellation and hands it back, so the caller re-raises it once the copy is
terminal and the slab may be reused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio


async def wait_terminal(step: Callable[[], Awaitable[object]],
                        deadline: float | None = None) -> BaseException | None:
    """Await ``step()`` in a shielded scope until it returns (call it again after each
    native cancellation); return the last such cancellation, or ``None``. With
    ``deadline`` (on :func:`anyio.current_time`) the wait also ends then, quietly: the
    caller sees that ``step`` did not finish (one scope does both: the hot path of a load
    pays for one)."""
    held: BaseException | None = None
    with anyio.CancelScope(shield=True) as scope:
        if deadline is not None:
            scope.deadline = deadline
        while True:
            try:
                await step()
                break
            except anyio.get_cancelled_exc_class() as exc:
                if scope.cancel_called:  # our own deadline: the scope absorbs it
                    raise
                held = exc  # a native cancellation got through the shield
    return held

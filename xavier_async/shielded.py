"""Waiting for a started copy to reach its terminal state, whatever the caller does.

anyio's shield holds back anyio cancellation but not a native ``asyncio`` ``Task.cancel()``
(or a cancellation from outside anyio's scopes). :func:`wait_terminal` keeps waiting
through such a cancellation and hands it back, so the caller re-raises it once the copy is
terminal and the slab may be reused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio


async def wait_terminal(step: Callable[[], Awaitable[object]]) -> BaseException | None:
    """Await ``step()`` in a shielded scope until it returns (call it again after each
    native cancellation); return the last such cancellation, or ``None``."""
    held: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while True:
            try:
                await step()
                break
            except anyio.get_cancelled_exc_class() as exc:  # only a native one gets through
                held = exc
    return held


def until_set(event: anyio.Event, timeout: float | None = None) -> Callable[[], Awaitable[None]]:
    """A :func:`wait_terminal` step: wait for ``event``, up to ``timeout`` seconds in all
    (the deadline is fixed now, on :func:`anyio.current_time`, and survives re-entry)."""
    deadline = None if timeout is None else anyio.current_time() + timeout

    async def step() -> None:
        if deadline is None:
            await event.wait()
            return
        with anyio.move_on_after(deadline - anyio.current_time()):
            await event.wait()

    return step

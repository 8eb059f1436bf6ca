"""Waiting for a started copy to reach its terminal state, whatever the caller does.

anyio's shield holds back anyio cancellation but not a native ``asyncio`` ``Task.cancel()``
(or a cancellation from outside anyio's scopes). :func:`wait_terminal` keeps waiting
through such a cancellation and hands it back, so the caller re-raises it once the copy is
terminal and the slab may be reused. :class:`Landing` is the same wait for one request's
reply, with a timeout, made cheap on asyncio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

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


Step = Callable[[], Awaitable[object]]


class Landing:
    """One request's outcome arriving: :meth:`set` by its reply (or a failure), waited
    for by :meth:`wait_terminal` until then or until ``timeout`` seconds have passed,
    whatever the caller does (the semantics of :func:`wait_terminal`). :func:`landing`
    picks the implementation for the running backend."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    @staticmethod
    async def pass_held() -> BaseException | None:
        """One schedule point after the request went out (the copy is started, so nothing
        may cancel the wait for it): a cancellation delivered there, a scope's or a native
        one, is returned, held for the caller to raise once the copy is terminal (as
        :meth:`wait_terminal` does); the caller need not check for one again before it
        awaits anything else."""
        try:
            await anyio.lowlevel.checkpoint()
        except anyio.get_cancelled_exc_class() as exc:
            return exc
        return None

    async def wait_terminal(self, step: Step, timeout: float) -> BaseException | None:
        """Await ``step()`` (the request's send) once, then the outcome, in a shielded
        scope; return the last native cancellation held meanwhile, or ``None``. At the
        timeout it returns quietly: the caller sees that nothing was set."""
        sent = False

        async def send_then_wait() -> None:
            nonlocal sent
            if not sent:
                sent = True  # before awaiting: a cancellation in the send must not resend
                await step()
            await self._event.wait()

        return await wait_terminal(send_then_wait, anyio.current_time() + timeout)


class _AsyncioLanding(Landing):
    """:class:`Landing` on asyncio: a bare future and one timer instead of an event and a
    cancel scope with a deadline (a load pays for one of these: ~1 us against ~10)."""

    __slots__ = ("_loop", "_future", "_landed", "_expired", "_sending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None
        self._landed = self._expired = False
        #: the scope of a send still under way (the timeout cancels it, as a deadline would)
        self._sending: anyio.CancelScope | None = None

    def set(self) -> None:
        self._landed = True
        f = self._future
        if f is not None and not f.done():
            f.set_result(None)

    def _expire(self) -> None:
        self._expired = True
        if self._sending is not None:  # the send itself hangs: end it, as a deadline would
            self._sending.cancel()
        f = self._future
        if f is not None and not f.done():
            f.set_result(None)

    async def wait_terminal(self, step: Step, timeout: float) -> BaseException | None:
        held: BaseException | None = None
        loop = self._loop
        timer = loop.call_later(timeout, self._expire)
        sent = False
        try:
            with anyio.CancelScope(shield=True) as scope:
                while True:
                    try:
                        if not sent:
                            sent = True  # before awaiting: a cancellation must not resend
                            self._sending = scope
                            try:
                                await step()
                            finally:
                                self._sending = None
                        while not (self._landed or self._expired):
                            f = self._future
                            if f is None or f.done():  # (a native cancellation cancels it)
                                f = self._future = loop.create_future()
                            await f
                        break
                    except asyncio.CancelledError as exc:
                        if scope.cancel_called:  # our own timeout: the scope absorbs it
                            raise
                        held = exc  # a native cancellation got through the shield
        finally:
            timer.cancel()
        return held


def landing_factory() -> Callable[[], Landing]:
    """What makes a :class:`Landing` on the running event loop from now on (decided once:
    a receiver keeps it): on asyncio the cheap form, bound to the loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        return Landing
    if asyncio.current_task() is None:  # pragma: no cover - a loop, but not our task's
        return Landing
    return partial(_AsyncioLanding, loop)


def landing() -> Landing:
    """A :class:`Landing` for the running event loop's backend."""
    return landing_factory()()

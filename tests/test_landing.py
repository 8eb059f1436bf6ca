"""The receiver's wait for one request's reply (:class:`xavier_async.shielded.Landing`):
sent once, waited for whatever the caller does, ended quietly by its timeout (a hanging
send included), on both backends; asyncio's cheap form must keep those semantics."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from xavier_async.shielded import Landing, _AsyncioLanding, landing

from .conftest import asyncio_only

pytestmark = pytest.mark.anyio


async def test_the_backend_gets_its_form(anyio_backend):
    got = landing()
    assert type(got) is (_AsyncioLanding if anyio_backend == "asyncio" else Landing)


async def test_a_landing_returns_once_set_and_sends_once():
    sends = []
    ld = landing()

    async def send() -> None:
        sends.append(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(_set_soon, ld)
        with anyio.fail_after(5):
            assert await ld.wait_terminal(send, timeout=10) is None
    assert sends == [1]


async def _set_soon(ld: Landing) -> None:
    await anyio.sleep(0.01)
    ld.set()


async def test_a_landing_set_before_it_is_waited_for_returns_at_once():
    ld = landing()
    ld.set()

    async def send() -> None:
        pass

    with anyio.fail_after(30):                 # "at once": long before the 3600 s timeout
        assert await ld.wait_terminal(send, timeout=3600) is None


async def test_the_timeout_ends_the_wait_quietly():
    ld = landing()

    async def send() -> None:
        pass

    t0 = anyio.current_time()
    with anyio.fail_after(5):
        assert await ld.wait_terminal(send, timeout=0.05) is None
    assert anyio.current_time() - t0 >= 0.04


async def test_the_timeout_ends_a_send_that_hangs():
    ld = landing()
    with anyio.fail_after(5):
        assert await ld.wait_terminal(anyio.sleep_forever, timeout=0.05) is None


async def test_a_cancelled_caller_still_waits_for_the_outcome():
    """The caller's scope is cancelled mid-wait: the wait goes on (shielded) until the
    reply, and the cancellation surfaces after, at the caller's next checkpoint."""
    ld = landing()
    done = []

    async def send() -> None:
        pass

    async def waiter(scope_box: list[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            scope_box.append(scope)
            await ld.wait_terminal(send, timeout=10)
            done.append("waited")
            await anyio.lowlevel.checkpoint()
            done.append("not cancelled")  # never: the cancellation lands at the checkpoint

    box: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, box)
        await anyio.sleep(0.01)
        box[0].cancel()
        await anyio.sleep(0.05)
        assert done == []  # still waiting: no reply yet
        ld.set()
    assert done == ["waited"]


@asyncio_only
async def test_a_native_cancellation_is_held_until_the_outcome():
    ld = landing()

    async def send() -> None:
        pass

    task = asyncio.ensure_future(ld.wait_terminal(send, timeout=10))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.02)
    assert not task.done()  # held: the copy may still land
    ld.set()
    held = await task
    assert isinstance(held, asyncio.CancelledError)


async def test_pass_held_holds_what_a_cancelled_scope_delivers():
    """The schedule point of a round trip whose request is out: a scope's cancellation
    never escapes it but is handed back, held (the round trip raises it once its copy is
    terminal), on both backends."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        held = await landing().pass_held()  # does not raise
        assert isinstance(held, anyio.get_cancelled_exc_class())
        raise held
    assert scope.cancelled_caught


async def test_pass_held_returns_none_without_a_cancellation():
    assert await landing().pass_held() is None


@asyncio_only
async def test_pass_held_holds_a_native_cancellation():
    task = asyncio.current_task()
    assert task is not None
    task.cancel()
    held = await landing().pass_held()
    assert isinstance(held, asyncio.CancelledError)
    assert task.uncancel() == 0

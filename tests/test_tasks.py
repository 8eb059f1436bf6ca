"""The endpoint's guarded task group (:mod:`xavier_async.tasks`): a task that raises is
logged and reported to its ``on_crash``; the group and its other tasks carry on."""

from __future__ import annotations

import logging

import anyio
import pytest

from xavier_async import InternalError
from xavier_async.tasks import Tasks

pytestmark = pytest.mark.anyio


async def test_a_task_that_raises_is_reported_and_the_others_carry_on(caplog):
    reported: list[InternalError] = []
    done = anyio.Event()

    async def broken() -> None:
        raise KeyError("an invariant broke")

    async def healthy() -> None:
        await anyio.sleep(0.02)
        done.set()

    with caplog.at_level(logging.ERROR, logger="xavier_async"):
        async with anyio.create_task_group() as group:
            tasks = Tasks(group, "rank 7")
            tasks.start_soon(broken, on_crash=reported.append)
            tasks.start_soon(healthy)
            await done.wait()
            assert tasks.crashes == 1
    assert len(reported) == 1 and isinstance(reported[0].__cause__, KeyError)
    assert "rank 7" in str(reported[0]) and "broken" in str(reported[0])
    assert any("background task" in r.getMessage() and "broken" in r.getMessage()
               for r in caplog.records)


async def test_a_cancelled_task_is_not_a_crash():
    async with anyio.create_task_group() as group:
        tasks = Tasks(group, "rank 0")
        tasks.start_soon(anyio.sleep_forever)
        await anyio.sleep(0)
        tasks.cancel()
    assert tasks.crashes == 0


async def test_a_failing_crash_report_is_logged_not_raised(caplog):
    def bad_report(exc: InternalError) -> None:
        raise RuntimeError("the report failed too")

    async def broken() -> None:
        raise ValueError("boom")

    async with anyio.create_task_group() as group:
        Tasks(group, "rank 1").start_soon(broken, on_crash=bad_report)
    assert any("reporting the failure" in r.getMessage() for r in caplog.records)

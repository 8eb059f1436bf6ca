"""The endpoint's copy threads: large host copies run off the event loop, a started copy
is waited for through cancellation, close joins the threads."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from xavier_async.config import EndpointConfig
from xavier_async.copythreads import CopyThreads
from xavier_async.errors import EndpointClosedError, InvalidRequestError
from xavier_async.packing import run_host

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_copy_runs_on_a_thread_and_moves_the_bytes() -> None:
    src = torch.arange(3 << 18, dtype=torch.int32).view(torch.uint8)  # 3 MiB
    dst = torch.zeros_like(src)
    copies = CopyThreads(2, 1 << 20)
    assert copies.wants(src.numel()) and not copies.wants((1 << 20) - 1)
    loop_thread = threading.get_ident()
    ran_on: list[int] = []

    def copy() -> None:
        ran_on.append(threading.get_ident())
        n = src.numel() // 2
        run_host(([dst.data_ptr(), dst.data_ptr() + n], [src.data_ptr(), src.data_ptr() + n], [n, n]))

    await copies.run(copy)
    assert ran_on and ran_on[0] != loop_thread
    assert torch.equal(dst, src)
    assert copies.copies == 1
    copies.close()
    copies.close()  # idempotent
    assert not copies.wants(src.numel())
    with pytest.raises(EndpointClosedError):
        await copies.run(copy)


async def test_a_started_copy_is_waited_for_through_cancellation() -> None:
    copies = CopyThreads(1, 1)
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def slow() -> None:
        started.set()
        release.wait(5)
        finished.append(True)

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(copies.run, slow)
            await anyio.to_thread.run_sync(started.wait, 5)
            scope.cancel()  # the copy is running: its wait is shielded
            await anyio.sleep(0.05)
            assert not finished
            release.set()
    assert scope.cancelled_caught and finished == [True]
    copies.close()


async def test_a_failing_copy_raises_its_error() -> None:
    copies = CopyThreads(1, 1)

    def boom() -> None:
        raise ValueError("bad run")

    with pytest.raises(ValueError, match="bad run"):
        await copies.run(boom)
    copies.close()


def test_settings_are_checked() -> None:
    assert EndpointConfig().copy_threads == 2 and EndpointConfig().copy_thread_bytes == 1 << 20
    with pytest.raises(InvalidRequestError, match="copy_threads"):
        EndpointConfig(copy_threads=-1)
    with pytest.raises(InvalidRequestError, match="copy_thread_bytes"):
        EndpointConfig(copy_thread_bytes=0)


@pytest.mark.parametrize("threads", [2, 0])
async def test_an_endpoints_large_loads_are_copied_on_its_threads(threads: int) -> None:
    """A batch of at least ``copy_thread_bytes`` is packed and unpacked on the copy
    threads of both endpoints, with the right bytes; a smaller one, and every batch with
    ``copy_threads=0``, is copied on the loop."""
    from dataclasses import replace

    from .conftest import SMALL_CFG, assert_same_bytes, cluster, random_cache

    cfg = replace(SMALL_CFG, copy_threads=threads, copy_thread_bytes=8 * 1024)
    src = {0: random_cache(16, (256,), torch.float32, seed=3)}  # 1 KiB blocks
    dst = {0: random_cache(16, (256,), torch.float32, seed=4)}
    async with cluster([dst, src], cfg) as (a, b):
        for s in range(16):
            b.publish(f"k{s}", s)
        await a.load({1: {0: {"k0": 15}}})  # 1 KiB: on the loop
        assert a._rt.copies.copies == b._rt.copies.copies == 0
        await a.load({1: {0: {f"k{s}": s for s in range(1, 13)}}})  # 12 KiB
        expected = 1 if threads else 0
        assert a._rt.copies.copies == b._rt.copies.copies == expected
    assert_same_bytes(dst[0][15], src[0][0])
    for s in range(1, 13):
        assert_same_bytes(dst[0][s], src[0][s])
    assert a._rt.copies._pool is None  # joined at close


async def test_every_piece_of_a_split_copy_is_waited_for_and_the_first_failure_raised() -> None:
    """run_all hands every piece over at once (each on its own thread), waits for all of
    them through a cancellation, then raises the first piece's failure."""
    copies = CopyThreads(3, 1, split=True)
    started = threading.Barrier(3, timeout=5)  # all three pieces run at the same time
    release = threading.Event()
    finished: list[int] = []

    def piece(i: int) -> None:
        started.wait()
        release.wait(5)
        finished.append(i)
        if i:
            raise ValueError(f"piece {i}")

    import functools
    failed: list[BaseException] = []

    async def run() -> None:
        try:
            await copies.run_all([functools.partial(piece, i) for i in range(3)])
        except ValueError as exc:
            failed.append(exc)

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(0.05)
            scope.cancel()  # the pieces are running: the wait is shielded
            await anyio.sleep(0.05)
            assert not finished
            release.set()
    assert sorted(finished) == [0, 1, 2]
    assert [str(e) for e in failed] == ["piece 1"]
    assert copies.split_copies == 1
    copies.close()


def test_a_copy_is_cut_across_the_threads_only_when_large() -> None:
    assert [CopyThreads(2, 1 << 20, split=True).parts(n)
            for n in (1 << 20, (2 << 20) - 1, 2 << 20, 12 << 20)] == [1, 1, 2, 2]
    assert CopyThreads(4, 1 << 20, split=True).parts(3 << 20) == 3
    assert CopyThreads(1, 1 << 20, split=True).parts(12 << 20) == 1
    assert CopyThreads(4, 1 << 20).parts(12 << 20) == 1  # off by default
    assert EndpointConfig().split_copies is False
    with pytest.raises(InvalidRequestError, match="split_copies"):
        EndpointConfig(split_copies=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("split", [True, False])
async def test_an_endpoints_large_copies_are_cut_across_its_threads(split: bool, store: bool) -> None:
    """A batch of at least twice ``copy_thread_bytes`` is packed (from the snapshot store,
    or from the live slots) and unpacked in pieces on both copy threads at once, with the
    right bytes; with ``split_copies=False`` on one thread each."""
    from dataclasses import replace

    from .conftest import SMALL_CFG, assert_same_bytes, cluster, random_cache

    cfg = replace(SMALL_CFG, copy_threads=2, copy_thread_bytes=4 * 1024, split_copies=split,
                  **({} if store else {"snapshot_gpu_bytes": 0, "snapshot_cpu_bytes": 0}))
    src = {0: random_cache(16, (256,), torch.float32, seed=5)}  # 1 KiB blocks
    dst = {0: random_cache(16, (256,), torch.float32, seed=6)}
    async with cluster([dst, src], cfg) as (a, b):
        assert (b._source.store is not None) is store
        for s in range(16):
            b.publish(f"k{s}", s)
        await a.load({1: {0: {f"k{s}": 15 - s for s in range(12)}}})  # 12 KiB, scattered
        assert a._rt.copies.copies == b._rt.copies.copies == 1
        assert a._rt.copies.split_copies == b._rt.copies.split_copies == int(split)
    for s in range(12):
        assert_same_bytes(dst[0][15 - s], src[0][s])

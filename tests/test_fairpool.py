"""The fair pool (:mod:`xavier_async.fairpool`): FIFO lending by index, the head-of-line
rule for large borrowers (evaluated again when fences shrink the pool), cancellation that
takes nothing, and a pool that gives up on its waiters."""

from __future__ import annotations

import anyio
import pytest

from xavier_async.errors import InternalError, RegistrationError
from xavier_async.fairpool import FairPool, Ticket, large_cap


def test_the_pool_reserves_a_slab_for_small_batches_and_serves_in_order():
    pool = FairPool(range(3))
    a = pool.try_acquire(large=True)
    b = pool.try_acquire(large=True)
    assert (a, b) == (0, 1) and pool.try_acquire(large=True) is None     # the cap: 2 of 3
    big = pool.enqueue(large=True)                                       # waits (cap)
    small = pool.enqueue(large=False)                                    # not behind it
    assert small.granted and not big.granted and small.index == 2
    late = pool.enqueue(large=False)
    pool.release(small.index)          # a small one came back: the small waiter, not the big
    assert late.granted and not big.granted
    pool.release(a)                    # a large one came back: the large waiter gets it
    assert big.granted and pool.large_held == 2
    late.cancel()                      # a granted ticket cancelled gives its slab back
    assert pool.free == 1
    one = FairPool([0])                # one slab: no reservation
    assert one.try_acquire(large=True) == 0



# -- the pool under fences -----------------------------------------------------------------------------

def test_large_borrowers_leave_one_slab_for_small_ones():
    pool = FairPool(range(4))
    got = [pool.try_acquire(True) for _ in range(4)]
    assert got[:3] == [0, 1, 2] and got[3] is None       # the cap: all but one
    assert pool.try_acquire(False) == 3                   # a small batch still gets one


def test_a_fence_wakes_a_large_waiter_held_back_by_the_cap():
    """Three large borrowers hold slabs 0-2, a fourth waits (slab 3 is kept for small
    ones). The three are fenced (removed): the pool is one slab now, with no reservation,
    and the waiter gets slab 3 at once."""
    pool = FairPool(range(4))
    for _ in range(3):
        pool.try_acquire(True)
    waiter = pool.enqueue(True)
    assert not waiter.granted and pool.cap == 3
    pool.remove(0)
    pool.remove(1)
    assert not waiter.granted                             # two slabs: still one kept back
    pool.remove(2)
    assert waiter.granted and waiter.index == 3 and pool.cap == large_cap(1)
    pool.check()


def test_the_cap_follows_the_slabs_in_the_pool():
    pool = FairPool(range(4))
    assert pool.cap == 3
    for i in range(4):
        assert pool.try_acquire(False) == i
    pool.remove(0)
    pool.remove(1)
    assert pool.cap == 1 and pool.usable == 2


def test_removing_a_slab_that_is_not_lent_is_an_internal_error():
    pool = FairPool(range(2))
    with pytest.raises(InternalError):
        pool.remove(0)
    pool.add(5)
    with pytest.raises(InternalError):
        pool.add(5)


@pytest.mark.anyio
async def test_a_pool_that_gives_up_on_its_waiters_fails_their_take():
    pool = FairPool(range(1))
    pool.try_acquire(False)
    waiters = [pool.enqueue(False) for _ in range(2)]
    outcomes: list[BaseException] = []

    async def take(t: Ticket) -> None:
        try:
            await t.take()
        except RegistrationError as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        for t in waiters:
            tg.start_soon(take, t)
        await anyio.sleep(0.01)
        assert pool.fail_waiters(RegistrationError("no slab can come back")) == 2
    assert len(outcomes) == 2 and pool.waiting == 0
    pool.release(0)                                       # the pool itself is intact
    assert pool.try_acquire(False) == 0



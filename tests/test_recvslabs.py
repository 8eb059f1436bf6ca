"""The receiver's receive slabs (:mod:`xavier_async.recvslabs`): pool, spares and fenced
slabs, replacement indices, unpack tables, leases, as pure logic.

A hypothesis state machine drives every operation in any order (borrow small or large,
give back, fence, register a replacement that succeeds or fails, a late reply, a
reconnect, a cancelled borrower, a pool that gives up on its waiters) and checks after
every step that no slab is lent twice or both lent and fenced, that indices are never
reused, that the transport's registrations are exactly the slabs there are, and that no
borrower waits while a slab it may take is free.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from xavier_async.errors import InternalError, RegistrationError
from xavier_async.fairpool import Ticket, large_cap
from xavier_async.recvslabs import RecvSlabs
from xavier_async.slabs import Slab


def _slab(index: int) -> Slab:
    return Slab("recv", torch.zeros(32, dtype=torch.uint8), 8, index)


def _recv(k: int) -> RecvSlabs[tuple[str, int]]:
    return RecvSlabs([_slab(i) for i in range(k)], lambda s: ("rows", s.index))


# -- RecvSlabs -------------------------------------------------------------------------------

def test_replacement_indices_are_taken_before_registration_and_never_reused():
    recv = _recv(2)
    a, b = recv.new_index(), recv.new_index()             # two replacements at once
    assert (a, b) == (2, 3)
    recv.add(_slab(b))                                     # the second finishes first
    recv.add(_slab(a))
    assert sorted(recv.slabs) == sorted(recv.rows) == [0, 1, 2, 3]
    assert recv.new_index() == 4                           # a failed one's index is not reused
    with pytest.raises(InternalError):
        recv.add(_slab(2))                                 # a second slab 2: refused
    with pytest.raises(InternalError):
        recv.add(_slab(9))                                 # an index nobody took
    recv.check()


def test_the_unpack_table_is_kept_with_its_slab():
    recv = _recv(1)
    slab = _slab(recv.new_index())
    recv.add(slab)
    assert recv.rows[slab.index] == ("rows", slab.index) and recv.slabs[slab.index] is slab


# -- every interleaving --------------------------------------------------------------------------

class RecvSlabsMachine(RuleBasedStateMachine):
    """A receiver's slabs under any order of borrowing, fencing, replacing and releasing;
    the model tracks what each borrower holds and what the transport has registered."""

    def __init__(self) -> None:
        super().__init__()
        self.recv: RecvSlabs[tuple[str, int]] | None = None
        self.held: dict[int, bool] = {}            # lent slab -> large
        self.waiting: list[Ticket] = []
        self.registered: set[int] = set()          # the transport's receive registrations
        self.pending: list[int] = []               # replacements being registered
        self.issued: set[int] = set()              # every index ever handed out
        self.fenced_for: dict[int, tuple[int, int]] = {}   # slab -> (peer, req)
        self.req = 0

    @initialize(k=st.integers(1, 4))
    def start(self, k: int) -> None:
        self.recv = _recv(k)
        self.registered = set(range(k))
        self.issued = set(range(k))

    def _collect(self) -> None:
        """Borrowers whose tickets were granted take their slabs (as ``take`` would)."""
        for t in list(self.waiting):
            if t.granted:
                self.waiting.remove(t)
                assert t.index not in self.held, f"slab {t.index} lent twice"
                self.held[t.index] = t.large
                t.claim()
            elif t.error is not None:
                self.waiting.remove(t)

    @rule(large=st.booleans())
    @precondition(lambda self: self.recv is not None)
    def borrow(self, large: bool) -> None:
        assert self.recv is not None
        t = self.recv.pool.enqueue(large)
        self.waiting.append(t)
        self._collect()

    @rule()
    def fill_with_large(self) -> None:
        """Large borrowers until one is held back (the head-of-line rule's edge)."""
        assert self.recv is not None
        for _ in range(self.recv.target + 1):
            self.borrow(True)
            if any(not t.granted for t in self.waiting):
                break

    @rule(data=st.data())
    @precondition(lambda self: self.held)
    def give_back(self, data: st.DataObject) -> None:
        assert self.recv is not None
        index = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[index]
        self.recv.pool.release(index)
        self._collect()

    @rule(data=st.data(), peer=st.integers(1, 3))
    @precondition(lambda self: self.held)
    def fence(self, data: st.DataObject, peer: int) -> None:
        assert self.recv is not None
        index = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[index]
        self.req += 1
        self.recv.fence(index, peer, f"inc-{peer}", self.req)
        self.fenced_for[index] = (peer, self.req)
        self._collect()

    @rule()
    @precondition(lambda self: self.recv is not None and self.recv.short())
    def begin_replacement(self) -> None:
        assert self.recv is not None
        index = self.recv.new_index()              # taken before the registration awaits
        assert index not in self.issued, f"index {index} handed out twice"
        self.issued.add(index)
        self.recv.registering += 1
        self.pending.append(index)

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: self.pending)
    def finish_replacement(self, data: st.DataObject, ok: bool) -> None:
        assert self.recv is not None
        index = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self.recv.registering -= 1
        if ok:
            assert index not in self.registered
            self.registered.add(index)             # the transport registered it, then
            self.recv.add(_slab(index))            # it joins, with its unpack table
        self._collect()

    @rule(data=st.data())
    @precondition(lambda self: self.recv is not None and self.recv.fenced)
    def late_reply(self, data: st.DataObject) -> None:
        assert self.recv is not None
        index = data.draw(st.sampled_from(sorted(self.recv.fenced)))
        peer, req = self.fenced_for.pop(index)
        assert self.recv.release_reply(peer, req)
        self._collect()

    @rule(peer=st.integers(1, 3))
    @precondition(lambda self: self.recv is not None)
    def reconnect(self, peer: int) -> None:
        assert self.recv is not None
        n = self.recv.release_peer(peer, f"inc-{peer}")
        for index in [i for i, (p, _) in self.fenced_for.items() if p == peer]:
            del self.fenced_for[index]
            n -= 1
        assert n == 0
        self._collect()

    @rule(data=st.data())
    @precondition(lambda self: self.waiting)
    def cancel(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(t)
        t.cancel()
        self._collect()

    @rule()
    @precondition(lambda self: self.recv is not None and self.waiting and not self.recv.pool.usable
                  and not self.recv.registering)
    def give_up_on_waiters(self) -> None:
        assert self.recv is not None
        self.recv.pool.fail_waiters(RegistrationError("every slab is fenced"))
        self._collect()
        assert not self.waiting

    @invariant()
    def consistent(self) -> None:
        recv = self.recv
        if recv is None:
            return
        recv.check()                               # one place each, tables, no waiter left behind
        assert set(recv.slabs) == self.registered, "registrations and slabs differ"
        assert set(self.held) == set(recv.pool._held), (self.held, recv.pool._held)
        assert not set(self.held) & set(recv.fenced), "a fenced slab is lent"
        assert set(recv.fenced) == set(self.fenced_for)
        assert recv.pool.usable <= recv.target
        # liveness, from the model (not the pool's own check): while a slab is free, no
        # borrower waits that may take it (a small one may take any slab; a large one
        # while large borrowers hold fewer than all but one of the slabs in the pool)
        free = recv.pool.usable - len(self.held)
        assert free == recv.pool.free, (free, recv.pool.free)
        cap = large_cap(min(recv.target, recv.pool.usable))
        large_held = sum(self.held.values())
        if free:
            stuck = [t for t in self.waiting if not t.large or large_held < cap]
            assert not stuck, f"{len(stuck)} borrower(s) wait while slab(s) they may take are free"


def test_receive_slabs_under_every_interleaving():
    run_state_machine_as_test(RecvSlabsMachine, settings=settings(
        max_examples=300, stateful_step_count=40, deadline=None))

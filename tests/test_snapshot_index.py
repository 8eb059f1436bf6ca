"""The snapshot store's bookkeeping (:mod:`xavier_async.snapshot_index`), as pure logic:
the seed's admission (device tier first, LRU demotion to the host tier, drop when both are
full, skip when nothing can move), leases that pin blocks, adjacent slots for blocks
published together, and a hypothesis state machine over every order of operations."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from xavier_async.errors import InternalError
from xavier_async.snapshot_index import DEVICE, HOST, SnapshotIndex


def _publish(index: SnapshotIndex, keys):
    plan = index.admit(keys)
    index.commit(plan)
    return plan


def test_new_blocks_go_to_the_device_tier_side_by_side():
    index = SnapshotIndex(4, 4)
    plan = _publish(index, ["a", "b", "c"])
    assert plan.place == {"a": 0, "b": 1, "c": 2} and not plan.demote and not plan.skip
    assert index.used(DEVICE) == 3 and index.used(HOST) == 0


def test_a_full_device_tier_demotes_its_least_recently_used_block():
    index = SnapshotIndex(2, 2)
    _publish(index, ["a", "b"])
    index.touch("a")                       # b is now the least recently used
    plan = _publish(index, ["c"])
    assert [(m.key, m.src) for m in plan.demote] == [("b", 1)] and plan.place == {"c": 1}
    assert index.tier_of(index.slot("b")) == HOST and index.slot("c") == 1


def test_a_full_store_drops_the_victim_and_skips_when_nothing_can_move():
    index = SnapshotIndex(1, 1)
    _publish(index, ["a"])
    _publish(index, ["b"])                 # a demoted to the host tier
    plan = _publish(index, ["c"])          # host full: b is dropped, c takes its slot
    assert plan.drop == ["b"] and plan.place == {"c": 0} and "b" not in index
    index.lease([index.slot("c")])         # c is being served: it cannot move
    index.lease([index.slot("a")])
    plan = _publish(index, ["d"])
    assert plan.skip == ["d"] and not plan.place and index.skipped == 1
    assert index.stats()["evicted"] == 1


def test_leased_blocks_are_never_moved_and_release_is_counted():
    index = SnapshotIndex(2, 0)
    _publish(index, ["a", "b"])
    index.lease([0])
    plan = _publish(index, ["c"])          # a is leased: b (slot 1) is the victim
    assert plan.drop == ["b"] and plan.place == {"c": 1}
    index.release([0])
    with pytest.raises(InternalError):
        index.release([0])


def test_an_aborted_plan_frees_its_slots_and_loses_its_victims():
    index = SnapshotIndex(1, 1)
    _publish(index, ["a"])
    plan = index.admit(["b"])              # would demote a
    index.abort(plan)
    assert "a" not in index and "b" not in index
    assert index.used(DEVICE) == index.used(HOST) == 0
    index.check()
    assert _publish(index, ["c"]).place == {"c": 0}


def test_a_republished_key_moves_to_its_new_slot():
    index = SnapshotIndex(4, 0)
    _publish(index, ["a"])
    plan = index.admit(["a"])
    assert index.commit(plan) == ["a"] and index.slot("a") == plan.place["a"]
    index.check()


def test_a_huge_tier_of_small_blocks_costs_nothing_until_used():
    index = SnapshotIndex(50_000_000, 50_000_000)
    _publish(index, list(range(3)))
    assert index.slot(2) == 2 and len(index) == 3
    index.check()


class IndexMachine(RuleBasedStateMachine):
    """Admit, touch, lease, release, remove, abort in any order; the index must stay
    consistent, leased blocks must never move, and every admitted key is where the plan
    put it."""

    @initialize(device=st.integers(0, 4), host=st.integers(0, 4))
    def start(self, device: int, host: int) -> None:
        self.index = SnapshotIndex(device, host)
        self.leases: list[tuple[int, ...]] = []
        self.next_key = 0

    @rule(n=st.integers(1, 4), commit=st.booleans())
    def publish(self, n: int, commit: bool) -> None:
        index = self.index
        pinned = {index._key_of[s]: s for lease in self.leases for s in lease if s in index._key_of}
        keys = list(range(self.next_key, self.next_key + n))
        self.next_key += n
        plan = index.admit(keys)
        moved = {m.key for m in plan.demote} | set(plan.drop)
        assert not moved & set(pinned), "a leased block was chosen to move"
        assert set(plan.place) | set(plan.skip) == set(keys)
        if commit:
            index.commit(plan)
            for key, slot in plan.place.items():
                assert index.slot(key) == slot
            for m in plan.demote:
                assert index.slot(m.key) == m.dst and index.tier_of(m.dst) == HOST
        else:
            index.abort(plan)
        for key, slot in pinned.items():
            assert index.slot(key) == slot

    @rule(data=st.data())
    @precondition(lambda self: len(self.index) > 0)
    def touch_or_lease(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.index.keys()))
        self.index.touch(key)
        if data.draw(st.booleans()):
            lease = (self.index.slot(key),)
            self.index.lease(lease)
            self.leases.append(lease)

    @rule(data=st.data())
    @precondition(lambda self: self.leases)
    def release(self, data: st.DataObject) -> None:
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.index.release(lease)

    @rule(data=st.data())
    @precondition(lambda self: len(self.index) > 0)
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.index.keys()))
        assert self.index.remove(key) and key not in self.index

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "index"):
            self.index.check()
            total = self.index.device_slots + self.index.host_slots
            assert len(self.index) <= total


def test_the_index_under_every_order_of_operations():
    run_state_machine_as_test(IndexMachine, settings=settings(max_examples=300,
                                                              stateful_step_count=40,
                                                              deadline=None))

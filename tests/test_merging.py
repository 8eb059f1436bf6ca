"""Merging batches that wait for a slab (xavier_async.merging): pure, no event loop.

The receiver lays the members out at aligned bases and sends their wire forms back to
back; the source rebuilds the segments from that wire alone. Hypothesis checks that both
ends agree on every offset, for any layout and any members, and that leaving a group
lays the others out again without a gap.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xavier_async.layout import SEGMENT_ALIGN, CacheLayout
from xavier_async.merging import LoadGroup, Member, MergedBatch, own_copy, Moved
from xavier_async.planning import Planner, segments_from_wire
from xavier_async.errors import PeerLostError


def _layout(data) -> CacheLayout:
    nlayers = data.draw(st.integers(1, 4), label="layers")
    return CacheLayout.of({i: torch.zeros((32, *data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=2))),
                                          dtype=data.draw(st.sampled_from([torch.uint8, torch.float16,
                                                                           torch.float32])))
                           for i in range(nlayers)})


def _batch(data, planner: Planner, layout: CacheLayout, i: int):
    layers = data.draw(st.lists(st.sampled_from(list(layout.layers)), unique=True, min_size=1), label=f"layers{i}")
    keys = data.draw(st.lists(st.integers(0, 31), unique=True, min_size=1, max_size=4), label=f"keys{i}")
    slots = data.draw(st.lists(st.integers(0, 31), unique=True, min_size=len(keys), max_size=len(keys)))
    return planner.plan({1: {layer: dict(zip(keys, slots)) for layer in layers}})[0]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_source_rebuilds_every_members_segments_at_its_base(data):
    layout = _layout(data)
    full = 1 << 16
    planner = Planner(layout, full)
    limit = data.draw(st.integers(64, full), label="limit")
    group = LoadGroup(1, False, limit)
    members = []
    for i in range(data.draw(st.integers(1, 6), label="members")):
        batch = _batch(data, planner, layout, i)
        if group.fits(batch):
            members.append(group.add(batch))
        else:  # a batch that does not fit is refused, and the group is unchanged
            before = group.nbytes
            with pytest.raises(ValueError):
                group.add(batch)
            assert group.nbytes == before
    if not members:
        return
    merged = group.merged()
    assert merged.nbytes == group.nbytes <= limit
    segments, end = segments_from_wire(merged.wire(), layout)
    assert end == merged.nbytes
    expected = [seg._replace(offset=seg.offset + m.base) for m in members for seg in m.batch.segments]
    assert [(s.layer, s.keys, s.offset, s.block_nbytes) for s in segments] == \
        [(s.layer, s.keys, s.offset, s.block_nbytes) for s in expected]
    for m in members:
        assert m.base % SEGMENT_ALIGN == 0
    # members never overlap in the slab
    spans = sorted((m.base, m.base + m.batch.nbytes) for m in members)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert merged.useful_bytes == sum(m.batch.useful_bytes for m in members)
    assert merged.blocks == sum(m.batch.blocks for m in members)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_member_that_leaves_takes_its_bytes_with_it(data):
    layout = _layout(data)
    planner = Planner(layout, 1 << 16)
    group = LoadGroup(1, False, 1 << 16)
    members = [group.add(_batch(data, planner, layout, i)) for i in range(data.draw(st.integers(2, 5)))]
    gone = data.draw(st.sampled_from(members))
    group.remove(gone)
    rest = [m for m in members if m is not gone]
    fresh = LoadGroup(1, False, 1 << 16)
    for m in rest:
        fresh.add(m.batch)
    assert [m.base for m in rest] == [m.base for m in fresh.members]   # laid out again, no gap
    assert group.nbytes == fresh.nbytes
    segments, end = segments_from_wire(group.merged().wire(), layout)
    assert end == group.nbytes


def test_cancelled_members_are_not_unpacked_and_a_started_group_keeps_its_members():
    layout = CacheLayout.of({0: torch.zeros(8, 4)})
    planner = Planner(layout, 1024)
    group = LoadGroup(1, False, 1024)
    a, b = (group.add(planner.plan({1: {0: {k: k}}})[0]) for k in (1, 2))
    b.cancelled = True
    merged = group.merged()
    assert [base for base, _ in merged.parts()] == [a.base]                # b: copied, not unpacked
    assert [s.offset for s in merged.segments] == [a.base + s.offset for s in a.batch.segments]
    assert len(merged.wire()) == 2                                          # both still requested
    group.started = True
    with pytest.raises(ValueError):
        group.remove(a)
    assert not group.fits(a.batch)


def test_shares_and_failures_reach_every_member_once():
    layout = CacheLayout.of({0: torch.zeros(8, 4)})
    planner = Planner(layout, 1024)
    group = LoadGroup(1, False, 1024)
    small, big = group.add(planner.plan({1: {0: {1: 1}}})[0]), group.add(planner.plan({1: {0: {2: 2, 3: 3, 4: 4}}})[0])
    group.share(Moved(1024))
    assert (small.wire_bytes, big.wire_bytes) == (256, 768) and small.settled and big.settled
    group.fail(PeerLostError("late"))                                       # already settled: kept
    assert small.error is None and big.error is None
    other = LoadGroup(1, False, 1024)
    x, y = (other.add(planner.plan({1: {0: {k: k}}})[0]) for k in (1, 2))
    err = PeerLostError("rank 1 lost")
    err.add_note("from the group")
    other.fail(err)
    assert type(x.error) is PeerLostError and str(x.error) == "rank 1 lost"
    assert x.error is not y.error and x.error is not err                    # each its own
    x.error.add_note("only x's")
    assert y.error.__notes__ == ["from the group"] == err.__notes__
    assert own_copy(err) is not err


def test_a_merged_batch_of_one_is_that_batch():
    layout = CacheLayout.of({0: torch.zeros(8, 4), 1: torch.zeros(8, 2)})
    (batch,) = Planner(layout, 1024).plan({1: {0: {5: 3}, 1: {5: 3}}})
    one = MergedBatch(1, [Member(batch, 0)], batch.nbytes)
    assert one.wire() == batch.wire() and one.segments == batch.segments
    assert one.parts() == [(0, batch)]

"""gather/scatter against a block-by-block reference: consecutive runs, scattered slots,
fan-out, mixed block sizes (unaligned segment offsets), on both the memmove and the tensor
paths. Bytes are compared as raw bytes, so NaN payloads count."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xavier_async import packing
from xavier_async.layout import CacheLayout
from xavier_async.planning import normalize, plan_batches


def _caches(shapes: dict[int, tuple[int, ...]], dtype: torch.dtype, fill: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer, shape in shapes.items():
        nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8) if fill else \
            torch.zeros(nbytes, dtype=torch.uint8)
        out[layer] = raw.view(dtype).view(shape)
    return out


SHAPES = {0: (32, 2, 8, 4), 1: (32, 3, 5), 2: (32, 2, 8, 4)}  # layer 1 has an odd block size


@pytest.fixture(params=[True, False], ids=["memmove", "tensor"])
def path(request, monkeypatch):
    monkeypatch.setattr(packing, "HOST_MEMMOVE", request.param)
    return request.param


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(0, 31), st.integers(0, 31),
                                st.integers(0, 2)), min_size=1, max_size=40))
@pytest.mark.parametrize("memmove", [True, False])
def test_gather_scatter_match_blockwise_reference(picks, memmove):
    packing.HOST_MEMMOVE = memmove
    try:
        src = _caches(SHAPES, torch.bfloat16, True, seed=1)
        dst = _caches(SHAPES, torch.bfloat16, False)
        before = {k: v.clone() for k, v in dst.items()}
        layout = CacheLayout.of(dst)
        request: dict = {}
        used: set = set()
        for layer, key, slot, extra in picks:
            slots = [s for s in range(slot, min(32, slot + 1 + extra)) if (layer, s) not in used]
            if not slots or key in request.get(layer, {}):
                continue
            used.update((layer, s) for s in slots)
            request.setdefault(layer, {})[key] = slots if len(slots) > 1 else slots[0]
        plan = normalize({5: request}, layout)[5]
        full = 4096
        send = torch.zeros(full, dtype=torch.uint8)
        recv = torch.zeros(full, dtype=torch.uint8)
        sizes = [s.block_nbytes for s in layout.layers.values()]
        for batch in plan_batches(plan, layout, full):
            assert batch.nbytes <= full
            packing.gather(packing.SlabRows(send, sizes), batch.segments,
                           [list(seg.keys) for seg in batch.segments], packing.byte_rows(src))
            recv.copy_(send)
            packing.scatter(packing.SlabRows(recv, sizes), batch.segments, packing.byte_rows(dst))
        want = {k: v.clone() for k, v in before.items()}
        for layer, blocks in plan.items():
            for key, slots in blocks.items():
                for s in slots:
                    want[layer][s] = src[layer][key]
        for layer in dst:
            assert torch.equal(dst[layer].view(torch.uint8), want[layer].view(torch.uint8)), layer
    finally:
        packing.HOST_MEMMOVE = True


def test_runs_groups_consecutive_slots():
    assert packing.runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert packing.runs([]) == []
    assert packing.runs([3, 3]) == [(0, 3, 1), (1, 3, 1)]


def test_many_scattered_slots_use_long_indices(path):
    """More runs than MAX_RUNS go through index ops; an index list is always torch.long."""
    src = _caches({0: (64, 16)}, torch.float16, True)
    dst = _caches({0: (64, 16)}, torch.float16, False)
    layout = CacheLayout.of(dst)
    slots = list(range(0, 64, 3))[: packing.MAX_RUNS * 3]
    plan = normalize({1: {0: {k: s for k, s in zip(range(len(slots)), slots)}}}, layout)[1]
    (batch,) = plan_batches(plan, layout, 1 << 16)
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    packing.gather(packing.SlabRows(buf, [32]), batch.segments, [list(range(len(slots)))],
                   packing.byte_rows(src))
    packing.scatter(packing.SlabRows(buf, [32]), batch.segments, packing.byte_rows(dst))
    for k, s in enumerate(slots):
        assert torch.equal(dst[0][s].view(torch.uint8), src[0][k].view(torch.uint8))

"""gather/scatter against a block-by-block reference: consecutive runs, scattered slots,
fan-out, mixed block sizes (unaligned segment offsets), on both the memmove and the tensor
paths. Bytes are compared as raw bytes, so NaN payloads count."""

from __future__ import annotations

import sys

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


def request_from(picks) -> dict:
    """A ``{layer: {key: slot or [slots]}}`` request from hypothesis' ``(layer, key, slot,
    extra)`` picks: a key may fan out to up to ``extra`` more consecutive slots; no slot is
    targeted twice and no key is repeated in a layer."""
    request: dict = {}
    used: set = set()
    for layer, key, slot, extra in picks:
        slots = [s for s in range(slot, min(32, slot + 1 + extra)) if (layer, s) not in used]
        if not slots or key in request.get(layer, {}):
            continue
        used.update((layer, s) for s in slots)
        request.setdefault(layer, {})[key] = slots if len(slots) > 1 else slots[0]
    return request


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
        request = request_from(picks)
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


# -- run tables: pack/unpack in one pass (any scatter), planner batches -------------------------

from xavier_async.planning import Planner  # noqa: E402


def _run_tables_roundtrip(src, dst, request, full=4096, device_runs=None, prepared=False):
    """Plan ``request`` with the cached planner, pack each batch from ``src`` with source
    slots = keys, copy the slab, unpack into ``dst``; returns the planned batches.
    ``prepared``: the unpack's run table is made before the slab's bytes arrive (as a
    receiver does while its request is out)."""
    layout = CacheLayout.of(dst)
    sizes = [s.block_nbytes for s in layout.layers.values()]
    send = torch.zeros(full, dtype=torch.uint8)
    recv = torch.zeros(full, dtype=torch.uint8)
    src_t, dst_t = packing.CacheTable(packing.byte_rows(src)), packing.CacheTable(packing.byte_rows(dst))
    batches = Planner(layout, full).plan(request)
    rows = packing.SlabRows(recv, sizes)
    for b in batches:
        table = packing.unpack_runs(rows, b, dst_t, device_runs) if prepared else None
        if prepared:
            assert table is not None  # memmove runs (or the fused kernel's): a table exists
        packing.pack(packing.SlabRows(send, sizes), b.segments, [list(s.keys) for s in b.segments],
                     src_t, device_runs)
        recv.copy_(send)
        packing.unpack(rows, b, dst_t, device_runs, table=table)
    return batches


def _expected(before, src, request):
    want = {k: v.clone() for k, v in before.items()}
    for layers in request.values():
        for layer, blocks in layers.items():
            for key, slots in blocks.items():
                for s in (slots if isinstance(slots, list) else [slots]):
                    want[layer][s] = src[layer][key]
    return want


def _assert_bytes(dst, want):
    for layer in dst:
        assert torch.equal(dst[layer].view(torch.uint8), want[layer].view(torch.uint8)), layer


@settings(max_examples=60, deadline=None)
@given(picks=st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(0, 31), st.integers(0, 31),
                                st.integers(0, 2)), min_size=1, max_size=40),
       uniform=st.booleans(), full=st.sampled_from([512, 4096]), prepared=st.booleans())
def test_run_tables_match_blockwise_reference(picks, uniform, full, prepared):
    """Scattered, consecutive, fan-out and uniform requests, split across batches: the run
    tables move exactly the block-by-block reference's bytes (BF16 as bytes), whether the
    unpack makes its table or is handed one made before the bytes arrived."""
    src = _caches(SHAPES, torch.bfloat16, True, seed=1)
    dst = _caches(SHAPES, torch.bfloat16, False)
    before = {k: v.clone() for k, v in dst.items()}
    request = request_from(picks)
    if uniform:  # the same single-slot blocks in every layer: the cached, shape-planned path
        first = {k: (s if isinstance(s, int) else s[0]) for k, s in next(iter(request.values())).items()}
        request = {layer: dict(first) for layer in SHAPES}
    batches = _run_tables_roundtrip(src, dst, {5: request}, full, prepared=prepared)
    if uniform:
        assert all(b.shape is not None for b in batches)
    _assert_bytes(dst, _expected(before, src, {5: request}))


def test_no_run_table_where_the_unpack_scatters(monkeypatch):
    """Without memmove runs on the CPU the unpack scatters with index ops: no table to
    make ahead (the receiver's unpack then scatters as before)."""
    monkeypatch.setattr(packing, "HOST_MEMMOVE", False)
    dst = _caches(SHAPES, torch.bfloat16, False)
    layout = CacheLayout.of(dst)
    recv = packing.SlabRows(torch.zeros(4096, dtype=torch.uint8),
                            [s.block_nbytes for s in layout.layers.values()])
    batch = Planner(layout, 4096).plan({5: {0: {3: 7}}})[0]
    assert packing.unpack_runs(recv, batch, packing.CacheTable(packing.byte_rows(dst))) is None


def test_scattered_slots_are_memmoved_not_indexed(monkeypatch):
    """64 keys to every other slot (64 runs a layer): no index op, no tensor path, and the
    bytes equal the block-by-block reference."""
    def boom(*a, **k):
        raise AssertionError("tensor/index path used")
    monkeypatch.setattr(packing, "gather", boom)
    monkeypatch.setattr(packing, "scatter", boom)
    monkeypatch.setattr(torch.Tensor, "index_copy_", boom)
    monkeypatch.setattr(torch, "index_select", boom)
    shapes = {0: (160, 2, 8, 4), 1: (160, 2, 8, 4)}
    src = _caches(shapes, torch.bfloat16, True, seed=3)
    dst = _caches(shapes, torch.bfloat16, False)
    before = {k: v.clone() for k, v in dst.items()}
    scattered = {k: 2 * k + 1 for k in range(64)}       # keys 0..63 -> slots 1, 3, 5, ...
    request = {7: {0: dict(scattered), 1: {k: 150 - 2 * k for k in range(64)}}}  # and descending
    (batch,) = _run_tables_roundtrip(src, dst, request, full=1 << 16)
    table = packing.unpack_table(0, batch, packing.CacheTable(packing.byte_rows(dst)))
    assert len(table[0]) == 128                         # one run per block: all scattered
    _assert_bytes(dst, _expected(before, src, request))


def test_many_runs_in_every_layer_build_the_same_table_vectorized(monkeypatch):
    """The same 48 scattered slots in every layer (different block sizes): the numpy-built
    table equals the loop-built one, and the bytes equal the block-by-block reference."""
    shapes = {0: (200, 2, 8, 4), 1: (200, 3, 5), 2: (200, 64)}
    src = _caches(shapes, torch.bfloat16, True, seed=4)
    dst = _caches(shapes, torch.bfloat16, False)
    before = {k: v.clone() for k, v in dst.items()}
    blocks = {k: (k * 37) % 199 for k in range(48)}
    request = {7: {layer: dict(blocks) for layer in shapes}}
    (batch,) = _run_tables_roundtrip(src, dst, request, full=1 << 16)
    assert batch.shape is not None
    table = packing.CacheTable(packing.byte_rows(dst))
    vectorized = packing.unpack_table(4096, batch, table)
    monkeypatch.setattr(packing, "_VECTOR_RUNS", 10**9)
    assert packing.unpack_table(4096, batch, table) == vectorized
    assert len(vectorized[0]) == 3 * 48                 # one run per block: all scattered
    _assert_bytes(dst, _expected(before, src, request))


def test_consecutive_slots_become_one_run_per_layer():
    shapes = {i: (96, 64) for i in range(4)}
    dst = _caches(shapes, torch.uint8, False)
    layout = CacheLayout.of(dst)
    (batch,) = Planner(layout, 1 << 16).plan({1: {i: {k: 10 + k for k in range(32)} for i in range(4)}})
    dst_t, src_t = packing.CacheTable(packing.byte_rows(dst)), packing.CacheTable(packing.byte_rows(dst))
    dsts, srcs, ns = packing.unpack_table(1000, batch, dst_t)
    assert ns == [32 * 64] * 4
    assert [d - dst_t.base[i] for d, i in zip(dsts, range(4))] == [10 * 64] * 4
    dsts, srcs, ns = packing.pack_table(1000, batch.segments, [list(range(32))] * 4, src_t)
    assert ns == [32 * 64] * 4 and dsts == [1000 + s.offset for s in batch.segments]


def test_all_bf16_patterns_survive_pack_and_unpack():
    from xavier_async.testing.peer_process import all_bf16_patterns
    src = {0: all_bf16_patterns().view(256, 256)}
    dst = {0: torch.zeros(256, 256, dtype=torch.bfloat16)}
    request = {3: {0: {k: 255 - k for k in range(256)}}}  # reversed: 256 runs
    _run_tables_roundtrip(src, dst, request, full=256 * 512)
    assert torch.equal(dst[0].flip(0).view(torch.int16), src[0].view(torch.int16))


TRITON_CHECK = r"""
import os
import torch
from xavier_async import packing
from xavier_async.layout import CacheLayout
from xavier_async.planning import Planner
from xavier_async.testing.peer_process import all_bf16_patterns
g = torch.Generator().manual_seed(5)
dev = torch.device(os.environ.get("XAVIER_KERNEL_DEVICE", "cpu"))
src = {0: all_bf16_patterns().view(256, 256).to(dev), 1: torch.randint(0, 256, (64, 7), generator=g, dtype=torch.uint8).to(dev)}
dst = {0: torch.zeros(256, 256, dtype=torch.bfloat16, device=dev), 1: torch.zeros(64, 7, dtype=torch.uint8, device=dev)}
runs = packing.DeviceRuns(dev)
runs.CHUNK = 96                                   # long runs: several programs each
layout = CacheLayout.of(dst)
req = {3: {0: {k: 255 - k for k in range(40)} | {k: k for k in range(100, 140)}, 1: {k: [k + 1, 63 - k] for k in range(20)}}}
send, recv = torch.zeros(1 << 16, dtype=torch.uint8, device=dev), torch.zeros(1 << 16, dtype=torch.uint8, device=dev)
st, dt = packing.CacheTable(packing.byte_rows(src)), packing.CacheTable(packing.byte_rows(dst))
sizes = [512, 7]
wide = {3: {0: {k: 255 - k for k in range(40, 60)}}}  # aligned rows only: 8-byte words
batches = Planner(layout, 1 << 16).plan(wide) + Planner(layout, 1 << 16).plan(req)
# long runs as a [runs, chunks] grid, then cut into chunks on the host
for idle in (10**9, 0):
    runs.MAX_IDLE = idle
    for t in dst.values():
        t.zero_()
    for b in batches * 4:  # more launches than pinned table buffers: they are reused
        ev = packing.pack(packing.SlabRows(send, sizes), b.segments, [list(s.keys) for s in b.segments], st, runs)
        if ev is not None:
            ev.synchronize()
        recv.copy_(send)
        packing.unpack(packing.SlabRows(recv, sizes), b, dt, runs)
    for k in range(60):
        assert torch.equal(dst[0][255 - k].view(torch.int16), src[0][k].view(torch.int16)), (idle, k)
    for k in range(100, 140):
        assert torch.equal(dst[0][k].view(torch.int16), src[0][k].view(torch.int16)), (idle, k)
    for k in range(20):
        assert torch.equal(dst[1][k + 1], src[1][k]) and torch.equal(dst[1][63 - k], src[1][k]), (idle, k)
    untouched = set(range(60, 100)) | set(range(140, 196))
    assert all(not dst[0][s].view(torch.int16).any() for s in untouched), idle
print("ok")
"""


def test_fused_kernel_under_the_triton_interpreter():
    """The CUDA pack/unpack kernel, run by Triton's CPU interpreter on host memory: all
    65,536 BF16 patterns, scattered and reversed slots, fan-out, an odd block size (the
    byte-wise variant) and long runs, as a grid of chunks and cut into chunks on the host.
    Skipped only where Triton is not installed (the test extra brings it on Linux); any
    failure of the kernel under the interpreter fails the test (Triton 3.9 runs it)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_fused_kernel_on_cuda():
    """The same check compiled for and run on a GPU (skipped without CUDA)."""
    torch_cuda = pytest.importorskip("torch").cuda
    pytest.importorskip("triton")
    if not torch_cuda.is_available():
        pytest.skip("no CUDA device")
    import os
    import subprocess
    env = {**os.environ, "XAVIER_KERNEL_DEVICE": "cuda"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")

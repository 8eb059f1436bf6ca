"""Host run tables copied in one system call on copy threads (xavier_async.hostcopy):
the bytes, the choice between the kernel and memmove, and the fallback when the call is
refused. Every copy is checked byte for byte, and so are the bytes that must stay."""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno

import pytest
import torch

from xavier_async import hostcopy
from xavier_async.copythreads import CopyThreads
from xavier_async.hostcopy import copy_runs, mark_copy_thread


def _table(runs: int, run: int, gap: int):
    """``runs`` runs of ``run`` bytes with ``gap`` bytes between them, in a patterned
    source and a zeroed destination, scattered in reverse order."""
    stride = run + gap
    src = (torch.arange(runs * stride, dtype=torch.int64) * 7 + 3).remainder(251).to(torch.uint8)
    dst = torch.zeros_like(src)
    order = list(reversed(range(runs)))
    table = ([dst.data_ptr() + i * stride for i in order], [src.data_ptr() + i * stride for i in order],
             [run] * runs)
    return src, dst, table


def _check(src: torch.Tensor, dst: torch.Tensor, runs: int, run: int, gap: int) -> None:
    stride = run + gap
    for i in range(runs):
        assert torch.equal(dst[i * stride:i * stride + run], src[i * stride:i * stride + run]), i
        assert not dst[i * stride + run:(i + 1) * stride].any(), f"gap after run {i} written"


def _on_copy_thread(fn):
    with concurrent.futures.ThreadPoolExecutor(1, initializer=mark_copy_thread) as pool:
        return pool.submit(fn).result()


@pytest.mark.skipif(not hostcopy.ENABLED, reason="process_vm_readv is not available here")
@pytest.mark.parametrize(("runs", "run"), [(16, 4096), (1536, 8192), (2500, 256)])
def test_a_copy_thread_copies_many_small_runs_in_system_calls(runs, run):
    src, dst, table = _table(runs, run, 64)
    before = hostcopy.stats["syscall_tables"]
    _on_copy_thread(lambda: copy_runs(*table))
    assert hostcopy.stats["syscall_tables"] == before + 1     # 2500 runs: 3 calls, one table
    _check(src, dst, runs, run, 64)


@pytest.mark.parametrize(("runs", "run", "thread"), [
    (1536, 8192, False),      # the event loop's thread: memmove
    (15, 8192, True),         # too few runs
    (24, 512 * 1024, True),   # runs too large on average
])
def test_memmove_elsewhere(runs, run, thread):
    src, dst, table = _table(runs, run, 64)
    before = hostcopy.stats["syscall_tables"]
    if thread:
        _on_copy_thread(lambda: copy_runs(*table))
    else:
        copy_runs(*table)
    assert hostcopy.stats["syscall_tables"] == before
    _check(src, dst, runs, run, 64)


def test_a_refused_call_falls_back_to_memmove_and_is_not_tried_again(monkeypatch):
    calls = []

    def refused(*args):
        calls.append(args)
        ctypes.set_errno(errno.EPERM)   # as a seccomp filter answers, before any byte moves
        return -1

    monkeypatch.setattr(hostcopy, "_readv", refused)
    monkeypatch.setattr(hostcopy, "ENABLED", True)
    fallbacks = hostcopy.stats["fallbacks"]
    for _ in range(2):
        src, dst, table = _table(64, 4096, 64)
        _on_copy_thread(lambda t=table: copy_runs(*t))
        _check(src, dst, 64, 4096, 64)
    assert len(calls) == 1 and not hostcopy.ENABLED and hostcopy.stats["fallbacks"] == fallbacks + 1


def test_a_short_copy_is_finished_with_memmove(monkeypatch):
    """The kernel copied part of a batch (or none of it) and said so: every run of the
    batch and of the rest is copied again with memmove, and the path stays on."""
    real = hostcopy._readv
    if real is None:
        pytest.skip("process_vm_readv is not available here")

    def short(pid, local, k, remote, k2, flags):
        return real(pid, local, k // 2, remote, k2 // 2, flags)   # half of the runs

    monkeypatch.setattr(hostcopy, "_readv", short)
    src, dst, table = _table(2100, 1024, 64)
    _on_copy_thread(lambda: copy_runs(*table))
    _check(src, dst, 2100, 1024, 64)
    assert hostcopy.ENABLED


@pytest.mark.anyio
@pytest.mark.skipif(not hostcopy.ENABLED, reason="process_vm_readv is not available here")
async def test_the_endpoints_copy_threads_batch():
    threads = CopyThreads(1, 1)
    src, dst, table = _table(256, 4096, 64)
    before = hostcopy.stats["syscall_tables"]
    try:
        await threads.run(copy_runs, *table)
    finally:
        threads.close()
    assert hostcopy.stats["syscall_tables"] == before + 1
    _check(src, dst, 256, 4096, 64)


from hypothesis import given, settings, strategies as st  # noqa: E402

from xavier_async.hostcopy import split_runs  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3), st.integers(0, 3)), max_size=8),
       st.integers(-1, 6))
def test_a_table_cut_into_parts_writes_each_byte_from_the_same_source(runs, parts) -> None:
    """split_runs: at most ``parts`` tables, no empty run, about equal bytes (within one),
    and together they write every destination byte from the same source byte as the whole."""
    dst, src, ns, d, s = [], [], [], 0, 10_000
    for n, dgap, sgap in runs:
        dst.append(d)
        src.append(s)
        ns.append(n)
        d, s = d + n + dgap, s + n + sgap

    def bytes_of(table) -> dict[int, int]:
        out: dict[int, int] = {}
        for a, b, n in zip(*table):
            for i in range(n):
                assert a + i not in out
                out[a + i] = b + i
        return out

    pieces = split_runs(dst, src, ns, parts)
    assert 1 <= len(pieces) <= max(1, parts)
    whole: dict[int, int] = {}
    for piece in pieces:
        whole.update(bytes_of(piece))
    assert whole == bytes_of((dst, src, ns))
    if parts > 1 and sum(ns):
        assert all(all(p[2]) for p in pieces)
        sizes = [sum(p[2]) for p in pieces]
        assert max(sizes) - min(sizes) <= 1
        assert len(pieces) == min(parts, sum(ns))

"""Bad inputs of issue 9 (item 4): each gets a library error that names the problem before
any byte moves, and the endpoint keeps working afterwards."""

from __future__ import annotations

import os

import pytest
import torch

from xavier_async import (Endpoint, EndpointClosedError, EndpointConfig, InvalidRequestError,
                          LayoutMismatchError, LocalFabric, RemoteError)

from .conftest import (SMALL_CFG, assert_caches_unchanged, assert_same_bytes, cluster, counting,
                       random_cache, snapshot, zero_cache)

pytestmark = pytest.mark.asyncio  # real NIXL processes in some tests: asyncio (pytest-asyncio)


def _pair():
    src = {0: random_cache(64, (256,), torch.float32, 1)}    # 1 KiB blocks
    dst = {0: zero_cache(64, (256,), torch.float32)}
    return src, dst


async def test_load_of_none_or_a_number_is_refused_and_the_endpoint_keeps_working():
    src, dst = _pair()
    async with cluster([dst, src]) as (a, b):
        b.publish("k", 1)
        for bad in (None, 42, "x", [None], {1: 42}, {1: {0: 42}}):
            with pytest.raises(InvalidRequestError):
                await a.load(bad)  # type: ignore[arg-type]
        await a.load({1: {0: {"k": 2}}})
    assert_same_bytes(dst[0][2], src[0][1])


async def test_one_transport_for_two_endpoints_is_refused():
    fabric = LocalFabric()
    t = fabric.transport()
    Endpoint(0, _pair()[1], t, SMALL_CFG)
    with pytest.raises(InvalidRequestError, match="already serves another endpoint"):
        Endpoint(1, _pair()[1], t, SMALL_CFG)


def test_one_nixl_transport_for_two_endpoints_is_refused():
    pytest.importorskip("nixl")
    from xavier_async.testing import FaultyTransport
    from xavier_async.transports.nixl import NixlTransport
    t = NixlTransport()
    Endpoint(0, _pair()[1], FaultyTransport(t), SMALL_CFG)
    with pytest.raises(InvalidRequestError, match="already serves"):
        Endpoint(1, _pair()[1], t, SMALL_CFG)                # the wrapped one is taken too


@pytest.mark.parametrize("value", ["no", 1, None])
def test_non_bool_flags_are_refused(value):
    for flag in ("trimmed", "verify", "stream_ordered_unpack"):
        with pytest.raises(InvalidRequestError, match=flag):
            EndpointConfig(**{flag: value})


async def test_publish_after_close_is_refused():
    src, dst = _pair()
    async with cluster([dst, src]) as (a, b):
        pass
    with pytest.raises(EndpointClosedError):
        b.publish("k", 1)


async def test_a_peer_with_no_layer_in_common_is_refused_at_connect():
    fabric = LocalFabric()
    a = Endpoint(0, {"k": zero_cache(8, (256,), torch.float32)}, fabric.transport(), SMALL_CFG)
    b = Endpoint(1, {"v": zero_cache(8, (256,), torch.float32)}, fabric.transport(), SMALL_CFG)
    async with a, b:
        with pytest.raises(LayoutMismatchError, match="no layer id in common"):
            await a.connect(b.address)
        assert a.peers == () and b.peers == ()


async def test_a_multi_batch_load_refused_by_its_source_writes_nothing():
    """16 KiB slab, 1 KiB blocks: 20 keys take two batches; the source knows only the first
    ten. The source is asked about every key first, so nothing is written."""
    src, dst = _pair()
    before = snapshot(dst)
    async with cluster([dst, src], wrap={1: counting()}) as (a, b):
        for s in range(10):
            b.publish(s, s)
        req = {1: {0: {k: 20 + k for k in range(20)}}}
        with pytest.raises(RemoteError, match="not published"):
            await a.load(req)
        assert b.transport.writes == 0                         # not one byte moved
        assert_caches_unchanged(dst, before)
        for s in range(10, 20):
            b.publish(s, s)
        res = await a.load(req)                                # and it works once published
        assert res.batches == 2 and b.transport.writes == 2
    for k in range(20):
        assert_same_bytes(dst[0][20 + k], src[0][k])


async def test_a_key_unpublished_between_batches_is_reported_with_what_was_written():
    """The probe passed, then the source unpublished a key of the second batch: the error
    says (and carries) what the first batch already wrote."""
    src, dst = _pair()
    async with cluster([dst, src]) as (a, b):
        for s in range(20):
            b.publish(s, s)
        real = a._receiver.scheduler.load
        calls = 0

        async def unpublish_after_first(src_rank, batch):
            nonlocal calls
            calls += 1
            if calls == 2:
                b.unpublish(17)
            return await real(src_rank, batch)

        a._receiver.scheduler.load = unpublish_after_first  # type: ignore[method-assign]
        with pytest.raises(RemoteError) as info:
            await a.load({1: {0: {k: 20 + k for k in range(20)}}})
        partial = info.value.partial                           # type: ignore[attr-defined]
        assert partial.batches == 1 and partial.blocks > 0
        assert any("already written" in n for n in info.value.__notes__)
        for k in range(partial.blocks):                        # exactly those slots hold data
            assert_same_bytes(dst[0][20 + k], src[0][k])
        written = set(range(20, 20 + partial.blocks))
        others = [s for s in range(64) if s not in written and dst[0][s].any()]
        assert others == [], f"slots {others} hold data that the partial result does not count"


async def test_an_endpoint_used_after_fork_says_so():
    src, dst = _pair()
    async with cluster([dst, src]) as (a, b):
        pid = os.fork()
        if pid == 0:  # the child: any use of the parent's endpoint is refused clearly
            try:
                a._rt.check_open()
            except EndpointClosedError as exc:
                os._exit(0 if "forked child" in str(exc) else 2)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        b.publish("k", 1)
        await a.load({1: {0: {"k": 3}}})                       # the parent is unaffected
    assert_same_bytes(dst[0][3], src[0][1])

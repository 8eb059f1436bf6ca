"""Verified delivery (``EndpointConfig(verify=True)``): a batch whose bytes were damaged
on the way is refused with IntegrityError before it is unpacked."""

from __future__ import annotations

import pytest
import torch

from xavier_async import Endpoint, EndpointConfig, IntegrityError, TransferError
from xavier_async.slabs import payload_digest

from .conftest import (assert_caches_unchanged, assert_same_bytes, cluster, faulty, random_cache,
                       snapshot, zero_cache)

pytestmark = pytest.mark.asyncio  # real NIXL processes in some tests: asyncio (pytest-asyncio)

KiB = 1024


def _pair():
    return ({0: random_cache(32, (256,), torch.float32, 1)},
            {0: zero_cache(32, (256,), torch.float32)})


@pytest.mark.parametrize("trimmed", [False, True])
async def test_corrupted_batch_is_refused_and_the_next_one_lands(trimmed):
    src, dst = _pair()
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, verify=True, trimmed=trimmed)
    async with cluster([dst, src], cfg, wrap={1: faulty()}) as (a, b):
        for s in range(32):
            b.publish(s, s)
        before = snapshot(dst)
        b.transport.corrupt_next_writes(1)
        with pytest.raises(IntegrityError, match="failed verification") as info:
            await a.load({1: {0: {3: 4, 5: 6}}})
        assert isinstance(info.value, TransferError)
        assert b.transport.injected.writes_corrupted == 1
        assert_caches_unchanged(dst, before)                  # not unpacked
        await a.load({1: {0: {3: 4, 5: 6}}})                  # the endpoint keeps working
        assert_same_bytes(dst[0][4], src[0][3])
        assert_same_bytes(dst[0][6], src[0][5])


async def test_without_verify_the_same_corruption_goes_unnoticed():
    """Why the option exists: the damaged batch is unpacked silently."""
    src, dst = _pair()
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB)
    async with cluster([dst, src], cfg, wrap={1: faulty()}) as (a, b):
        b.publish(3, 3)
        b.transport.corrupt_next_writes(1)
        await a.load({1: {0: {3: 4}}})
    assert not torch.equal(dst[0][4].view(torch.uint8), src[0][3].view(torch.uint8))


def test_digest_sees_flips_shifts_and_swaps():
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 256, (4096 + 5,), dtype=torch.uint8, generator=g)
    base = payload_digest(buf, buf.numel())
    flipped = buf.clone()
    flipped[4097] ^= 0x10
    swapped = buf.clone()
    swapped[:8], swapped[8:16] = buf[8:16].clone(), buf[:8].clone()
    shifted = torch.roll(buf, 8)
    for other in (flipped, swapped, shifted, torch.zeros_like(buf)):
        assert payload_digest(other, buf.numel()) != base
    assert payload_digest(buf.clone(), buf.numel()) == base
    assert payload_digest(buf, 3) != payload_digest(buf, 4)


async def test_verify_over_nixl_accepts_intact_batches():
    pytest.importorskip("nixl")
    from xavier_async.transports.nixl import NixlTransport
    src, dst = _pair()
    cfg = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB, verify=True)
    async with Endpoint(0, dst, NixlTransport(), cfg) as a, Endpoint(1, src, NixlTransport(), cfg) as b:
        await a.connect(b.address)
        for s in range(32):
            b.publish(s, s)
        res = await a.load({1: {0: {k: 31 - k for k in range(32)}}})   # two batches
        assert res.batches == 2
    for k in range(32):
        assert_same_bytes(dst[0][31 - k], src[0][k])

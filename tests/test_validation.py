"""Bad input gets a clear error before any byte moves (BRIEF section 5)."""

from __future__ import annotations

import pytest
import torch

from xavier_async import (Endpoint, EndpointClosedError, EndpointConfig, HandshakeError,
                          InvalidRequestError, LayoutMismatchError, LocalFabric, LocalTransport,
                          RetryPolicy)

from .conftest import (KiB, SMALL_CFG, assert_caches_unchanged, cluster, counting,
                       random_cache, snapshot, zero_cache)

pytestmark = pytest.mark.anyio  # every test runs on asyncio and on trio


def caches(dtype=torch.float32, shape=(8,), slots=8, seed=0):
    return {0: random_cache(slots, shape, dtype, seed=seed), 1: random_cache(slots, (3,), torch.int8, seed=seed + 1)}


# -- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"full_bytes": 0}, {"full_bytes": -4096}, {"full_bytes": 4096.0}, {"full_bytes": True},
    {"full_bytes": "4096"}, {"full_bytes": 4096, "small_bytes": 8192},
    {"full_bytes": 4096, "small_bytes": 0}, {"full_bytes": 4096, "small_bytes": -1},
    {"full_bytes": 4096, "small_bytes": True}, {"full_bytes": 4096, "small_bytes": 1.5},
    {"streak": 0}, {"streak": -2}, {"streak": 1.0}, {"streak": True},
    {"trim_align": 0}, {"trim_align": -256}, {"trim_align": True}, {"trim_align": 2.5},
    {"request_timeout": 0}, {"request_timeout": -1.0}, {"request_timeout": True},
    {"request_timeout": "1"}, {"retry": 3}, {"retry": None},
])
def test_bad_config_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        EndpointConfig(**kwargs)


def test_config_defaults():
    cfg = EndpointConfig()
    assert cfg.full_bytes == 12 << 20 and cfg.small_bytes == 256 << 10 and cfg.streak == 2
    assert not cfg.trimmed
    assert EndpointConfig(full_bytes=4096).small_bytes == 4096
    assert EndpointConfig(full_bytes=4096, small_bytes=4096).small_bytes == 4096


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"base_delay": -0.1}])
def test_bad_retry_policy_rejected(kwargs):
    with pytest.raises(InvalidRequestError):
        EndpointConfig(retry=RetryPolicy(**kwargs))


# -- endpoint construction -----------------------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    ({0: torch.zeros(4, 8).t()}, "contiguous"),
    ({0: torch.zeros(8, 8)[:, 1:]}, "contiguous"),
    ({0: torch.zeros(4, 8), 1: torch.empty(4, 8, device="meta")}, "one device"),
    ({0: torch.zeros(8)}, "num_slots"),
    ({}, "non-empty"),
    ({0: torch.zeros(0, 8)}, "empty"),
])
def test_bad_caches_rejected(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        Endpoint(0, bad, LocalTransport(), SMALL_CFG)


@pytest.mark.parametrize("rank", [-1, True, "0", 1.0, None])
def test_bad_rank_rejected(rank):
    with pytest.raises(InvalidRequestError):
        Endpoint(rank, caches(), LocalTransport(), SMALL_CFG)


async def test_endpoint_must_be_entered_and_only_once():
    ep = Endpoint(0, caches(), LocalTransport(), SMALL_CFG)
    with pytest.raises(EndpointClosedError, match="not open"):
        await ep.load({1: {0: {"k": 0}}})
    with pytest.raises(EndpointClosedError):
        await ep.connect("local://0")
    async with ep:
        pass
    with pytest.raises(EndpointClosedError):
        async with ep:
            pass


# -- handshake ----------------------------------------------------------------------------

@pytest.mark.parametrize("other", [
    {0: zero_cache(8, (8,), torch.bfloat16)},                       # dtype
    {0: zero_cache(8, (4, 2), torch.float32)},                      # shape
    {0: zero_cache(8, (8,), torch.float32), 1: zero_cache(8, (3,), torch.uint8)},   # 2nd layer
])
async def test_layout_mismatch_at_connect(other):
    mine = caches()
    async with cluster([mine, other], connect=False) as (a, b):
        with pytest.raises(LayoutMismatchError):
            await a.connect(b.address)
        with pytest.raises(LayoutMismatchError):
            await b.connect(a.address)
        assert a.peers == () and b.peers == ()


async def test_layout_only_shared_layers_must_agree():
    async with cluster([caches(), {0: zero_cache(99, (8,), torch.float32), 7: zero_cache(2, (1,), torch.int64)}],
                       connect=False) as (a, b):
        assert await a.connect(b.address) == 1
        assert a.peers == (1,) and b.peers == (0,)


@pytest.mark.parametrize("cfg_b", [
    EndpointConfig(full_bytes=32 * KiB, small_bytes=1 * KiB),
    EndpointConfig(full_bytes=16 * KiB, small_bytes=2 * KiB),
])
async def test_slab_size_mismatch_at_connect(cfg_b):
    async with cluster([caches(), caches()], [SMALL_CFG, cfg_b], connect=False) as (a, b):
        with pytest.raises(HandshakeError, match="slab size mismatch"):
            await a.connect(b.address)
        assert a.peers == () and b.peers == ()


async def test_streak_and_trimming_may_differ_between_peers():
    cfg_b = EndpointConfig(full_bytes=SMALL_CFG.full_bytes, small_bytes=SMALL_CFG.small_bytes,
                           streak=3, trimmed=True)
    src = caches(seed=4)
    dst = {0: zero_cache(8, (8,), torch.float32), 1: zero_cache(8, (3,), torch.int8)}
    async with cluster([dst, src], [SMALL_CFG, cfg_b]) as (a, b):
        b.publish("k", 2)
        res = await a.load({1: {0: {"k": 1}, 1: {"k": 1}}})
        assert res.wire_bytes == 256            # b writes trimmed
    assert torch.equal(dst[0][1], src[0][2]) and torch.equal(dst[1][1], src[1][2])


@pytest.mark.parametrize("address", ["", "local://999", "tcp://nowhere"])
async def test_bad_address(address):
    async with cluster([caches()], connect=False) as (a,):
        with pytest.raises(HandshakeError):
            await a.connect(address)


async def test_same_rank_rejected():
    fabric = LocalFabric()
    async with Endpoint(3, caches(), LocalTransport(fabric), SMALL_CFG) as a, \
            Endpoint(3, caches(), LocalTransport(fabric), SMALL_CFG) as b:
        with pytest.raises(HandshakeError, match="same rank"):
            await a.connect(b.address)


# -- loads: rejected before any byte moves ------------------------------------------------

BAD_LOADS = [
    (None, "must be a mapping"),
    (42, "must be a mapping"),
    ([42], "must be a mapping"),
    ({1: {0: {"k0": -1}}}, "out of range"),
    ({1: {0: {"k0": 8}}}, "out of range"),
    ({1: {0: {"k0": True}}}, "must be an int"),
    ({1: {0: {"k0": 1.0}}}, "must be an int"),
    ({1: {0: {"k0": 0, "k1": 0}}}, "conflicting"),
    ([{1: {0: {"k0": 0}}}, {1: {0: {"k1": [3, 0]}}}], "conflicting"),
    ({1: {5: {"k0": 0}}}, "unknown layer"),
    ({-1: {0: {"k0": 0}}}, "source ranks"),
    ({1: {0: {"k0": 1, "k1": 2}, 1: {"k0": 1, ("t",): 2}}}, "block keys"),
    ("not a request", "must be a mapping"),
]


@pytest.mark.parametrize("request_, match", BAD_LOADS)
async def test_bad_load_rejected_before_any_byte_moves(request_, match):
    src = caches(seed=1)
    dst = caches(seed=2)
    before = snapshot(dst)
    async with cluster([dst, src], wrap={1: counting()}) as (a, b):
        for s in range(8):
            b.publish(f"k{s}", s)
        recv_before = a.recv_slab.tensor.clone()
        with pytest.raises(InvalidRequestError, match=match):
            await a.load(request_)
        assert b.transport.writes == 0 and b.transport.map_calls == 0
        assert b.metrics.peer(0).batches_sent == 0
        assert torch.equal(a.recv_slab.tensor, recv_before)
        assert_caches_unchanged(dst, before)
        # the endpoint is still fine afterwards
        await a.load({1: {0: {"k3": 4}}})
        assert torch.equal(dst[0][4], src[0][3])
        assert b.transport.writes == 1


async def test_loads_from_a_cache_shape_mismatched_block_are_rejected():
    """A block too large for the slab is refused before anything is sent."""
    big = {0: random_cache(2, (8 * KiB,), torch.float32, seed=1)}     # 32 KiB blocks
    async with cluster([{0: zero_cache(2, (8 * KiB,), torch.float32)}, big],
                       wrap={1: counting()}) as (a, b):
        b.publish("k", 0)
        with pytest.raises(InvalidRequestError, match="larger than the full slab"):
            await a.load({1: {0: {"k": 1}}})
        assert b.transport.writes == 0

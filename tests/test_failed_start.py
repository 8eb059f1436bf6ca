"""A failed start is clean: the real error comes out, nothing stays registered or
listening, and the caller's task and other endpoints (in the same task) stay healthy."""

from __future__ import annotations

import pytest
import torch

from xavier_async import (AllocationError, Endpoint, EndpointClosedError, EndpointConfig,
                          InvalidRequestError, ListenError)

from .conftest import assert_same_bytes, random_cache, zero_cache

pytest.importorskip("nixl")

from xavier_async.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL processes in some tests: asyncio (pytest-asyncio)

CFG = EndpointConfig(full_bytes=16 << 10, small_bytes=1 << 10)


def _caches(seed: int, device: str = "cpu") -> dict[int, torch.Tensor]:
    return {0: random_cache(8, (256,), torch.float32, seed).to(device)}


async def _healthy_pair_still_works(a: Endpoint, b: Endpoint) -> None:
    b.publish("k", 3)
    await a.load({1: {0: {"k": 5}}})
    assert_same_bytes(a.caches[0][5], b.caches[0][3])


def _bad_host() -> NixlTransport:
    return NixlTransport(host="192.0.2.1", insecure=True)   # TEST-NET: not an address of ours


@pytest.mark.parametrize("cause", ["meta device", "bad host", "port in use", "no such backend",
                                   "no memory"])
async def test_failed_start_raises_the_real_error_and_leaves_the_task_healthy(cause):
    dst = {0: zero_cache(8, (256,), torch.float32)}
    async with Endpoint(0, dst, NixlTransport(), CFG) as a, \
            Endpoint(1, _caches(1), NixlTransport(), CFG) as b:
        await a.connect(b.address)
        if cause == "meta device":
            bad = Endpoint(2, _caches(2, "meta"), NixlTransport(), CFG)
            expected: type[BaseException] = InvalidRequestError
        elif cause == "bad host":
            bad = Endpoint(2, _caches(2), _bad_host(), CFG)
            expected = ListenError  # an OSError too, with the cause chained
        elif cause == "no such backend":  # a typed error naming the setting, not NIXL's own
            bad = Endpoint(2, _caches(2), NixlTransport(backends=("NOPE",)), CFG)
            expected = InvalidRequestError
        elif cause == "no memory":        # a typed error naming the setting, not torch's
            bad = Endpoint(2, _caches(2), NixlTransport(), EndpointConfig(full_bytes=2**40))
            expected = AllocationError
        else:
            port = int(a.address.rpartition(":")[2])
            bad = Endpoint(2, _caches(2), NixlTransport(port=port), CFG)
            expected = ListenError
        with pytest.raises(expected) as info:
            async with bad:
                pytest.fail("a failed start must not run the body")
        assert "cancel scope" not in str(info.value)
        if cause == "no such backend":
            assert "backends=('NOPE',)" in str(info.value) and "UCX" in str(info.value)
        if cause == "no memory":
            assert "full_bytes=1099511627776" in str(info.value)
            assert isinstance(info.value, MemoryError) and info.value.__cause__ is not None
        if expected is ListenError:  # names where, and chains the operating system's error
            assert ":" + (str(port) if cause == "port in use" else "0") in str(info.value)
            assert isinstance(info.value.__cause__, OSError)
        t = bad.transport
        assert isinstance(t, NixlTransport)
        assert t._reg == [] and t._peers == {}                  # nothing registered now
        # a meta device, a backend NIXL lacks and memory that is not there are refused
        # before anything is registered; the other two fail at the bind, after registering
        # both slabs (then deregistered): none of them ever listened
        early = cause in ("meta device", "no such backend", "no memory")
        assert t.memory_registrations == (0 if early else 2)
        assert t._peering.listener is None and t._peering.bound is None
        assert bad.closed
        with pytest.raises(EndpointClosedError):
            await bad.__aenter__()                               # and it stays closed
        # the caller's task and the other endpoints are fine, and close cleanly
        await _healthy_pair_still_works(a, b)
    assert a.closed and b.closed


async def test_failed_start_releases_the_listener_and_registrations():
    """The port-in-use failure happens after registering: both registrations are
    deregistered, and a failure after binding (a transport whose start fails late) closes
    the listener."""
    from xavier_async import LocalTransport

    class LateFailure(NixlTransport):
        async def start(self, host, send, recv, tg):  # type: ignore[override]
            await super().start(host, send, recv, tg)
            raise RuntimeError("boom after listening")

    t = LateFailure()
    ep = Endpoint(0, _caches(0), t, CFG)
    with pytest.raises(RuntimeError, match="boom after listening"):
        async with ep:
            pass
    assert t._reg == [] and t._closed
    import anyio
    host, port = t._peering.bound
    with pytest.raises(OSError):                                 # nobody listens there
        await anyio.connect_tcp(host, port)
    # a local endpoint in the same task still opens and closes
    async with Endpoint(0, _caches(0), LocalTransport(), CFG):
        pass

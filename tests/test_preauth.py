"""Limits before authentication (issue 21, finding 5), over real NIXL endpoints on
loopback: a stranger that greets and falls silent loses its slot after
``preauth_step_timeout``, one remote address holds at most
``max_unauthenticated_per_host`` slots, and a connection turned away is told "busy" (a
real peer's connect retries that) instead of being hung up on.

The measure of the issue: 64 silent greeters must not lock a real peer out for more than
about 2 s. ``test_silent_greeters_do_not_lock_out_a_real_peer`` records the figure
(``lockout_s`` in the JUnit properties, and printed)."""

from __future__ import annotations

import json
import secrets
import struct
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import pytest
import torch
from anyio.abc import SocketStream

from xavier_async import Endpoint, EndpointConfig, HandshakeError

from .conftest import zero_cache

pytest.importorskip("nixl")

from xavier_async.transports.admission import Admission  # noqa: E402
from xavier_async.transports.handshake import WIRE_VERSION  # noqa: E402
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL: asyncio (pytest-asyncio)

CFG = EndpointConfig(full_bytes=16 << 10, small_bytes=1 << 10)
SECRET = "preauth-test-secret-0123456789"
#: every wait in this file is bounded by this (a hang guard, not a timing assertion)
GUARD = 30.0


def _frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack("!I", len(data)) + data


def slots(t: NixlTransport) -> Admission:
    """The transport's pre-authentication slots (``pending``, ``by_host``): the internals
    this file tests on purpose."""
    return t._admission


def _endpoint(rank: int, **transport: Any) -> Endpoint:
    return Endpoint(rank, {0: zero_cache(8, (256,), torch.float32)}, NixlTransport(**transport), CFG)


async def _greeter(address: str, local_host: str | None = None, auth: bool = False) -> SocketStream:
    """A stranger that sends a valid greeting and then nothing."""
    host, port = address.rsplit(":", 1)
    s = await anyio.connect_tcp(host, int(port), local_host=local_host)
    await s.send(_frame({"xa": WIRE_VERSION, "nonce": secrets.token_hex(32), "auth": auth}))
    return s


async def _frames_until_closed(s: SocketStream) -> list[dict[str, Any]]:
    """Every frame the listener sends on ``s`` until it closes the connection."""
    got = bytearray()
    with anyio.fail_after(GUARD):
        try:
            while True:
                got.extend(await s.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass
    out, i = [], 0
    while i + 4 <= len(got):
        (n,) = struct.unpack("!I", got[i:i + 4])
        out.append(json.loads(got[i + 4:i + 4 + n]))
        i += 4 + n
    return out


@asynccontextmanager
async def _greeters(address: str, n: int, hosts: list[str | None]) -> AsyncIterator[list[SocketStream]]:
    async with AsyncExitStack() as stack:
        out = []
        for i in range(n):
            s = await _greeter(address, hosts[i % len(hosts)])
            stack.push_async_callback(s.aclose)
            out.append(s)
        yield out


async def _until(cond: Any) -> None:
    with anyio.fail_after(GUARD):
        while not cond():
            await anyio.sleep(0.005)


@pytest.mark.parametrize("origin", ["one address", "64 addresses"])
async def test_silent_greeters_do_not_lock_out_a_real_peer(origin, record_property):
    """64 greeters that fall silent, from the real peer's own address (the per-host cap
    turns most away; the few admitted are dropped after preauth_step_timeout) or each
    from its own address (they fill max_unauthenticated, and are dropped the same way).
    The peer is turned away as busy meanwhile, retries, and connects."""
    hosts: list[str | None] = [None] if origin == "one address" else [f"127.0.0.{2 + i}" for i in range(64)]
    async with _endpoint(0) as a, _endpoint(1) as b:
        t = a.transport
        assert isinstance(t, NixlTransport)
        async with _greeters(a.address, 64, hosts):
            await _until(lambda: slots(t).pending + t.refused_connections >= 64)
            assert slots(t).pending == (t.max_unauthenticated_per_host if origin == "one address"
                                          else t.max_unauthenticated)
            t0 = anyio.current_time()
            with anyio.fail_after(GUARD):
                assert await b.connect(a.address) == 0
            lockout = anyio.current_time() - t0
            record_property("lockout_s", round(lockout, 3))
            print(f"\n64 silent greeters ({origin}): the real peer connected after {lockout:.3f} s")
            # the figure is reported, not asserted: the fail_after(GUARD) above is the hang guard
            assert a.peers == (1,) and b.peers == (0,)


async def test_a_connection_turned_away_is_told_busy_and_connect_says_why():
    """At its cap the listener sends a "busy" refusal before it closes; a connect that
    stays busy until its timeout raises HandshakeError(reason="busy") saying so, never an
    opaque IncompleteRead."""
    async with _endpoint(0, max_unauthenticated=1, preauth_step_timeout=600) as a, _endpoint(1) as b:
        t = a.transport
        assert isinstance(t, NixlTransport)
        async with _greeters(a.address, 1, [None]):
            await _until(lambda: slots(t).pending == 1)
            late = await _greeter(a.address)                       # the second is turned away
            got = await _frames_until_closed(late)
            await late.aclose()
            assert len(got) == 1 and got[0]["kind"] == "busy", got
            assert "max_unauthenticated=1" in got[0]["error"]
            with pytest.raises(HandshakeError) as info:
                await b.connect(a.address, timeout=2.0)
            assert info.value.reason == "busy"
            assert "busy" in str(info.value) and "IncompleteRead" not in str(info.value)
            assert b.peers == () and t.refused_connections >= 2
        # the greeter gone, the slot is free again: the same connect succeeds
        await _until(lambda: slots(t).pending == 0)
        assert await b.connect(a.address) == 0


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no secret", "secret"])
async def test_a_late_step_frees_the_slot_at_once(secret):
    """A stranger that greets and falls silent (before its hello, or before its proof
    when the listener holds a secret) is refused and dropped after preauth_step_timeout,
    not after the whole handshake_timeout."""
    transport: dict[str, Any] = dict(preauth_step_timeout=0.2, handshake_timeout=600,
                                     first_frame_timeout=600)
    if secret is not None:
        transport["secret"] = secret
    async with _endpoint(0, **transport) as a:
        t = a.transport
        assert isinstance(t, NixlTransport)
        s = await _greeter(a.address, auth=secret is not None)
        got = await _frames_until_closed(s)                        # within the hang guard
        await s.aclose()
        assert got[0]["xa"] == WIRE_VERSION                        # the listener's greeting
        assert "no handshake frame within 0.2 s" in got[-1]["error"], got
        assert slots(t).pending == 0 and slots(t).by_host == {}


async def test_one_address_holds_at_most_its_share_of_the_slots():
    """Greeters from one address take max_unauthenticated_per_host slots; the rest are
    turned away as busy, and a peer from another address connects at once meanwhile."""
    async with _endpoint(0, max_unauthenticated_per_host=4, preauth_step_timeout=600) as a, \
            _endpoint(1) as b:
        t = a.transport
        assert isinstance(t, NixlTransport)
        async with _greeters(a.address, 16, ["127.0.0.2"]) as greeters:
            await _until(lambda: slots(t).pending + t.refused_connections >= 16)
            assert slots(t).pending == 4 and slots(t).by_host == {"127.0.0.2": 4}
            turned_away = 0
            for s in greeters[4:]:
                got = await _frames_until_closed(s)
                turned_away += len(got) == 1 and got[0]["kind"] == "busy"
            assert turned_away == 12
            assert await b.connect(a.address) == 0                  # from 127.0.0.1
            assert slots(t).pending == 4                          # the four still held


def test_preauth_settings_are_validated():
    from xavier_async import InvalidRequestError
    for kwargs in ({"preauth_step_timeout": 0}, {"preauth_step_timeout": float("nan")},
                   {"max_unauthenticated_per_host": 0}, {"max_unauthenticated_per_host": 1.5}):
        with pytest.raises(InvalidRequestError, match=next(iter(kwargs))):
            NixlTransport(**kwargs)
    # a per-host cap above the total is the total
    assert NixlTransport(max_unauthenticated=4).max_unauthenticated_per_host == 4


async def test_a_connect_whose_deadline_falls_in_a_retry_after_busy_says_busy():
    """The peer said "busy", and the retry that followed got no answer before the connect
    timeout: the error is the busy one (what the peer said), not an opaque timeout. A fake
    listener refuses the first connection as busy and holds the second silently."""
    held: list[SocketStream] = []

    async def handle(stream: SocketStream) -> None:
        if not held and not getattr(handle, "refused", False):
            handle.refused = True  # type: ignore[attr-defined]
            await stream.send(_frame({"error": "all pre-authentication slots are taken",
                                      "kind": "busy"}))
            await stream.aclose()
            return
        held.append(stream)  # silent until the test ends
        await anyio.sleep_forever()

    async with _endpoint(1) as b, await anyio.create_tcp_listener(local_host="127.0.0.1") as lst:
        port = lst.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lst.serve, handle)
            with anyio.fail_after(GUARD), pytest.raises(HandshakeError) as info:
                await b.connect(f"127.0.0.1:{port}", timeout=1.0)
            tg.cancel_scope.cancel()
    assert info.value.reason == "busy", info.value
    assert "stayed busy" in str(info.value)
    assert held  # the retry did reach the listener

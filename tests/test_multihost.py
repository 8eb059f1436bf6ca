"""Two "hosts" on one machine: a network namespace joined to this one by a veth pair, and
UCX restricted to TCP on that link (no shared memory), so the copy takes the path it takes
between machines. Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async import (Endpoint, EndpointConfig, HandshakeError, PeerLostError,  # noqa: E402
                          UnknownPeerError)
from xavier_async.peer_process import (LayoutSpec, PeerProcess, PeerSpec, check_loaded,  # noqa: E402
                                       pattern_caches, zero_slots)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

SPEC = LayoutSpec(layers=2, num_slots=32, block_shape=(2, 16, 8, 64), dtype="bfloat16")
CFG = dict(full_bytes=1 << 20, small_bytes=64 << 10)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = os.getpid() % 200 + 20
    ns, host_if, ns_if = f"xa-test-{os.getpid()}", f"xa{os.getpid()}a", f"xa{os.getpid()}b"
    here, there = f"10.231.{tag}.1", f"10.231.{tag}.2"
    try:
        _ip("netns", "add", ns)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{here}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{there}/24", "dev", ns_if)
        _ip("netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield {"ns": ns, "here": here, "there": there, "host_if": host_if, "ns_if": ns_if}
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _remote(netns, rank: int) -> PeerSpec:
    return PeerSpec(rank=rank, layout=SPEC, seed=3, config=CFG,
                    transport={"host": netns["there"]},
                    wrapper=["ip", "netns", "exec", netns["ns"]],
                    env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": netns["ns_if"]})


async def test_load_across_namespaces_over_tcp_and_peer_death(netns, monkeypatch):
    # this process is the other host: UCX over TCP on its end of the veth only
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", netns["host_if"])
    remote = await anyio.to_thread.run_sync(PeerProcess, _remote(netns, 1))
    try:
        assert remote.address.startswith(netns["there"])
        caches = pattern_caches(SPEC, 0, 3)
        async with Endpoint(0, caches, NixlTransport(host=netns["here"]), EndpointConfig(**CFG)) as ep:
            for slot in range(16):
                ep.publish(slot, slot)
            assert await ep.connect(remote.address) == 1
            for keys in ([1], list(range(2, 12)), [5]):  # small, full slab, small
                req = {1: {layer: {k: 16 + i for i, k in enumerate(keys)} for layer in range(2)}}
                zero_slots(caches, req)
                await ep.load(req)
                assert check_loaded(caches, req, {1: pattern_caches(SPEC, 1, 3)}) == 2 * len(keys)
            # and the other way: the remote host loads from us
            result, checked = await anyio.to_thread.run_sync(
                remote.call, "load", ({0: {0: {3: 20, 4: 21}, 1: {3: 22}}}, 3))
            assert checked == 3
            # the remote host dies: a clear error, quickly
            remote.kill()
            t0 = time.monotonic()
            # (PeerLostError for a load in flight, UnknownPeerError once rank 1 is dropped)
            with pytest.raises((PeerLostError, UnknownPeerError)):
                with anyio.fail_after(20):
                    while True:
                        await ep.load({1: {0: {1: 30}}})
            assert time.monotonic() - t0 < 20
            assert 1 not in ep.peers
    finally:
        remote.close()


async def test_unreachable_host_is_a_handshake_error(netns):
    async with Endpoint(0, pattern_caches(SPEC, 0, 3), NixlTransport(handshake_timeout=3),
                        EndpointConfig(**CFG)) as ep:
        with pytest.raises(HandshakeError):
            await ep.connect(f"{netns['there']}:1")  # the host exists, nothing listens

"""Two "hosts" on one machine: two network namespaces joined by a veth pair, one endpoint
process in each, and UCX restricted to TCP on that link (no shared memory), so copies take
the path they take between machines. Needs root and iproute2; skipped otherwise.

Both endpoints are child processes: UCX enumerates network devices once per process, so a
process that used UCX before the veth existed could not use it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import anyio
import pytest

pytest.importorskip("nixl")

from xavier_async.testing.peer_process import LayoutSpec, PeerProcess, PeerSpec  # noqa: E402

pytestmark = pytest.mark.asyncio  # real NIXL processes: asyncio (pytest-asyncio)

SPEC = LayoutSpec(layers=2, num_slots=32, block_shape=(2, 16, 8, 64), dtype="bfloat16")
CFG = dict(full_bytes=1 << 20, small_bytes=64 << 10)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    pid, tag = os.getpid(), os.getpid() % 200 + 20
    made: list[str] = []
    try:
        for name in ("a", "b"):
            ns = f"xa-test-{pid}-{name}"
            try:
                _ip("netns", "add", ns)
            except (subprocess.CalledProcessError, OSError) as exc:
                pytest.skip(f"cannot create a network namespace here: {exc}")
            made.append(ns)
        out = {}
        _ip("link", "add", f"xa{pid}a", "type", "veth", "peer", "name", f"xa{pid}b")
        for i, (name, ns) in enumerate(zip("ab", made), start=1):
            dev, addr = f"xa{pid}{name}", f"10.231.{tag}.{i}"
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            out[name] = {"ns": ns, "dev": dev, "addr": addr}
        yield out
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _host(h: dict, rank: int) -> PeerSpec:
    return PeerSpec(rank=rank, layout=SPEC, seed=3, config=CFG,
                    transport={"host": h["addr"], "handshake_timeout": 5,
                               # not loopback: a shared secret is required (tests/test_nixl_auth.py)
                               "secret": "multihost-test-secret"},
                    wrapper=["ip", "netns", "exec", h["ns"]],
                    env={"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": h["dev"]}, torch_threads=1)


async def _call(p: PeerProcess, cmd: str, arg=None, timeout: float = 60.0):
    return await anyio.to_thread.run_sync(lambda: p.call(cmd, arg, timeout))


async def test_loads_across_hosts_over_tcp_and_host_death(hosts):
    a = await anyio.to_thread.run_sync(PeerProcess, _host(hosts["a"], 0))
    b = await anyio.to_thread.run_sync(PeerProcess, _host(hosts["b"], 1))
    try:
        assert a.address.startswith(hosts["a"]["addr"]) and b.address.startswith(hosts["b"]["addr"])
        assert await _call(a, "connect", b.address) == 1
        # each child zeroes the destination slots, loads, and checks every byte against
        # the source's seeded pattern; dest slots 16.. never overlap the keys 0..15
        for keys in ([1], list(range(2, 12)), [5]):  # small, the full slab, small
            req = {1: {layer: {k: 16 + i for i, k in enumerate(keys)} for layer in range(2)}}
            result, checked = await _call(a, "load", (req, 3))
            assert checked == 2 * len(keys) and result["blocks"] == 2 * len(keys)
        result, checked = await _call(b, "load", ({0: {0: {3: 20, 4: 21}, 1: {3: 22}}}, 3))
        assert checked == 3
        metrics = await _call(a, "metrics")
        assert metrics["peers"][1]["batches_received"] == 3
        # host b dies: host a's next load fails with a clear error, quickly
        b.kill()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="PeerLostError|UnknownPeerError"):
            for _ in range(50):
                await _call(a, "load", ({1: {0: {1: 30}}}, 3), timeout=20)
                await anyio.sleep(0.05)
        assert time.monotonic() - t0 < 20
    finally:
        b.close()
        a.close()


async def test_unreachable_host_is_a_handshake_error(hosts):
    a = await anyio.to_thread.run_sync(PeerProcess, _host(hosts["a"], 0))
    try:
        with pytest.raises(RuntimeError, match="HandshakeError"):
            await _call(a, "connect", f"{hosts['b']['addr']}:1")  # the host exists, nothing listens
    finally:
        a.close()

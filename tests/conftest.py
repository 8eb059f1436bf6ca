"""Shared helpers for the core test suite: caches with known bytes and in-process clusters.

Endpoints own an anyio task group, so they are opened inside the test's own task with the
:func:`cluster` async context manager rather than with async fixtures (pytest-asyncio may
run a fixture's setup and teardown in different tasks).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import anyio

import pytest
import torch

from xavier_async import Endpoint, EndpointConfig, LocalFabric, LocalTransport, Transport
from xavier_async.lifecycle import Phase
from xavier_async.slabs import Slab
from xavier_async.bench.raw import accept_raw_copies
from xavier_async.testing import FaultPlan, FaultyTransport

KiB = 1024


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The suites marked ``anyio`` run once per backend."""
    return request.param


#: for the few tests that exercise a native asyncio cancellation (Task.cancel, asyncio.timeout)
asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def _have_nixl() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


#: for the NIXL tests of a module that also holds in-process ones: only they skip without
#: NIXL (a module-level ``importorskip`` would skip the whole module, the tests above it too)
requires_nixl = pytest.mark.skipif(not _have_nixl(), reason="needs NIXL (the nixl package)")

#: a small slab keeps tests fast and makes multi-batch loads cheap to provoke
SMALL_CFG = EndpointConfig(full_bytes=16 * KiB, small_bytes=1 * KiB)


def random_cache(num_slots: int, block_shape: Sequence[int], dtype: torch.dtype,
                 seed: int) -> torch.Tensor:
    """A contiguous cache ``[num_slots, *block_shape]`` of ``dtype`` filled with random bytes
    (any bit pattern, NaNs included for floats)."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = num_slots * itemsize
    for d in block_shape:
        n *= d
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(num_slots, *block_shape).clone()


def zero_cache(num_slots: int, block_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((num_slots, *block_shape), dtype=dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (for bit-exact comparisons of any dtype, NaNs included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a, e = raw(actual), raw(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero().flatten()
        raise AssertionError(f"{bad.numel()} of {a.numel()} bytes differ, first at byte {int(bad[0])}")


def snapshot(caches: Mapping[object, torch.Tensor]) -> dict[object, torch.Tensor]:
    return {layer: t.clone() for layer, t in caches.items()}


def assert_caches_unchanged(caches: Mapping[object, torch.Tensor],
                            before: Mapping[object, torch.Tensor]) -> None:
    for layer, t in caches.items():
        assert_same_bytes(t, before[layer])


class CountingTransport(LocalTransport):
    """A local transport that counts view mappings (``map_view`` calls that succeeded) and
    can make each mapping slow, to widen race windows."""

    def __init__(self, fabric: LocalFabric, map_delay: float = 0.0) -> None:
        super().__init__(fabric)
        self.map_calls = 0
        self.map_done = 0
        self.map_delay = map_delay
        self.writes = 0

    async def map_view(self, peer, view, slab=0):  # type: ignore[override]
        import anyio
        self.map_calls += 1
        if self.map_delay:
            await anyio.sleep(self.map_delay)
        m = await super().map_view(peer, view, slab)
        self.map_done += 1
        return m

    def post(self, peer, mapping, nbytes, notify):  # type: ignore[override]
        self.writes += 1
        return super().post(peer, mapping, nbytes, notify)


Wrap = Callable[[LocalFabric], Transport]


def faulty(seed: int = 0, **plan: object) -> Wrap:
    """A ``wrap`` entry for :func:`cluster`: a FaultyTransport around a local one."""
    return lambda fabric: FaultyTransport(LocalTransport(fabric), FaultPlan(seed=seed, **plan))


def counting(map_delay: float = 0.0) -> Wrap:
    return lambda fabric: CountingTransport(fabric, map_delay)


@asynccontextmanager
async def cluster(caches: Sequence[Mapping[object, torch.Tensor]],
                  config: EndpointConfig | Sequence[EndpointConfig] = SMALL_CFG, *,
                  wrap: Mapping[int, Wrap] | None = None,
                  connect: bool = True, raw_copies: bool = False) -> AsyncIterator[list[Endpoint]]:
    """Open one endpoint per cache dict (rank = index) on one local fabric and connect
    every pair. ``wrap[rank]`` builds that endpoint's transport; ``raw_copies``: every
    endpoint accepts the benchmark's bare copies."""
    fabric = LocalFabric()
    configs = [config] * len(caches) if isinstance(config, EndpointConfig) else list(config)
    async with AsyncExitStack() as stack:
        eps = []
        for rank, c in enumerate(caches):
            t = (wrap or {}).get(rank, LocalTransport)(fabric)
            ep = Endpoint(rank, c, t, configs[rank])
            if raw_copies:
                accept_raw_copies(ep)
            eps.append(await stack.enter_async_context(ep))
        if connect:
            for i in range(len(eps)):
                for j in range(i + 1, len(eps)):
                    await eps[i].connect(eps[j].address)
        yield eps


def cancellable(ep: Endpoint, request: dict):
    """A load in a cancel scope of its own: (scope, outcome, the task to start); once
    the task has returned, ``outcome["cancelled"]`` says whether the scope caught it."""
    scope = anyio.CancelScope()
    outcome: dict[str, bool] = {}

    async def run() -> None:
        with scope:
            await ep.load(request)
        outcome["cancelled"] = scope.cancelled_caught

    return scope, outcome, run


async def until(cond: Callable[[], object], what: str) -> None:
    """Yield to the other tasks until ``cond()`` holds (bounded; an ordering, not a timing)."""
    with anyio.fail_after(10):
        while not cond():
            await anyio.sleep(0)
    assert cond(), what


async def cancel_and_wait(scope: anyio.CancelScope, outcome: dict[str, bool]) -> bool:
    """Cancel a :func:`cancellable` load and wait until it has returned; whether its scope
    caught the cancellation."""
    scope.cancel()
    await until(lambda: "cancelled" in outcome, "the cancellation returned")
    return outcome["cancelled"]


# -- the internals a few tests check on purpose: one helper per concept -------------------
# (everything else goes through the public surface: recv_slab_stats, snapshot_metrics(),
# check_invariants(), recv_slabs, metrics)

def lifecycle_phase(ep: Endpoint) -> Phase:
    """Where ``ep`` is in its lifecycle (``closed`` says only "closing or closed")."""
    return ep._rt.life.phase


def forming_groups(ep: Endpoint) -> dict[tuple[int, bool], int]:
    """The receiver's merged groups forming now: (source, large) -> batches in it."""
    return {key: len(group.members) for key, group in ep._receiver.scheduler.forming.items()}


def recv_pool(ep: Endpoint) -> tuple[set[int], set[int]]:
    """The receive slabs in the pool by index: (free, lent)."""
    pool = ep._receiver.slabs.pool
    return set(pool._free), set(pool._held)


def fenced_slabs(ep: Endpoint) -> set[int]:
    """The receive slabs fenced now (out of the pool: a stale writer may still write)."""
    return set(ep._receiver.slabs.fenced)


def recv_slab(ep: Endpoint, index: int) -> Slab:
    """Receive slab ``index`` of ``ep`` (in the pool, a spare or fenced)."""
    return {slab.index: slab for slab in ep.recv_slabs}[index]


def queued_at_source(ep: Endpoint) -> int:
    """Load requests queued at source ``ep`` for a send slab."""
    return ep._source._queued


def run_bench_cli(tmp_dir, *args: str) -> tuple[str, dict]:
    """Run ``python -m xavier_async.cli bench --quick --full 2MiB --small 64KiB ... --json``
    in a subprocess; return its stdout and the JSON it wrote (asserting it succeeded)."""
    import json
    import subprocess
    import sys
    out = tmp_dir / "bench.json"
    cmd = [sys.executable, "-m", "xavier_async.bench", "bench", "--quick", "--full", "2MiB",
           "--small", "64KiB", "--alloc-copies", "300", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


async def raw_exchange(address: str, payloads: list[bytes], timeout: float = 5.0) -> bytes:
    """Send raw bytes to a listener and return everything it sends back until it closes."""
    host, port = address.rsplit(":", 1)
    got = bytearray()
    with anyio.fail_after(timeout):
        async with await anyio.connect_tcp(host, int(port)) as s:
            for p in payloads:
                await s.send(p)
            try:
                while True:
                    got.extend(await s.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                pass
    return bytes(got)

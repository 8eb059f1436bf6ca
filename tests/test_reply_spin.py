"""A lone small round trip polls for its reply itself (``EndpointConfig.reply_spin``),
over real NIXL with a source process: the bytes, the count, the fallback to the event
loop, and cancellations that arrive once the request is out (held until the copy is
terminal, never unpacked, the receive slab not fenced)."""

from __future__ import annotations

import asyncio

import anyio
import pytest
import torch

pytest.importorskip("nixl")

from xavier_async import Endpoint, EndpointConfig  # noqa: E402
from xavier_async.testing.peer_process import (LayoutSpec, PeerProcess, PeerSpec,  # noqa: E402
                                               pattern_caches, zero_caches)
from xavier_async.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.anyio  # on both backends (the native task cancellation: asyncio)

SPEC = LayoutSpec(layers=3, num_slots=32, block_shape=(8, 64), dtype="bfloat16")  # 1 KiB blocks
CFG = dict(full_bytes=64 << 10, small_bytes=16 << 10)
SEED = 5
SRC, SLOW = 1, 2  # the two source processes' ranks


@pytest.fixture(scope="module")
def source():
    proc = PeerProcess(PeerSpec(rank=SRC, layout=SPEC, seed=SEED, config=CFG, torch_threads=1))
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def stalling_source():
    """Every write is held 50 ms: no reply can come within the spin."""
    proc = PeerProcess(PeerSpec(rank=SLOW, layout=SPEC, seed=SEED, config=CFG, torch_threads=1,
                                faults={"write_stall_rate": 1.0, "stall_seconds": 0.05}))
    yield proc
    proc.close()


EXPECTED = {rank: pattern_caches(SPEC, rank, SEED) for rank in (SRC, SLOW)}


def _assert_block(ep: Endpoint, key: int, slot: int, src: int = SRC) -> None:
    for layer in range(SPEC.layers):
        got = ep.caches[layer][slot].view(torch.uint8)
        assert torch.equal(got, EXPECTED[src][layer][key].view(torch.uint8)), (key, slot, layer)


def _assert_zero(ep: Endpoint, slot: int) -> None:
    for layer in range(SPEC.layers):
        assert not ep.caches[layer][slot].view(torch.uint8).any(), (slot, layer)


async def _load(ep: Endpoint, i: int, src: int = SRC) -> None:
    key, slot = i % SPEC.num_slots, (7 * i) % SPEC.num_slots
    for layer in range(SPEC.layers):
        ep.caches[layer][slot].zero_()
    await ep.load_blocks(src, [key], [slot])
    _assert_block(ep, key, slot, src)


async def _loads(ep: Endpoint, n: int, src: int = SRC) -> None:
    for i in range(n):
        await _load(ep, i, src)


def _rank(base: int, backend: str) -> int:
    """A loader rank per test and backend: each source sees each loader once."""
    return base + (20 if backend == "trio" else 0)


async def test_lone_small_loads_poll_for_their_replies(source, anyio_backend):
    cfg = EndpointConfig(**CFG, reply_spin=0.01)
    async with Endpoint(_rank(10, anyio_backend), zero_caches(SPEC), NixlTransport(), cfg) as ep:
        await ep.connect(source.address)
        m = ep.metrics
        # a one-block round trip takes ~0.1 ms here: nearly all replies come within the
        # 10 ms spin; a busy machine may delay some past it, so the loads go on (at most
        # 240) until 12 did. Without the spin (or with it never catching a reply), none is.
        n = 0
        while n < 240 and (n == 0 or m.replies_polled < 12):
            await _loads(ep, 24)
            n += 24
        assert m.peer(SRC).batches_received == n
        assert m.replies_polled >= 12, (m.replies_polled, n)
        assert m.reply_spins >= m.replies_polled  # (after a slow reply one may not spin)
        assert m.as_dict()["replies_polled"] == m.replies_polled
        assert m.as_dict()["reply_spins"] == m.reply_spins
        assert ep.recv_slab_stats["in_use"] == 0 and ep.recv_slab_stats["fences"] == 0


async def test_reply_spin_zero_waits_through_the_event_loop(source, anyio_backend):
    cfg = EndpointConfig(**CFG, reply_spin=0)
    async with Endpoint(_rank(11, anyio_backend), zero_caches(SPEC), NixlTransport(), cfg) as ep:
        await ep.connect(source.address)
        await _loads(ep, 6)
        assert ep.metrics.reply_spins == ep.metrics.replies_polled == 0
        assert ep.metrics.peer(SRC).batches_received == 6


class _CountingPolls(NixlTransport):
    spins = 0

    def poll_until(self, done, seconds):  # type: ignore[no-untyped-def]
        self.spins += 1
        return super().poll_until(done, seconds)


async def test_a_reply_later_than_the_spin_is_waited_for_and_stops_the_next_spin(
        source, stalling_source, anyio_backend):
    """A reply that comes after the spin is waited for through the event loop; the next
    small round trip does not spin, and once a reply comes within the spin again, the
    one after it spins. Checked load by load as a rule (a load spins exactly when the
    previous reply came within the spin), not as counts that need each quick reply inside
    10 ms: the stalling source's replies are late by construction (50 ms), the quick
    source's are loaded until one spins again."""
    cfg = EndpointConfig(**CFG, reply_spin=0.01)
    transport = _CountingPolls()
    async with Endpoint(_rank(12, anyio_backend), zero_caches(SPEC), transport, cfg) as ep:
        await ep.connect(stalling_source.address)
        await ep.connect(source.address)
        m, receiver = ep.metrics, ep._receiver
        seen: list[tuple[int, bool, bool, bool]] = []  # (src, spun, polled, slow after)

        async def one(src: int) -> tuple[bool, bool, bool]:
            spins, polled = transport.spins, m.replies_polled
            await _load(ep, len(seen), src)
            out = (transport.spins - spins == 1, m.replies_polled - polled == 1,
                   receiver._slow_replies)
            assert transport.spins - spins <= 1 and m.replies_polled - polled <= 1
            seen.append((src, *out))
            return out

        # the quick source's first serve maps a view (not timed): load until a reply came
        # within the spin, so that the next round trip spins
        for _ in range(50):
            if not (await one(SRC))[2]:
                break
        assert not receiver._slow_replies, seen
        # the stalling source: the first spins and its reply misses the spin (it is held
        # 50 ms), so the next two wait through the event loop without spinning
        assert await one(SLOW) == (True, False, True), seen
        assert await one(SLOW) == (False, False, True), seen
        assert await one(SLOW) == (False, False, True), seen
        # back to the quick source: the first waits without spinning; once a reply comes
        # within the spin (nearly at once here), the next spins again
        assert (await one(SRC))[:2] == (False, False), seen
        for _ in range(50):
            if (await one(SRC))[0]:
                break
        assert seen[-1][0] == SRC and seen[-1][1], f"no spin again after the slow source: {seen}"
        # the rule, load by load: a spin exactly after a quick reply; only a spin polls,
        # and a spin that did not catch its reply counts it slow
        for (_, _, _, slow_before), (src, spun, polled, slow) in zip(seen, seen[1:]):
            assert spun == (not slow_before), seen
            assert not polled or spun, seen
            assert not (spun and not polled) or slow, seen
        assert transport.spins == m.reply_spins
        assert m.peer(SLOW).batches_received == 3
        assert m.peer(SRC).batches_received == sum(1 for s in seen if s[0] == SRC)


class _CancelOnSend(NixlTransport):
    """Cancels the loading task (or a scope) right after a request went out: the
    cancellation reaches the round trip at its one schedule point."""

    cancel: object = None

    def send_now(self, peer: int, msg: bytes) -> None:
        super().send_now(peer, msg)
        cancel, self.cancel = self.cancel, None
        if cancel is not None:
            cancel()  # type: ignore[operator]


@pytest.mark.parametrize("slow", [False, True], ids=["reply_within_the_spin", "reply_after_it"])
@pytest.mark.parametrize("how", ["task", "scope"])
async def test_a_cancellation_once_the_request_is_out_is_held_until_the_copy_lands(
        source, stalling_source, how, slow, anyio_backend):
    """Cancelled (natively, or by an anyio scope) right after its request went out, a load
    still waits for the copy (with a stalling source: the source has finished it when the
    cancellation surfaces), does not unpack it, and gives its receive slab back."""
    if how == "task" and anyio_backend != "asyncio":
        pytest.skip("a native task cancellation is asyncio's")
    peer, src = (stalling_source, SLOW) if slow else (source, SRC)
    rank = _rank(13 + 2 * slow + (how == "scope"), anyio_backend)
    cfg = EndpointConfig(**CFG, reply_spin=0.01)
    transport = _CancelOnSend()
    assert transport.polls_inline  # send_now overridden, send not: requests still spin
    async with Endpoint(rank, zero_caches(SPEC), transport, cfg) as ep:
        await ep.connect(peer.address)
        await _loads(ep, 2, src)
        received = ep.metrics.peer(src).batches_received
        slot = 20
        if how == "task":
            task = asyncio.current_task()
            assert task is not None
            transport.cancel = task.cancel
            with pytest.raises(asyncio.CancelledError):
                await ep.load_blocks(src, [3], [slot])
            assert task.uncancel() == 0
        else:
            with anyio.CancelScope() as scope:
                transport.cancel = scope.cancel
                await ep.load_blocks(src, [3], [slot])
            assert scope.cancelled_caught
        if slow:  # the copy had ended when the cancellation surfaced (it was held 50 ms)
            sent = await anyio.to_thread.run_sync(peer.call, "metrics")
            assert sent["peers"][rank]["batches_sent"] == 3
        # not unpacked, and the slab is back in the pool, not fenced
        _assert_zero(ep, slot)
        stats = ep.recv_slab_stats
        assert stats["in_use"] == 0 and stats["fences"] == 0 and stats["fenced_now"] == 0
        assert ep.metrics.peer(src).batches_received == received
        await _loads(ep, 4, src)  # and the endpoint goes on
        ep.check_invariants(idle=True)

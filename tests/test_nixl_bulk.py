"""Large host WRITEs through the bulk agent (``NixlTransport(bulk_bytes=...)``,
xavier_async/transports/nixl_bulk.py): posted and polled on a thread of their own, their
notification mapped to the sender's rank, never abandoned while posted. With the fake agent
of tests/fake_nixl.py (bytes checked); real NIXL between endpoints at the end."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch

from xavier_async.errors import EndpointClosedError, InvalidRequestError, PeerLostError, TransferError
from xavier_async.transports import nixl_bulk
from xavier_async.transports.nixl import NixlTransport
from xavier_async.transports.nixl_bulk import BULK_BYTES, _Bulk

from .fake_nixl import FakeFabric
from .test_nixl_pieces import delivered
from .test_nixl_unit import FULL, fill, nodes

pytestmark = pytest.mark.asyncio

BULK = 32 << 10  # copies of half the full view (64 KiB) or more go through the bulk agent


def test_the_setting_is_checked_and_its_default_follows_the_cores(monkeypatch: Any) -> None:
    with pytest.raises(InvalidRequestError, match="bulk_bytes"):
        NixlTransport(bulk_bytes=-1)
    with pytest.raises(InvalidRequestError, match="bulk_bytes"):
        NixlTransport(bulk_bytes=2.5)  # type: ignore[arg-type]
    monkeypatch.setattr(nixl_bulk, "_cpus", lambda: 2)
    assert NixlTransport().bulk_bytes == 0
    monkeypatch.setattr(nixl_bulk, "_cpus", lambda: 16)
    assert NixlTransport().bulk_bytes == BULK_BYTES
    assert NixlTransport(bulk_bytes=0).bulk_bytes == 0


def _bulk_agent(fabric: FakeFabric, node: Any) -> Any:
    return fabric.agents[node.t.agent_name + "-bulk"]


async def test_a_large_copy_goes_through_the_bulk_agent_on_its_thread() -> None:
    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK) as (a, b):
        await a.t.connect(b.t.address)
        bulk = _bulk_agent(fabric, a)
        # the bulk agent registered the send slab and knows the peer; the main one did too
        assert len(bulk.registered) == 1 and bulk.remotes == {b.t.agent_name}
        posting: list[str] = []
        real = bulk.transfer

        def transfer(h: Any, notif: bytes = b"") -> str:
            posting.append(threading.current_thread().name)
            return real(h, notif)

        bulk.transfer = transfer
        want = fill(a, 1)
        b.recv.tensor.zero_()
        m = await a.t.map_view(1, a.send.full)
        pending = a.t.post(1, m, FULL, b"landed")
        assert isinstance(pending, _Bulk) and a.t.unsettled() == {1}
        await a.t.wait(pending)
        assert torch.equal(b.recv.tensor, want) and a.t.unsettled() == set()
        # posted by the bulk thread, not the loop; its notification is rank 0's
        assert posting and all(name.startswith("xavier-bulk") for name in posting)
        await delivered(b, [(0, b"landed")])
        assert a.t.bulk_posts == 1 and a.agent.posted == set()
        # re-posted through the same handle; a small copy stays on the loop's agent
        made = len(bulk.live)
        want = fill(a, 2)
        await a.t.wait(a.t.post(1, m, FULL, b"again"))
        assert len(bulk.live) == made and a.t.bulk_posts == 2
        assert a.t.post(1, m, BULK - 1, b"small") is None and a.t.bulk_posts == 2
        await delivered(b, [(0, b"landed"), (0, b"again"), (0, b"small")])
        assert torch.equal(b.recv.tensor, want)
        # a silent copy has a handle of its own (NIXL re-sends a handle's last notification)
        await a.t.wait(a.t.post(1, m, FULL, None))
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert len(b.host.delivered) == 3
        await a.t.forget(1)  # the channel is reset: the bulk handles go too
        assert bulk.live == set() and bulk.errors == [] and a.agent.live == set()


async def test_the_send_slab_counts_as_a_registration_of_each_agent() -> None:
    async with nodes(1, bulk_bytes=BULK) as (a,):
        with_bulk = a.t.memory_registrations
    async with nodes(1, bulk_bytes=0) as (a,):
        assert with_bulk == a.t.memory_registrations + 1


async def test_a_cancelled_wait_leaves_the_copy_posted_until_it_ends() -> None:
    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK) as (a, b):
        await a.t.connect(b.t.address)
        bulk = _bulk_agent(fabric, a)
        want = fill(a, 3)
        b.recv.tensor.zero_()
        m = await a.t.map_view(1, a.send.full)
        fabric.hold_copies = True
        pending = a.t.post(1, m, FULL, b"landed")
        with anyio.move_on_after(0.05):
            await a.t.wait(pending)  # natively cancelled: the copy goes on
        assert a.t.unsettled() == {1} and not pending.future.done()
        await a.t.forget(1)  # released meanwhile: only once the copy has ended
        assert bulk.errors == []
        fabric.hold_copies = False
        bulk.finish()
        await a.t.wait(pending)  # waited for again (as wait_terminal does)
        assert torch.equal(b.recv.tensor, want) and a.t.unsettled() == set()
        assert bulk.live == set() and bulk.errors == []


async def test_a_copy_still_posted_when_its_peer_is_lost_is_stuck_until_terminal() -> None:
    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK) as (a, b):
        await a.t.connect(b.t.address)
        bulk = _bulk_agent(fabric, a)
        fill(a, 4)
        m = await a.t.map_view(1, a.send.full)
        fabric.hold_copies = True
        pending = a.t.post(1, m, FULL, b"landed")
        pending.peer.lost = True  # as the liveness watch marks it: the thread stops polling
        with pytest.raises(PeerLostError):
            await a.t.wait(pending)
        assert a.t.unsettled() == {1} and bulk.errors == []  # not released while posted
        bulk.finish()
        with anyio.fail_after(5):
            while a.t.unsettled():
                await anyio.sleep(0.001)  # the poller sees it terminal and releases it
        assert bulk.errors == []


async def test_a_copy_past_write_timeout_is_given_up_on() -> None:
    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK, write_timeout=0.05) as (a, b):
        await a.t.connect(b.t.address)
        fill(a, 5)
        m = await a.t.map_view(1, a.send.full)
        fabric.hold_copies = True
        with pytest.raises(TransferError, match="did not finish"):
            await a.t.wait(a.t.post(1, m, FULL, b"landed"))
        assert a.t.unsettled() == {1}
        _bulk_agent(fabric, a).finish()


async def test_a_refused_post_is_a_transfer_error_and_nothing_stays_in_flight() -> None:
    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK) as (a, b):
        await a.t.connect(b.t.address)
        bulk = _bulk_agent(fabric, a)

        def refuse(h: Any, notif: bytes = b"") -> str:
            raise RuntimeError("NIXL_ERR_BACKEND")

        bulk.transfer = refuse
        m = await a.t.map_view(1, a.send.full)
        with pytest.raises(TransferError, match="NIXL_ERR_BACKEND"):
            await a.t.wait(a.t.post(1, m, FULL, b"landed"))
        assert a.t.unsettled() == set()


async def test_close_joins_the_thread_and_refuses_later_posts() -> None:
    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK) as (a, b):
        await a.t.connect(b.t.address)
        fill(a, 6)
        m = await a.t.map_view(1, a.send.full)
        await a.t.wait(a.t.post(1, m, FULL, b"landed"))
        before = {t.name for t in threading.enumerate()}
        assert any(name.startswith("xavier-bulk") for name in before)
        await a.t.aclose()
        await a.t.aclose()  # idempotent
        assert not any(t.name.startswith("xavier-bulk") for t in threading.enumerate())
        with pytest.raises(EndpointClosedError):
            a.t._bulk.submit(m, None, FULL, b"", 0.0)  # type: ignore[arg-type]


async def test_a_receive_slab_shared_later_reaches_the_bulk_agent_too() -> None:
    from xavier_async.slabs import allocate_slab

    fabric = FakeFabric()
    async with nodes(2, fabric, bulk_bytes=BULK) as (a, b):
        await a.t.connect(b.t.address)
        extra = allocate_slab("recv", FULL, FULL // 2, torch.device("cpu"), index=1)
        await b.t.add_recv_slab(extra)
        await b.t.share_recv_slab(0, extra)
        assert _bulk_agent(fabric, a).added.count(b.t.agent_name) == 2  # hello, then the slab
        want = fill(a, 7)
        extra.tensor.zero_()
        m = await a.t.map_view(1, a.send.full, slab=1)
        await a.t.wait(a.t.post(1, m, FULL, b"into 1"))
        assert torch.equal(extra.tensor, want)
        await delivered(b, [(0, b"into 1")])


async def test_a_peer_without_a_bulk_agent_still_gets_our_bulk_writes() -> None:
    """Mixed settings: only the source has a bulk agent; the receiver maps its name."""
    fabric = FakeFabric()
    async with nodes(1, fabric, bulk_bytes=BULK) as (a,):
        async with nodes(1, fabric, bulk_bytes=0) as (b,):
            b.host.rank = 1  # (StubHost ranks both 0 here)
            await a.t.connect(b.t.address)
            assert b.t._peers[0].bulk_agent == a.t.agent_name + "-bulk"
            want = fill(a, 8)
            m = await a.t.map_view(1, a.send.full)
            await a.t.wait(a.t.post(1, m, FULL, b"landed"))
            assert torch.equal(b.recv.tensor, want)
            await delivered(b, [(0, b"landed")])


# -- real NIXL between processes --------------------------------------------------------------

async def test_real_nixl_large_loads_go_through_the_bulk_agent_under_faults_bytes_checked() -> None:
    """Both endpoints with a bulk agent (any host's cores): the child serves the parent's
    large loads through it while failing and stalling some writes (FaultyTransport around
    it); every load that succeeds has its bytes, and a failed one is retried."""
    pytest.importorskip("nixl")
    from xavier_async import Endpoint, EndpointConfig, XavierError
    from xavier_async.testing.peer_process import PeerProcess, PeerSpec, check_loaded, pattern_caches
    from xavier_async.testing.peer_process import zero_slots

    from .test_nixl_process import CFG, LARGE_KEYS, SEED, SPEC, _child_call, _req, _small_req

    bulk = {"bulk_bytes": 256 << 10}
    faults = {"seed": 3, "write_failure_rate": 0.1, "write_stall_rate": 0.2, "stall_seconds": 0.01}
    with PeerProcess(PeerSpec(rank=1, layout=SPEC, seed=SEED, config=CFG, transport=bulk,
                              faults=faults)) as child:
        caches = pattern_caches(SPEC, 0, SEED)
        async with Endpoint(0, caches, NixlTransport(**bulk), EndpointConfig(**CFG)) as ep:
            for slot in range(SPEC.num_slots):
                ep.publish(slot, slot)
            await ep.connect(child.address)
            expected = {1: pattern_caches(SPEC, 1, SEED)}
            loaded = failed = 0
            for i in range(12):
                req = _req(1, LARGE_KEYS) if i % 3 else _small_req(1)
                zero_slots(ep.caches, req)
                try:
                    await ep.load(req)
                except XavierError:
                    failed += 1
                    continue
                assert check_loaded(ep.caches, req, expected) > 0
                loaded += 1
            # and the other way: the child loads large batches from us, through our bulk agent
            result, checked = await _child_call(child, "load", (_req(0, LARGE_KEYS), SEED))
            assert checked == len(LARGE_KEYS) * SPEC.layers
            assert ep.transport.bulk_posts >= 1  # type: ignore[attr-defined]
            stats = await _child_call(child, "transport_stats")
        assert loaded >= 6 and stats["bulk_posts"] >= 1, (loaded, failed, stats)

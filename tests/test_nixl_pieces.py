"""A large host copy goes in pieces (``NixlTransport(piece_bytes=...)``): one piece per
pass through the event loop, the notification with the last, nothing more after the peer
is lost. With the fake agent of tests/fake_nixl.py (every piece's bytes checked); real
NIXL between processes: tests/test_nixl_process.py."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from xavier_async.errors import InvalidRequestError, PeerLostError
from xavier_async.transports.nixl import NixlTransport
from xavier_async.transports.nixl_copies import PIECE_BYTES, _Pieces

from .test_nixl_unit import FULL, fill, nodes

pytestmark = pytest.mark.asyncio

PIECE = 16 << 10  # FULL (64 KiB) is four pieces


async def delivered(node: Any, want: list[tuple[int, bytes]]) -> None:
    """Until ``node``'s poller has delivered ``want`` (bounded), then exactly that."""
    with anyio.fail_after(5):
        while len(node.host.delivered) < len(want):
            await anyio.sleep(0.001)
    assert node.host.delivered == want


def test_the_piece_size_is_checked_and_is_off_by_default() -> None:
    assert PIECE_BYTES == 0 and NixlTransport().piece_bytes == 0
    with pytest.raises(InvalidRequestError, match="piece_bytes"):
        NixlTransport(piece_bytes=-1)
    with pytest.raises(InvalidRequestError, match="piece_bytes"):
        NixlTransport(piece_bytes=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("nbytes", [FULL, 40_000], ids=["whole_view", "trimmed"])
async def test_a_large_copy_goes_piece_by_piece_and_notifies_once_at_the_end(nbytes: int) -> None:
    async with nodes(2, piece_bytes=PIECE) as (a, b):
        await a.t.connect(b.t.address)
        want = fill(a, 5)
        b.recv.tensor.zero_()
        m = await a.t.map_view(1, a.send.full)
        pending = a.t.post(1, m, nbytes, b"landed")
        assert isinstance(pending, _Pieces)
        # only the first piece went out in the post; no notification yet
        assert torch.equal(b.recv.tensor[:PIECE], want[:PIECE]) and not b.recv.tensor[PIECE:].any()
        assert not b.host.delivered
        await a.t.wait(pending)
        assert torch.equal(b.recv.tensor[:nbytes], want[:nbytes]) and not b.recv.tensor[nbytes:].any()
        await delivered(b, [(0, b"landed")])
        pieces = -(-nbytes // PIECE)
        assert a.t.pieces == (1, pieces)
        # each piece has its own handle (offsets on both sides), made once and re-posted
        assert [h.local[0][1] for h in m.pieces.values()] == [min(PIECE, nbytes - o) for o in range(0, nbytes, PIECE)]
        made = len(a.agent.live)
        await a.t.wait(a.t.post(1, m, nbytes, b"again"))
        assert len(a.agent.live) == made and a.t.pieces == (2, 2 * pieces)
        await delivered(b, [(0, b"landed"), (0, b"again")])
        await a.t.forget(1)  # the channel is reset: the pieces' handles go too
        assert a.agent.live == set() and a.agent.errors == []


async def test_small_copies_and_zero_piece_bytes_post_whole() -> None:
    async with nodes(2, piece_bytes=0) as (a, b):
        await a.t.connect(b.t.address)
        want = fill(a, 6)
        m = await a.t.map_view(1, a.send.full)
        assert a.t.post(1, m, FULL, None) is None  # whole, landed in the post
        assert torch.equal(b.recv.tensor, want) and a.t.pieces == (0, 0)
    async with nodes(2, piece_bytes=PIECE) as (a, b):
        await a.t.connect(b.t.address)
        m = await a.t.map_view(1, a.send.full)
        assert a.t.post(1, m, PIECE, None) is None  # not larger than a piece
        assert a.t.pieces == (0, 0)


async def test_a_piece_in_flight_is_polled_before_the_next_is_posted() -> None:
    from .fake_nixl import FakeFabric

    fabric = FakeFabric()
    async with nodes(2, fabric, piece_bytes=PIECE) as (a, b):
        await a.t.connect(b.t.address)
        want = fill(a, 7)
        b.recv.tensor.zero_()
        m = await a.t.map_view(1, a.send.full)
        fabric.hold_copies = True
        pending = a.t.post(1, m, FULL, b"landed")
        assert isinstance(pending, _Pieces) and a.t.unsettled() == {1}
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.t.wait, pending)
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert a.t.pieces == (1, 1) and not b.recv.tensor.any()  # waits for piece 0
            fabric.hold_copies = False
            a.agent.finish()
        assert torch.equal(b.recv.tensor, want) and a.t.pieces == (1, 4)
        assert a.t.unsettled() == set()
        await delivered(b, [(0, b"landed")])


async def test_no_piece_is_posted_after_the_peer_is_lost() -> None:
    async with nodes(2, piece_bytes=PIECE) as (a, b):
        await a.t.connect(b.t.address)
        fill(a, 8)
        b.recv.tensor.zero_()
        m = await a.t.map_view(1, a.send.full)
        pending = a.t.post(1, m, FULL, b"landed")
        assert isinstance(pending, _Pieces)
        pending.peer.lost = True  # as the liveness watch marks it
        with pytest.raises(PeerLostError):
            await a.t.wait(pending)
        assert a.t.pieces == (1, 1) and not b.recv.tensor[PIECE:].any()
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert not b.host.delivered
        assert a.t.unsettled() == set()


async def test_a_token_of_another_kind_is_refused() -> None:
    async with nodes(1, piece_bytes=PIECE) as (a,):
        with pytest.raises(InvalidRequestError):
            await a.t.wait(object())


async def test_a_piece_that_notified_once_never_sends_its_notification_again() -> None:
    """NIXL re-sends a handle's last notification when it is re-posted with an empty one
    (the fake does as NIXL 1.5.1 was measured to). The last piece of a 2-piece copy is a
    middle piece of the next, longer copy: it must not land the first copy's "landed"
    again before the second copy's bytes are all there."""
    async with nodes(2, piece_bytes=PIECE) as (a, b):
        await a.t.connect(b.t.address)
        want = fill(a, 9)
        m = await a.t.map_view(1, a.send.full)
        await a.t.wait(a.t.post(1, m, 2 * PIECE, b"first"))
        await delivered(b, [(0, b"first")])
        b.recv.tensor.zero_()
        await a.t.wait(a.t.post(1, m, FULL, b"second"))
        await delivered(b, [(0, b"first"), (0, b"second")])
        assert torch.equal(b.recv.tensor, want)
        want = fill(a, 10)
        b.recv.tensor.zero_()
        await a.t.wait(a.t.post(1, m, FULL, None))      # a bare copy in pieces: silent
        assert torch.equal(b.recv.tensor, want)
        want = fill(a, 11)
        b.recv.tensor.zero_()
        assert a.t.post(1, m, PIECE, None) is None      # and a bare whole copy
        assert torch.equal(b.recv.tensor[:PIECE], want[:PIECE]) and not b.recv.tensor[PIECE:].any()
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert b.host.delivered == [(0, b"first"), (0, b"second")]
        await a.t.forget(1)
        assert a.agent.live == set() and a.agent.errors == []

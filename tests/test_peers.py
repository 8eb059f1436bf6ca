"""The peer table (:mod:`xavier_async.peers`): one record per peer, changed in one place
when it joins, is lost or is forgotten; and an endpoint's view of it over a connection's
life (epochs grow, a lost peer's loads say so, a disconnect forgets it)."""

from __future__ import annotations

import pytest
import torch

from xavier_async import PeerLostError, UnknownPeerError
from xavier_async.peers import PeerTable
from xavier_async.protocol import PeerFacts

from .conftest import SMALL_CFG, cluster


class _Channel:
    """Stands in for a PeerChannel: the table only stores it."""


def _facts(epoch: int, inc: str = "i1") -> PeerFacts:
    return PeerFacts(incarnation=inc, epoch_as_receiver=epoch, min_epoch=epoch, writes_unsettled=False)


def test_join_lose_forget_change_one_record():
    table = PeerTable(0)
    ch1 = _Channel()
    assert table.join(1, {"rank": 1}, _facts(1), ch1) is None  # type: ignore[arg-type]
    assert table.connected(1) is ch1 and table.ranks == (1,) and table.epoch(1) == 1
    assert table.lose(1, "gone (test)") is ch1
    assert table.connected(1) is None and table.ranks == ()
    with pytest.raises(PeerLostError, match="gone"):
        raise table.not_connected(1)
    assert table.get(1).hello == {} and table.incarnation(1) == "i1"   # kept: fences name it
    table.forget(1)                                                    # an explicit disconnect
    assert isinstance(table.not_connected(1), UnknownPeerError)
    assert table.epochs() == {1: 1}                                    # the next epoch is newer
    ch2 = _Channel()
    assert table.join(1, {"rank": 1}, _facts(2, "i2"), ch2) is None  # type: ignore[arg-type]
    assert table.epoch(1) == 2 and table.incarnation(1) == "i2"
    ch3 = _Channel()
    assert table.join(1, {"rank": 1}, _facts(3, "i3"), ch3) is ch2  # type: ignore[arg-type]
    assert table.lose(7, "never known") is None
    with pytest.raises(UnknownPeerError):
        table.channel(7)


@pytest.mark.anyio
async def test_an_endpoint_keeps_one_record_per_peer_across_reconnects():
    cs = [{0: torch.zeros(8, 16)}, {0: torch.zeros(8, 16)}]
    async with cluster(cs, SMALL_CFG) as (a, b):
        first = a._peers.epoch(1)
        assert a.peers == (1,) and b._peers.min_epoch(0) == first
        await a._on_timeout(1, PeerLostError("rank 1 lost (test)"))   # lost, connection dropped
        with pytest.raises(PeerLostError, match="was lost"):
            await a.load({1: {0: {0: 0}}})
        await a.connect(b.address)
        assert a._peers.epoch(1) == first + 1 and a.peers == (1,)
        await a.disconnect(1)
        with pytest.raises(UnknownPeerError):
            await a.load({1: {0: {0: 0}}})

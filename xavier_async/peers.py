"""The peer table: one record per peer an endpoint has known.

A record holds the peer's channel (while connected), what it said in its hello, the
epochs of the pair (our requests' epoch as its receiver, the oldest epoch of its requests
we serve as its source), its endpoint instance (kept after it is lost: fences name it)
and, once lost, why. Joining, losing and forgetting a peer each change one record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .channel import PeerChannel
from .errors import PeerLostError, UnknownPeerError, XavierError
from .protocol import PeerFacts


@dataclass(eq=False, slots=True)
class PeerRecord:
    """What one endpoint knows of one peer rank."""

    rank: int
    #: the epoch our requests to it carry (its view of us plus one, set when it joins)
    epoch: int = 0
    #: the oldest epoch of its requests we serve
    min_epoch: int = 0
    #: its endpoint instance (a restarted process has a new one)
    incarnation: str = ""
    #: our channel to it, while it is connected
    channel: PeerChannel | None = None
    #: what it said about itself when it connected (``{}`` once it is gone)
    hello: dict[str, Any] = field(default_factory=dict)
    #: why it was lost (its loads fail with PeerLostError until it reconnects or is
    #: disconnected); ``None`` while connected or forgotten
    lost: str | None = None


class PeerTable:
    """The peers of rank ``rank``, by rank."""

    __slots__ = ("rank", "_records")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._records: dict[int, PeerRecord] = {}

    def get(self, rank: int) -> PeerRecord | None:
        return self._records.get(rank)

    def join(self, rank: int, hello: dict[str, Any], facts: PeerFacts,
             channel: PeerChannel) -> PeerChannel | None:
        """``rank`` connected (again): a new channel and the pair's new epochs. Returns
        the channel it replaces, if any (a restarted peer)."""
        rec = self._records.get(rank)
        if rec is None:
            rec = self._records[rank] = PeerRecord(rank)
        old = rec.channel
        rec.epoch, rec.min_epoch = facts.epoch_as_receiver, facts.min_epoch
        rec.incarnation = facts.incarnation
        rec.channel, rec.hello, rec.lost = channel, hello, None
        return old

    def lose(self, rank: int, reason: str) -> PeerChannel | None:
        """``rank`` is gone (or we dropped it): its channel leaves the table (returned, for
        a reset) and, if it was connected, its loads fail from now on with ``reason``."""
        rec = self._records.get(rank)
        if rec is None or rec.channel is None:
            return None
        ch, rec.channel, rec.hello, rec.lost = rec.channel, None, {}, reason
        return ch

    def forget(self, rank: int) -> None:
        """An explicit disconnect: the peer is unknown from now on (its epochs are kept,
        so a later connection starts a newer epoch)."""
        rec = self._records.get(rank)
        if rec is not None:
            rec.lost = None

    def connected(self, rank: int) -> PeerChannel | None:
        """Our channel to ``rank`` (``None`` unless it is connected)."""
        rec = self._records.get(rank)
        return rec.channel if rec is not None else None

    def channel(self, rank: int) -> PeerChannel:
        """Our channel to ``rank``, or :class:`UnknownPeerError`."""
        ch = self.connected(rank)
        if ch is None:
            raise UnknownPeerError(f"rank {rank} is not connected to rank {self.rank}")
        return ch

    def not_connected(self, rank: int) -> XavierError:
        """Why ``rank`` cannot be loaded from: lost (until it reconnects) or unknown."""
        rec = self._records.get(rank)
        if rec is not None and rec.lost is not None:
            return PeerLostError(f"rank {rank} was lost ({rec.lost}); reconnect it, or "
                                 "disconnect() it to forget it")
        return UnknownPeerError(f"rank {rank} is not connected to rank {self.rank}")

    def epoch(self, rank: int) -> int:
        rec = self._records.get(rank)
        return rec.epoch if rec is not None else 0

    def min_epoch(self, rank: int) -> int:
        rec = self._records.get(rank)
        return rec.min_epoch if rec is not None else 0

    def incarnation(self, rank: int) -> str:
        rec = self._records.get(rank)
        return rec.incarnation if rec is not None else ""

    def epochs(self) -> dict[int, int]:
        """Our epoch with every peer we have known (the hello carries them)."""
        return {r: rec.epoch for r, rec in self._records.items() if rec.epoch}

    @property
    def ranks(self) -> tuple[int, ...]:
        """The connected peers, sorted."""
        return tuple(sorted(r for r, rec in self._records.items() if rec.channel is not None))

    def channels(self) -> list[PeerChannel]:
        return [rec.channel for rec in self._records.values() if rec.channel is not None]


__all__ = ["PeerRecord", "PeerTable"]

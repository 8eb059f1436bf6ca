"""Who holds which block: the scheduler's view of its peers (pure: no I/O, no threads).

Fed by the peers' announcements (:class:`~xavier_async.protocol.Announce`: published,
evicted, or a whole replacement) and by what the worker learns (a peer joined, was lost,
or failed to serve some keys); read by ``get_num_new_matched_tokens``, which must not
block. An entry may be stale (the peer evicted the block a moment ago, or died): the
load then fails and vLLM recomputes those blocks, so a stale entry costs time, never a
wrong token. The caller serializes access (the connector holds one lock around it)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hit:
    """The longest run of blocks one peer holds: ``keys[start:start + blocks]``."""

    peer: int
    start: int
    blocks: int


class Directory:
    """Block key -> the peers that announced it, and each peer's keys."""

    __slots__ = ("_holders", "_held", "updates")

    def __init__(self) -> None:
        self._holders: dict[object, set[int]] = {}
        self._held: dict[int, set[object]] = {}
        #: how many updates were applied (the feed's health, for stats)
        self.updates = 0

    def published(self, peer: int, keys: Iterable[object]) -> None:
        held = self._held.setdefault(peer, set())
        for key in keys:
            self._holders.setdefault(key, set()).add(peer)
            held.add(key)
        self.updates += 1

    def evicted(self, peer: int, keys: Iterable[object]) -> None:
        held = self._held.get(peer)
        if held is None:
            return
        for key in keys:
            if key in held:
                held.discard(key)
                self._drop(key, peer)
        self.updates += 1

    def replace(self, peer: int, keys: Iterable[object]) -> None:
        """``peer`` holds exactly ``keys`` (a join, or a resync)."""
        self.gone(peer)
        self.published(peer, keys)

    def gone(self, peer: int) -> None:
        """``peer`` holds nothing any more (lost, or restarted)."""
        for key in self._held.pop(peer, ()):
            self._drop(key, peer)
        self.updates += 1

    def _drop(self, key: object, peer: int) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(peer)
            if not holders:
                del self._holders[key]

    def holders(self, key: object) -> frozenset[int]:
        return frozenset(self._holders.get(key, ()))

    def keys_of(self, peer: int) -> frozenset[object]:
        return frozenset(self._held.get(peer, ()))

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(p for p, keys in self._held.items() if keys))

    def __len__(self) -> int:
        return len(self._holders)

    def longest(self, keys: Sequence[object], start: int, limit: int) -> Hit | None:
        """The longest run ``keys[start:start + n]`` (``n <= limit``) that one peer holds
        whole, or ``None``; of equally long runs, the lowest rank's."""
        if start < 0 or limit <= 0 or start >= len(keys):
            return None
        alive = set(self._holders.get(keys[start], ()))
        if not alive:
            return None
        n = 1
        end = min(len(keys), start + limit)
        while start + n < end:
            nxt = alive & self._holders.get(keys[start + n], set())
            if not nxt:
                break
            alive = nxt
            n += 1
        return Hit(min(alive), start, n)


__all__ = ["Directory", "Hit"]

"""Where each published block sits in the snapshot store: tiers, leases and the LRU
(pure: no tensors, no I/O; the shell's :mod:`xavier_async.snapshots` does the copies).

The store has two tiers of fixed-size block slots: the *device* tier (on the caches'
device: GPU memory on CUDA) and the *host* tier (DRAM, pinned on CUDA). A slot is named
by one global index: device slots ``0 .. device_slots - 1``, host slots after them. A
block is *ready* once every layer is staged in its slot; a *leased* block (a copy is
reading it) is never evicted nor moved. Admission, as the seed's tiered store does it:

* a new block goes to a free device slot;
* if the device tier is full, its least recently used unleased block is demoted to a
  free host slot (if the host tier is full too, that block is dropped: evicted), and the
  new block takes its device slot;
* if no device slot can be freed, the new block goes to a free host slot;
* else it is skipped (and counted): it stays loadable from nowhere, the caller is told.

:meth:`SnapshotIndex.admit` returns that plan; the shell copies the bytes and then
confirms it (:meth:`SnapshotIndex.commit`), so the index never names a slot whose bytes
are not there.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from .errors import InternalError
from .layout import BlockKey

DEVICE: Final = 0
HOST: Final = 1
TIER_NAMES: Final = ("device", "host")


@dataclass(frozen=True, slots=True)
class Move:
    """A block copied from one slot to another (a demotion: device to host)."""

    key: BlockKey
    src: int
    dst: int


@dataclass(slots=True)
class Admission:
    """What admitting new keys takes: ``demote`` (copy each, then the key moves), ``drop``
    (evicted: their slots are reused), ``place`` (key -> slot for each new block, adjacent
    slots where possible) and ``skip`` (no room: not stored)."""

    place: dict[BlockKey, int] = field(default_factory=dict)
    demote: list[Move] = field(default_factory=list)
    drop: list[BlockKey] = field(default_factory=list)
    skip: list[BlockKey] = field(default_factory=list)


class SnapshotIndex:
    """The store's bookkeeping: key -> slot, free slots per tier, LRU order, leases."""

    def __init__(self, device_slots: int, host_slots: int) -> None:
        if device_slots < 0 or host_slots < 0:
            raise InternalError("a tier cannot have a negative number of slots")
        self.device_slots, self.host_slots = device_slots, host_slots
        self._where: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        #: per tier: keys from least to most recently used
        self._lru: tuple[OrderedDict[BlockKey, None], ...] = (OrderedDict(), OrderedDict())
        #: per tier: the free slots (never used ones are implicit, from the mark on)
        self._free = (_FreeSlots(0, device_slots), _FreeSlots(device_slots, device_slots + host_slots))
        #: slot -> copies reading it
        self._leases: dict[int, int] = {}
        #: slots planned by admit() and not yet committed (held back from everything else)
        self._planned: set[int] = set()
        #: blocks stored, demoted, dropped (evicted) and skipped, ever
        self.stored = self.demoted = self.dropped = self.skipped = 0

    # -- lookups ------------------------------------------------------------------------
    def tier_of(self, slot: int) -> int:
        return DEVICE if slot < self.device_slots else HOST

    def slot(self, key: BlockKey) -> int | None:
        return self._where.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def keys(self, tier: int | None = None) -> list[BlockKey]:
        if tier is None:
            return list(self._where)
        return list(self._lru[tier])

    def used(self, tier: int) -> int:
        return len(self._lru[tier])

    def touch(self, key: BlockKey) -> None:
        """``key`` was used (served): most recently used in its tier."""
        slot = self._where.get(key)
        if slot is not None:
            self._lru[self.tier_of(slot)].move_to_end(key)

    # -- leases -------------------------------------------------------------------------
    def lease(self, slots: Iterable[int]) -> None:
        """A copy reads these slots: their blocks are neither evicted nor moved until
        :meth:`release` (a slot may be leased by several copies)."""
        leases = self._leases
        for s in slots:
            leases[s] = leases.get(s, 0) + 1

    def release(self, slots: Iterable[int]) -> None:
        leases = self._leases
        for s in slots:
            n = leases.get(s, 0) - 1
            if n < 0:
                raise InternalError(f"snapshot slot {s} released more often than leased")
            if n:
                leases[s] = n
            else:
                del leases[s]

    @property
    def leased(self) -> int:
        """Slots leased now."""
        return len(self._leases)

    # -- admission ----------------------------------------------------------------------
    def _victim(self, tier: int) -> BlockKey | None:
        """The least recently used block of ``tier`` that no copy reads."""
        for key in self._lru[tier]:
            if self._where[key] not in self._leases:
                return key
        return None

    def _take(self, tier: int, want: int | None) -> int | None:
        """A free slot of ``tier``: ``want`` (the one after the last placed, so blocks
        published together sit side by side) if it is free, else the lowest one that no
        copy still reads (a freed slot can be leased until its last reader is done: the
        shell waits for that before it writes one that is)."""
        return self._free[tier].take(want, self._leases)

    def admit(self, keys: Sequence[BlockKey]) -> Admission:
        """Plan the admission of ``keys`` (new ones; a key already stored is placed again:
        its old slot is freed once the new one is committed). The planned slots are held
        until :meth:`commit` or :meth:`abort`."""
        plan = Admission()
        nxt: int | None = None
        for key in dict.fromkeys(keys):
            slot = self._take(DEVICE, nxt)
            if slot is None:
                victim = self._victim(DEVICE)
                if victim is not None:
                    vslot = self._where[victim]
                    host = self._take(HOST, None)
                    self._forget(victim)
                    if host is not None:
                        plan.demote.append(Move(victim, vslot, host))
                        self._planned.add(host)
                    else:
                        plan.drop.append(victim)
                    slot = vslot
                else:
                    slot = self._take(HOST, nxt)
            if slot is None:
                plan.skip.append(key)
                nxt = None
                continue
            plan.place[key] = slot
            self._planned.add(slot)
            nxt = slot + 1
        return plan

    def commit(self, plan: Admission, staged: Iterable[BlockKey] | None = None) -> list[BlockKey]:
        """The copies of ``plan`` are done: demoted blocks live in their host slots,
        ``staged`` keys (all placed ones by default; a key whose staging failed is left
        out, its slot freed) in theirs. Returns the keys whose old slot was replaced."""
        for m in plan.demote:
            self._set(m.key, m.dst)
            self._planned.discard(m.dst)
            self.demoted += 1
        self.dropped += len(plan.drop)
        self.skipped += len(plan.skip)
        done = set(plan.place if staged is None else staged)
        replaced = []
        for key, slot in plan.place.items():
            self._planned.discard(slot)
            if key not in done:
                self._free[self.tier_of(slot)].put(slot)
                continue
            old = self._where.get(key)
            if old is not None:  # published again: its old slot is free
                replaced.append(key)
                self._forget(key)
                self._free[self.tier_of(old)].put(old)
            self._set(key, slot)
            self.stored += 1
        return replaced

    def abort(self, plan: Admission) -> None:
        """Nothing of ``plan`` was copied: demoted and dropped blocks are gone (their
        device slots were about to be overwritten), the planned slots are free again."""
        for m in plan.demote:
            self._planned.discard(m.dst)
            self._free[HOST].put(m.dst)
        self.dropped += len(plan.demote) + len(plan.drop)
        for slot in plan.place.values():
            self._planned.discard(slot)
            self._free[self.tier_of(slot)].put(slot)

    def remove(self, key: BlockKey) -> bool:
        """Stop storing ``key`` (unpublished); its slot is free again (a copy may still
        read it: see :meth:`_take`)."""
        slot = self._where.get(key)
        if slot is None:
            return False
        self._forget(key)
        self._free[self.tier_of(slot)].put(slot)
        return True

    def is_leased(self, slot: int) -> bool:
        return slot in self._leases

    def _set(self, key: BlockKey, slot: int) -> None:
        self._where[key] = slot
        self._key_of[slot] = key
        self._lru[self.tier_of(slot)][key] = None

    def _forget(self, key: BlockKey) -> None:
        slot = self._where.pop(key)
        del self._key_of[slot]
        del self._lru[self.tier_of(slot)][key]

    def check(self) -> None:
        """Raise :class:`InternalError` unless every slot is in exactly one place: holding
        one key, free, or planned."""
        held = set(self._key_of)
        for free in self._free:
            used = held | self._planned
            if any(free.is_free(s) for s in used):
                raise InternalError("a snapshot slot is both held (or planned) and free")
            if any(s >= free.mark or s < free.first for s in free.freed) or \
                    any(not (free.first <= s < free.mark) for s in used if free.first <= s < free.end):
                raise InternalError("a snapshot slot is lost")
            if len(used & set(range(free.first, free.mark))) + len(free.freed) != free.mark - free.first:
                raise InternalError("a snapshot slot is lost")
        if held & self._planned:
            raise InternalError("a snapshot slot is both held and planned")
        for tier in (DEVICE, HOST):
            for key in self._lru[tier]:
                if self.tier_of(self._where[key]) != tier:
                    raise InternalError(f"block {key!r} is listed in the wrong tier")
        if {self._key_of[s] for s in held} != set(self._where):
            raise InternalError("the key and slot maps disagree")

    def stats(self) -> dict[str, int]:
        return {"device_slots": self.device_slots, "host_slots": self.host_slots,
                "device_used": self.used(DEVICE), "host_used": self.used(HOST),
                "leased": self.leased, "stored": self.stored, "demoted": self.demoted,
                "evicted": self.dropped, "skipped": self.skipped}


class _FreeSlots:
    """The free slots of one tier ``[first, end)``: those never used (from ``mark`` on,
    implicit: a tier of millions of small blocks costs nothing until it fills) and those
    freed since (a heap, lowest first)."""

    __slots__ = ("first", "end", "mark", "freed", "_heap")

    def __init__(self, first: int, end: int) -> None:
        self.first, self.end, self.mark = first, end, first
        self.freed: set[int] = set()
        self._heap: list[int] = []

    def __len__(self) -> int:
        return self.end - self.mark + len(self.freed)

    def is_free(self, slot: int) -> bool:
        return slot >= self.mark and slot < self.end or slot in self.freed

    def put(self, slot: int) -> None:
        if slot in self.freed or not self.first <= slot < self.mark:
            raise InternalError(f"snapshot slot {slot} freed twice")
        self.freed.add(slot)
        heapq.heappush(self._heap, slot)

    def take(self, want: int | None, leased: Container[int]) -> int | None:
        """``want`` if it is free and unleased, else the lowest freed slot no copy reads,
        else the next never-used one, else a leased freed one (the caller waits for it).
        The heap may hold slots taken since (``freed`` is the truth): they are skipped."""
        if want is not None and want not in leased:
            if want == self.mark and want < self.end:
                self.mark += 1
                return want
            if want in self.freed:
                self.freed.discard(want)
                return want
        heap, got = self._heap, None
        aside: list[int] = []
        while heap and len(aside) < 8:
            slot = heapq.heappop(heap)
            if slot not in self.freed:
                continue  # taken since it was freed
            if slot in leased:
                aside.append(slot)
                continue
            got = slot
            break
        for slot in aside:
            heapq.heappush(heap, slot)
        if got is None and self.mark < self.end:
            got = self.mark
            self.mark += 1
        elif got is None and aside:
            got = aside[0]
        if got is not None:
            self.freed.discard(got)
        return got


__all__ = ["SnapshotIndex", "Admission", "Move", "DEVICE", "HOST", "TIER_NAMES"]

"""Per-stage timing of loads, always on (pure core: no I/O, no event loop).

Each stage of a load is a :class:`StageHistogram` fed with integer ``perf_counter_ns``
deltas. Buckets are fixed at construction (8 per power of two, so a percentile is within
~6% of the true value): recording is a few integer operations and one list item
increment, and memory never grows with the number of loads. ::

    t0 = perf_counter_ns()
    ...plan...
    t1 = perf_counter_ns()
    stages.plan.record(t1 - t0)

:class:`LoadStages` holds one histogram per stage, receiver and source side, and is what
``Endpoint.snapshot_metrics()["stages"]`` shows (:meth:`LoadStages.as_dict`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

#: sub-buckets per power of two (8: bucket width <= 1/8 of its lower bound)
_SUB_BITS: Final = 3
_SUB: Final = 1 << _SUB_BITS
#: buckets: exact below 16 ns, then 8 per octave up to 2**47 ns (39 hours; larger clamp)
NBUCKETS: Final = 8 * 48

#: receiver stages, in the order a load goes through them
RECEIVER_STAGES: Final = ("plan", "post", "wait", "unpack", "total")
#: source stages: arrival to serve start, slot lookup, packing, post until the copy is DONE
SOURCE_STAGES: Final = ("queue", "lookup", "pack", "post_to_done")
STAGES: Final = RECEIVER_STAGES + SOURCE_STAGES


def bucket_of(ns: int) -> int:
    """The bucket index of a duration in nanoseconds (negative counts as 0)."""
    if ns < 2 * _SUB:
        return ns if ns > 0 else 0
    bl = ns.bit_length()
    i = (bl << _SUB_BITS) - 4 * _SUB + (ns >> (bl - _SUB_BITS - 1))
    return i if i < NBUCKETS else NBUCKETS - 1


def bucket_bounds(i: int) -> tuple[int, int]:
    """``[low, high)`` nanoseconds of bucket ``i``."""
    if i < 2 * _SUB:
        return i, i + 1
    q = i + 4 * _SUB
    bl = (q >> _SUB_BITS) - 1
    shift = bl - _SUB_BITS - 1
    low = (_SUB + (q & (_SUB - 1))) << shift
    return low, low + (1 << shift)


class StageHistogram:
    """Counts of durations in fixed buckets, plus count, sum and max (all plain ints)."""

    __slots__ = ("counts", "n", "sum_ns", "max_ns")

    def __init__(self) -> None:
        self.counts: list[int] = [0] * NBUCKETS
        self.n = 0
        self.sum_ns = 0
        self.max_ns = 0

    def record(self, ns: int) -> None:
        """Add one duration (an ``int`` of nanoseconds: a ``perf_counter_ns`` delta)."""
        if ns < 16:
            i = ns if ns > 0 else 0
        else:
            bl = ns.bit_length()
            i = (bl << 3) - 32 + (ns >> (bl - 4))
            if i >= NBUCKETS:
                i = NBUCKETS - 1
        self.counts[i] += 1
        self.n += 1
        self.sum_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns

    def percentile(self, q: float) -> float:
        """The ``q``-quantile (0 < q <= 1) in nanoseconds: the middle of its bucket (never
        above the largest recorded value); 0.0 when empty."""
        if not self.n:
            return 0.0
        rank = max(1, math.ceil(q * self.n))
        seen = 0
        for i, c in enumerate(self.counts):
            if c:
                seen += c
                if seen >= rank:
                    low, high = bucket_bounds(i)
                    return min((low + high - 1) / 2, float(self.max_ns))
        return float(self.max_ns)  # pragma: no cover - rank <= n always lands above

    @property
    def p50_us(self) -> float:
        return self.percentile(0.5) / 1e3

    @property
    def p99_us(self) -> float:
        return self.percentile(0.99) / 1e3

    @property
    def mean_us(self) -> float:
        return self.sum_ns / self.n / 1e3 if self.n else 0.0

    def reset(self) -> None:
        counts = self.counts
        for i in range(NBUCKETS):
            counts[i] = 0
        self.n = self.sum_ns = self.max_ns = 0

    def copy(self) -> StageHistogram:
        out = StageHistogram()
        out.counts[:] = self.counts
        out.n, out.sum_ns, out.max_ns = self.n, self.sum_ns, self.max_ns
        return out

    def minus(self, earlier: StageHistogram) -> StageHistogram:
        """What was recorded since ``earlier`` (a :meth:`copy` of this histogram). The
        difference's max is this histogram's max (an upper bound)."""
        out = StageHistogram()
        out.counts[:] = [a - b for a, b in zip(self.counts, earlier.counts)]
        out.n = self.n - earlier.n
        out.sum_ns = self.sum_ns - earlier.sum_ns
        out.max_ns = self.max_ns if out.n else 0
        return out

    def as_dict(self) -> dict[str, Any]:
        """``n``, ``p50_us``, ``p99_us``, ``mean_us``, ``max_us`` and the non-empty
        ``buckets`` as ``[[index, count], ...]`` (enough to rebuild it: :meth:`from_dict`)."""
        return {"n": self.n, "p50_us": self.p50_us, "p99_us": self.p99_us,
                "mean_us": self.mean_us, "max_us": self.max_ns / 1e3, "sum_ns": self.sum_ns,
                "buckets": [[i, c] for i, c in enumerate(self.counts) if c]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageHistogram:
        out = cls()
        for i, c in d.get("buckets", ()):
            out.counts[int(i)] = int(c)
        out.n = int(d.get("n", 0))
        out.sum_ns = int(d.get("sum_ns", 0))
        out.max_ns = int(round(float(d.get("max_us", 0.0)) * 1e3))
        return out


class LoadStages:
    """One :class:`StageHistogram` per stage, as attributes named after :data:`STAGES`.

    Receiver (``Endpoint.load``, per batch except ``plan`` and ``total``, per load):
    ``plan`` (validate + plan the request), ``post`` (encode and send the request),
    ``wait`` (request sent until the source's reply arrived), ``unpack`` (slab into cache
    slots, including waiting for the device when it is synchronized), ``total`` (the
    whole ``load()`` call). Source (per served request): ``queue`` (request arrived until
    serving started: 0 when served inline by the poller), ``lookup`` (keys to published
    slots), ``pack`` (caches into the send slab), ``post_to_done`` (copy posted until its
    transfer reached DONE)."""

    __slots__ = STAGES

    plan: StageHistogram
    post: StageHistogram
    wait: StageHistogram
    unpack: StageHistogram
    total: StageHistogram
    queue: StageHistogram
    lookup: StageHistogram
    pack: StageHistogram
    post_to_done: StageHistogram

    def __init__(self) -> None:
        for name in STAGES:
            setattr(self, name, StageHistogram())

    def __getitem__(self, name: str) -> StageHistogram:
        if name not in STAGES:
            raise KeyError(name)
        h: StageHistogram = getattr(self, name)
        return h

    def items(self) -> Iterable[tuple[str, StageHistogram]]:
        return ((name, getattr(self, name)) for name in STAGES)

    def reset(self) -> None:
        for _, h in self.items():
            h.reset()

    def copy(self) -> LoadStages:
        out = LoadStages()
        for name, h in self.items():
            setattr(out, name, h.copy())
        return out

    def minus(self, earlier: LoadStages) -> LoadStages:
        """Per stage, what was recorded since ``earlier`` (a :meth:`copy`)."""
        out = LoadStages()
        for name, h in self.items():
            setattr(out, name, h.minus(earlier[name]))
        return out

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """``{"receiver": {stage: histogram dict}, "source": {...}}``."""
        return {"receiver": {s: self[s].as_dict() for s in RECEIVER_STAGES},
                "source": {s: self[s].as_dict() for s in SOURCE_STAGES}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoadStages:
        """Rebuild from :meth:`as_dict` (missing stages stay empty)."""
        out = cls()
        for side in ("receiver", "source"):
            for name, h in d.get(side, {}).items():
                if name in STAGES:
                    setattr(out, name, StageHistogram.from_dict(h))
        return out


__all__ = ["NBUCKETS", "RECEIVER_STAGES", "SOURCE_STAGES", "STAGES", "StageHistogram",
           "LoadStages", "bucket_of", "bucket_bounds"]

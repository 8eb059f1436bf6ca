"""Per-stage timing histograms: bucket math, percentiles, diffs and the metrics snapshot."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from xavier_async.metrics import EndpointMetrics
from xavier_async.stages import (NBUCKETS, RECEIVER_STAGES, SOURCE_STAGES, STAGES, LoadStages,
                                 StageHistogram, bucket_bounds, bucket_of)


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 2 ** 46))
def test_bucket_contains_its_value_and_is_narrow(ns):
    i = bucket_of(ns)
    low, high = bucket_bounds(i)
    assert low <= ns < high
    assert high - low <= max(1, low // 8)          # 8 buckets per octave
    h = StageHistogram()
    h.record(ns)
    assert h.counts[i] == 1 and h.n == 1 and h.sum_ns == ns  # record() agrees with bucket_of


def test_buckets_are_contiguous_and_clamped():
    for i in range(NBUCKETS - 1):
        assert bucket_bounds(i)[1] == bucket_bounds(i + 1)[0]
    assert bucket_of(2 ** 62) == NBUCKETS - 1 and bucket_of(-5) == 0
    h = StageHistogram()
    h.record(2 ** 62)
    h.record(-3)                                   # a clock oddity never raises
    assert h.counts[NBUCKETS - 1] == 1 and h.counts[0] == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 10 ** 9), min_size=1, max_size=300))
def test_percentiles_within_a_bucket_of_the_exact_value(values):
    h = StageHistogram()
    for v in values:
        h.record(v)
    s = sorted(values)
    for q in (0.5, 0.99, 1.0):
        exact = s[max(1, math.ceil(q * len(s))) - 1]
        got = h.percentile(q)
        low, high = bucket_bounds(bucket_of(exact))
        assert low - 1 <= got <= high, (q, exact, got)
    assert h.n == len(values) and h.max_ns == max(values)
    assert abs(h.mean_us - sum(values) / len(values) / 1e3) < 1e-6


def test_known_distribution():
    h = StageHistogram()
    for _ in range(98):
        h.record(10_000)       # 10 us
    h.record(1_000_000)        # 1 ms
    h.record(2_000_000)
    assert abs(h.p50_us - 10.0) / 10.0 < 0.07
    assert abs(h.p99_us - 1000.0) / 1000.0 < 0.07
    assert h.percentile(1.0) <= 2_000_000
    assert StageHistogram().p50_us == 0.0 and StageHistogram().as_dict()["n"] == 0


def test_memory_does_not_grow_with_records():
    h = StageHistogram()
    before = len(h.counts)
    for ns in range(0, 10 ** 9, 997_001):
        h.record(ns)
    assert len(h.counts) == before == NBUCKETS


def test_copy_minus_and_round_trip():
    stages = LoadStages()
    for ns in (1_000, 2_000, 3_000):
        stages.plan.record(ns)
    stages.pack.record(50_000)
    before = stages.copy()
    stages.plan.record(100_000)
    stages.total.record(7_000)
    diff = stages.minus(before)
    assert diff.plan.n == 1 and diff.plan.sum_ns == 100_000 and diff.total.n == 1
    assert diff.pack.n == 0 and diff.pack.p50_us == 0.0
    assert before.plan.n == 3                      # a copy does not follow the original
    d = json.loads(json.dumps(stages.as_dict()))   # JSON-able
    assert set(d) == {"receiver", "source"}
    assert list(d["receiver"]) == list(RECEIVER_STAGES) and list(d["source"]) == list(SOURCE_STAGES)
    back = LoadStages.from_dict(d)
    for name in STAGES:
        assert back[name].counts == stages[name].counts and back[name].n == stages[name].n
    stages.reset()
    assert all(h.n == 0 and not any(h.counts) for _, h in stages.items())


def test_endpoint_metrics_expose_stages():
    m = EndpointMetrics()
    m.stages.unpack.record(12_345)
    snap = m.as_dict()
    assert snap["stages"]["receiver"]["unpack"]["n"] == 1
    assert 11.0 < snap["stages"]["receiver"]["unpack"]["p50_us"] < 13.0

"""The bench's packed-vs-descriptor section (raw NIXL, two processes) and its memory check
over real loads: bytes checked at the destination, registrations counted, the rule derived
from the figures; timings reported, never asserted."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from xavier_async.bench import BenchOptions, bench_layout
from xavier_async.bench.descriptors import PATHS, derive_rule, run_descriptors, shapes
from xavier_async.bench.suite import _with_rig, load_memory_growth

FULL = 2 << 20


def test_shapes_have_the_runs_they_claim():
    layout = bench_layout(12 << 20)
    got = {s.name: s for s in shapes(layout, 12 << 20)}
    assert got["one hash x all layers"].blocks == 24 and got["one layer block"].blocks == 1
    assert got["64 hashes consecutive"].slots == tuple(range(64))
    for s in got.values():
        assert len(set(s.slots)) == len(s.slots) and max(s.slots) < layout.num_slots
        if len(s.slots) > 1:  # runs of exactly `run` consecutive slots (the last may be short)
            runs, n = [], 1
            for a, b in zip(s.slots, s.slots[1:]):
                if b == a + 1:
                    n += 1
                else:
                    runs.append(n)
                    n = 1
            runs.append(n)
            assert max(runs) == s.run and all(r == s.run for r in runs[:-1]), (s.name, runs)
    assert len(got["64 hashes consecutive"].slots) * 24 * layout.block_nbytes == 12 << 20


def _row(name: str, slots: int, run: int, packed: float, prepped: float, runs: float,
         unpack: float = 0.0, direct: float = 1e9) -> dict[str, Any]:
    return {"shape": name, "slots": list(range(slots)), "run": run, "layers": 24,
            "packed": {"median_us": packed}, "prepped": {"median_us": prepped},
            "runs": {"median_us": runs}, "unpack": {"median_us": unpack},
            "direct": {"median_us": direct}}


def test_the_rule_comes_from_the_figures():
    rows = [_row("one", 1, 1, 30, 50, 70), _row("s", 64, 1, 400, 900, 800),
            _row("r4", 64, 4, 300, 350, 280), _row("r16", 64, 16, 300, 200, 250),
            _row("c", 64, 64, 300, 150, 160)]
    rule = derive_rule(rows)
    assert rule["min_run"] == 4 and ">= 4 consecutive" in rule["text"]
    assert rule["single_hash"] == {"one": "packed"}
    # a win that is not kept for longer runs does not set the threshold
    rows[2] = _row("r4", 64, 4, 300, 350, 280)
    rows[3] = _row("r16", 64, 16, 300, 310, 320)
    assert derive_rule(rows)["min_run"] == 64
    slower = [_row("one", 1, 1, 30, 20, 70)] + [_row(str(r), 64, r, 10, 20, 30) for r in (1, 4, 64)]
    rule = derive_rule(slower)
    assert rule["min_run"] is None and rule["text"].startswith("packed for every")
    assert rule["single_hash"] == {"one": "descriptor (prepped)"}


def test_the_rule_into_the_slots_counts_the_receivers_unpack():
    """Direct into the peer's slots vs packed + unpack: a direct transfer slower than the
    packed WRITE alone still wins when the unpack it saves costs more than the gap."""
    rows = [_row("one", 1, 1, 30, 50, 70, unpack=10, direct=45),
            _row("s", 64, 1, 400, 900, 800, unpack=300, direct=800),
            _row("c", 64, 64, 300, 150, 160, unpack=200, direct=450)]
    slab, slots = derive_rule(rows), derive_rule(rows, to_slots=True)
    assert slab["min_run"] == 64 and slab["single_hash"] == {"one": "packed"}
    assert slots["min_run"] == 64 and slots["to_slots"]
    assert slots["single_hash"] == {"one": "packed"}  # 45 > 30 + 10
    rows[0] = _row("one", 1, 1, 30, 50, 70, unpack=20, direct=45)
    assert derive_rule(rows, to_slots=True)["single_hash"] == {"one": "descriptor (direct)"}


def test_descriptor_section_over_nixl_checks_bytes_and_counts_registrations():
    pytest.importorskip("nixl")
    d = run_descriptors(FULL, "cpu", quick=True)
    layout = bench_layout(FULL)
    assert d["memory"] == "DRAM"
    # the caches: one registration of one region per layer, at start; the send slab one more
    assert d["cache_registrations"] == 1 and d["cache_regions_registered"] == layout.layers
    assert d["registrations_at_start"] == 2 and d["registrations_after_warmup"] == 0
    assert d["prepped_descriptors"] == {"local": layout.layers * layout.num_slots,
                                        "remote_slab": FULL // layout.block_nbytes,
                                        "remote_caches": layout.layers * layout.num_slots}
    names = [r["shape"] for r in d["shapes"]]
    assert names[:2] == ["one hash x all layers", "one layer block"] and len(names) >= 4
    for r in d["shapes"]:
        assert r["registrations_after_warmup"] == 0
        assert r["bytes"] == r["blocks"] * layout.block_nbytes
        for p in PATHS:  # packed, prepped and runs into the slab, direct into the slots
            assert r[p]["bytes_verified"], (r["shape"], p)
            assert r[p]["median_us"] > 0
        assert r["source_caches_intact"] and r["unpack"]["n"] > 0
        posted = r["nixl_posted_descriptors"]
        if posted is not None:  # NIXL merges adjacent descriptors: never fewer than the runs
            assert r["run_descriptors"] <= posted <= r["blocks"]
    for rule in (d["rule"], d["rule_to_slots"]):
        assert rule["text"] and set(rule["single_hash"]) == set(names[:2])


def test_memory_over_loads_checks_bytes_and_sees_a_leak():
    """The measurement is not blind: loads that keep 256 B each show up as retained."""
    o = BenchOptions(transport="local", full_bytes=FULL, small_bytes=64 << 10, quick=True,
                     alloc_loads=200, descriptors=False)

    async def body(rig: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        clean = await load_memory_growth(rig, o)
        kept: list[bytearray] = []
        real = rig.ep.load

        async def leaky(req: Any) -> Any:
            kept.append(bytearray(256))
            return await real(req)

        rig.ep.load = leaky
        try:
            leaked = await load_memory_growth(rig, o)
        finally:
            rig.ep.load = real
        return clean, leaked

    clean, leaked = anyio.run(_with_rig, o, body)
    assert clean["bytes_verified"] and leaked["bytes_verified"]
    assert clean["loads"] == 200 and clean["device_growth_bytes"] == 0  # DRAM: no device
    assert leaked["python_retained_bytes"] >= 256 * 200
    assert clean["python_retained_bytes"] < leaked["python_retained_bytes"] // 10
    assert any("test_bench_descriptors" in line for line in leaked["python_top_growth"])

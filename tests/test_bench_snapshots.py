"""The bench's snapshot-store section (``xavier-async bench --only-snapshot --quick``) over
real NIXL: a loader and three sources (the store gathering, the store writing directly,
live slots), then direct write vs gather on pool memory. The JSON is complete, every load's
bytes were checked, the store's counters add up, nothing is registered after warm-up, and
the direct-write rule comes from the figures; timings are reported, never asserted."""

from __future__ import annotations

import math
from typing import Any

import pytest

from xavier_async.bench import BenchOptions, bench_layout
from xavier_async.bench.cli import build_parser, main
from xavier_async.bench.pool_paths import derive_region_rule, layer_runs, pool_shapes
from xavier_async.bench.snapshots import NAMES, OUTCOMES, SnapshotSizes, snapshot_tables

from .conftest import run_bench_cli

FULL = 2 << 20
LAYOUT = bench_layout(FULL)
LAYERS = LAYOUT.layers
BLOCK = LAYERS * LAYOUT.block_nbytes


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any) -> tuple[str, dict[str, Any]]:
    pytest.importorskip("nixl")
    stdout, report = run_bench_cli(tmp_path_factory.mktemp("snapshot"), "--only-snapshot")
    return stdout, report


@pytest.fixture(scope="module")
def snap(run: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    s = run[1]["snapshot"]
    assert "error" not in s, s.get("error")
    return s


def test_only_snapshot_prints_its_tables_and_writes_every_field(run, snap):
    stdout, report = run
    assert stdout.lstrip().startswith("xavier-async ") and "snapshot store only" in stdout
    assert "NIXL INFO" not in stdout
    for title in ("one hash over every layer", "Snapshot store tiers", "staging and demotion",
                  "Direct write vs gather on pool memory", "direct_write_regions ="):
        assert title in stdout, title
    assert report["options"]["quick"] and report["options"]["snapshot"]
    for key in ("device", "sizes", "sources", "floor", "copy_floors", "compare", "done_when", "publish",
                "tiers", "as_predicted", "registrations_after_warmup", "loads_checked", "blocks_checked",
                "bytes_verified", "pool_paths", "direct_write_regions"):
        assert key in snap, key
    assert snap["device"] == "cpu" and not snap["gpu_shared"]
    assert snap["block_bytes"] == BLOCK and snap["floor"]["bytes"] == BLOCK
    # every figure has its floor from the same run
    for f in (snap["floor"]["one_hash"], snap["floor"]["one_hash_after"], *snap["copy_floors"].values()):
        assert f["median_us"] > 0 and f["n"] >= 20
    # the sources' configs: the store's tiers are small, live slots have none, all trimmed
    src = snap["sources"]
    assert src["store"]["direct_write_regions"] == 0 and src["store_direct"]["direct_write_regions"] == 1
    assert src["live"]["snapshot_gpu_bytes"] == src["live"]["snapshot_cpu_bytes"] == 0
    assert src["store"]["snapshot_gpu_bytes"] == snap["sizes"]["device_blocks"] * BLOCK
    assert all(c["trimmed"] for c in src.values())


def test_every_load_was_checked_and_nothing_registered_after_warm_up(snap):
    assert snap["bytes_verified"]
    assert snap["registrations_after_warmup"] == {"loader": 0, "store": 0, "store_direct": 0, "live": 0}
    sz = snap["sizes"]
    assert snap["loads_checked"] >= 3 * (sz["compare_loads"] // 3) + sz["tier_loads"]
    served = snap["loads_checked"] - snap["refused_loads_checked"]
    assert snap["blocks_checked"] == LAYERS * served  # every layer of every served load
    assert snap["refused_loads_checked"] >= snap["tiers"]["refused"]["loads"]


def test_one_hash_from_the_device_tier_and_from_live_slots(snap):
    """The comparison the issue's "Done when" reads: each source served the same loads,
    the store's from its device tier (directly, for store_direct), and the source's stage
    histograms recorded them."""
    n = 3 * (snap["sizes"]["compare_loads"] // 3)
    c = snap["compare"]
    assert set(c) == set(NAMES.values())
    for name, x in c.items():
        assert x["loads"] == n and x["load"]["n"] == n
        assert x["wire_bytes_per_load"] == BLOCK  # trimmed: exactly the payload
        for stage in ("pack", "post_to_done"):
            assert x[stage]["n"] >= n and x[stage]["p50_us"] > 0, (name, stage)
        assert x["pack_plus_post_to_done_p50_us"] == pytest.approx(
            x["pack"]["p50_us"] + x["post_to_done"]["p50_us"])
    assert c["store"]["store"] and c["store"]["device_tier_loads"] == n and c["store"]["direct_writes"] == 0
    sd = c["store_direct"]
    assert sd["store"] and sd["device_tier_loads"] == n and sd["direct_writes"] >= n
    assert not c["live"]["store"] and c["live"]["direct_writes"] is None
    assert c["live"]["device_tier_loads"] == 0
    for name in ("store", "store_direct"):
        d = snap["done_when"][name]
        assert isinstance(d["smaller_than_live"], bool)
        assert d["ratio_to_live"] == pytest.approx(d["pack_plus_post_to_done_p50_us"] / d["live_p50_us"])


def test_the_store_counters_add_up_and_every_outcome_was_predicted(snap):
    """Cold: 3 x the device tier published into a device and a host tier of the same size:
    one third demoted, one third evicted. Warm: the host tier's blocks published again, in
    batches: the first batch's victims find no room, the later ones are demoted."""
    sz = snap["sizes"]
    d, h, w, b = sz["device_blocks"], sz["host_blocks"], sz["working_set"], sz["batch"]
    assert (d, h, w) == (8, 8, 24) and w == 3 * d
    cold, warm = snap["publish"]["cold"], snap["publish"]["warm"]
    assert (cold["published"], cold["staged_blocks"], cold["demoted"], cold["evicted"], cold["skipped"]) \
        == (w, w, h, w - d - h, 0)
    assert (warm["published"], warm["staged_blocks"], warm["demoted"], warm["evicted"], warm["skipped"]) \
        == (h, h, h - b, b, 0)
    for p in (cold, warm):
        assert p["calls"] == math.ceil(p["published"] / b)
        assert p["stage_ns_per_block"] > 0 and p["demote_ns_per_block"] > 0
        assert p["stage_ratio_to_copy"] > 0 and p["demotions_per_s"] > 0
    after = snap["store_after"]
    assert after["device_used"] == d and after["host_used"] == h - b and after["leased"] == 0
    t = snap["tiers"]
    assert sum(t[o]["loads"] for o in OUTCOMES) == snap["loads"] == sz["tier_loads"]
    assert all(t[o]["loads"] > 0 for o in OUTCOMES)  # seeded keys: each outcome occurs
    assert sum(t[o]["share"] for o in OUTCOMES) == pytest.approx(1.0)
    for o in OUTCOMES:
        assert t[o]["median_over_floor"] > 0
    assert snap["as_predicted"] and snap["mismatched"] == []


def test_direct_write_vs_gather_on_pool_memory(snap):
    pp = snap["pool_paths"]
    assert pp["memory"] == "DRAM" and pp["registrations_at_start"] == 2
    assert pp["registrations_after_warmup"] == 0
    rows = {r["shape"]: r for r in pp["shapes"]}
    n = min(64, FULL // BLOCK)
    assert rows["1 hash x all layers"]["regions"] == 1 and rows["1 hash x all layers"]["bytes"] == BLOCK
    for r in (2, 4, 8, 12):
        assert rows[f"1 hash x {len(layer_runs(LAYERS, r))} layers in {r} runs"]["regions"] == r
    for k in (2, 4, n):  # layer-major: consecutive store slots are a whole block apart per layer
        assert rows[f"{k} hashes x all layers"]["regions"] == k * LAYERS
    assert rows[f"block-major: {n} hashes consecutive"]["regions"] == 1
    assert rows[f"block-major: {n} hashes scattered"]["regions"] == n
    assert rows[f"block-major: {n} hashes in runs of 4"]["regions"] == math.ceil(n / 4)
    for r in pp["shapes"]:
        assert r["registrations_after_warmup"] == 0
        for p in ("gather", "direct", "direct_cached"):
            assert r[p]["bytes_verified"], (r["shape"], p)
        assert r["raw"]["median_us"] > 0
    rule = pp["rule"]
    assert snap["direct_write_regions"] == pp["direct_write_regions"] == rule["max_regions"]
    assert rule["max_regions"] == 0 or rule["max_regions"] in rule["region_counts"]
    assert derive_region_rule(pp["shapes"]) == rule  # the printed rule is the figures' rule


def _row(regions: int, gather: float, direct: float, block_major: bool = False) -> dict[str, Any]:
    return {"regions": regions, "block_major": block_major, "gather": {"median_us": gather},
            "direct": {"median_us": direct}, "direct_cached": {"median_us": direct / 2}}


def test_the_region_rule_comes_from_the_figures():
    rows = [_row(1, 20, 15), _row(2, 20, 16), _row(8, 20, 19), _row(12, 20, 25), _row(48, 60, 50)]
    rule = derive_region_rule(rows)
    # a win after the first loss (48) does not count: the rule is a prefix of region counts
    assert rule["max_regions"] == 8 and rule["lost_at"] == 12 and "up to 8 region(s)" in rule["text"]
    assert derive_region_rule([_row(1, 20, 21), _row(2, 20, 10)])["max_regions"] == 0
    every = derive_region_rule(rows, "direct_cached")
    assert every["max_regions"] == 48 and every["lost_at"] is None and "every shape" in every["text"]
    assert derive_region_rule(rows, block_major=True)["text"] == "no shape measured"


def test_pool_shapes_and_layer_runs():
    assert layer_runs(24, 12) == tuple(range(0, 24, 2))
    assert layer_runs(24, 2) == tuple(range(11)) + tuple(range(12, 23))
    with pytest.raises(ValueError):
        layer_runs(24, 24)
    names = [s.name for s in pool_shapes(LAYOUT, FULL)]
    assert names[0] == "1 hash x all layers" and sum(n.startswith("block-major") for n in names) == 3


def test_sizes_and_flags(capsys):
    sz = SnapshotSizes.of(BenchOptions(full_bytes=FULL, small_bytes=64 << 10, quick=True), LAYOUT)
    assert sz.working_set == 3 * sz.device_blocks and 2 <= sz.working_set / sz.device_blocks <= 4
    assert build_parser().parse_args(["bench"]).snapshot
    assert not build_parser().parse_args(["bench", "--no-snapshot"]).snapshot
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--no-snapshot", "--only-snapshot"])
    assert main(["bench", "--only-snapshot", "--transport", "local"]) == 2
    assert "over NIXL" in capsys.readouterr().err
    assert main(["bench", "--only-snapshot", "--only-serving"]) == 2
    assert snapshot_tables({"error": "AssertionError: x"})[0][1] == [["AssertionError: x"]]


def test_the_plot_draws_the_section(snap, tmp_path):
    pytest.importorskip("matplotlib")
    from xavier_async.bench.cli import plot
    out = tmp_path / "snap.png"
    plot({"snapshot": snap}, out)
    assert out.stat().st_size > 0

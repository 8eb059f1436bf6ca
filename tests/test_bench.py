"""`xavier-async bench --quick --json` over real NIXL: the JSON is complete and its byte and
registration counts are consistent (timings are reported, never asserted)."""

from __future__ import annotations

import os

import pytest
import torch

from xavier_async.bench import BenchOptions, bench_layout, make_trace, trace_payload
from xavier_async.bench.cli import build_parser
from xavier_async.testing.peer_process import LayoutSpec

from .conftest import run_bench_cli

pytest.importorskip("nixl")

FULL, SMALL = 2 << 20, 64 << 10


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    stdout, report = run_bench_cli(tmp_path_factory.mktemp("bench"))
    assert "Seed cases" in stdout and "Targets" in stdout
    assert "Loads vs the plain-Python protocol floor" in stdout and "Load timeline" in stdout
    # quiet by default: the output starts with the bench's own header, no NIXL INFO lines
    # (from this process or the peer process it starts)
    assert stdout.lstrip().startswith("xavier-async "), stdout[:300]
    assert "NIXL INFO" not in stdout
    return report


def test_the_command_line_keeps_nixl_quiet_unless_verbose(monkeypatch):
    import logging

    from xavier_async.bench.cli import quiet_nixl
    # quiet_nixl sets variables for the processes the CLI starts: a copy of the
    # environment here, so that none of them reaches the other tests' processes
    monkeypatch.setattr(os, "environ", os.environ.copy())
    os.environ.pop("NIXL_LOG_LEVEL", None)
    os.environ.pop("UCX_LOG_LEVEL", None)
    nixl_logger = logging.getLogger("nixl")
    monkeypatch.setattr(nixl_logger, "level", logging.INFO)
    quiet_nixl(verbose=True)   # NIXL's own INFO lines (the library leaves them alone then)
    assert os.environ["NIXL_LOG_LEVEL"] == "INFO" and nixl_logger.level == logging.INFO
    del os.environ["NIXL_LOG_LEVEL"]
    quiet_nixl(verbose=False)
    assert os.environ["NIXL_LOG_LEVEL"] == "WARN" and nixl_logger.level == logging.WARNING


def test_json_has_every_section_and_environment(report):
    for key in ("options", "environment", "floor", "seed_cases", "e2e_loads", "trace", "decision",
                "memory", "memory_loads", "descriptors", "floor_after", "metrics", "peer_metrics",
                "targets", "serving", "snapshot", "protocol_floor"):
        assert key in report, key
    env = report["environment"]
    assert env["transport"] == "nixl" and env["memory"] == "DRAM" and env["device"] == "cpu"
    assert env["nixl"] and env["torch"]
    for case in ("always_full", "alternating_size_only", "alternating_streak", "sustained_small"):
        c = report["seed_cases"][case]
        assert c["median_us"] > 0 and c["p95_us"] >= c["median_us"] and c["bytes_verified"]


def test_seed_cases_bytes_and_registrations_are_consistent(report):
    sc = report["seed_cases"]
    n = report["options"]["copies"]
    for case in ("always_full", "alternating_size_only", "alternating_streak", "sustained_small"):
        assert sc[case]["registrations_after_warmup"] == 0
        assert sc[case]["peer_registrations_after_warmup"] == 0
    # padded copies: wire bytes are whole views
    assert sc["always_full"]["wire_bytes"] == n * FULL
    assert sc["sustained_small"]["wire_bytes"] == n * SMALL
    assert sc["sustained_small"]["copies_small"] == n
    half = n // 2
    # size-only selection: every small payload goes through the small view
    assert sc["alternating_size_only"]["copies_small"] == half
    assert sc["alternating_size_only"]["wire_bytes"] == half * (FULL + SMALL)
    # the streak machine keeps alternating traffic on the full slab
    assert sc["alternating_streak"]["copies_small"] == 0
    assert sc["alternating_streak"]["wire_bytes"] == 2 * half * FULL
    assert report["targets"]["registrations_after_warmup"]["met"]


def test_trace_bytes_are_consistent(report):
    tr, o = report["trace"], report["options"]
    layout = bench_layout(o["full_bytes"])
    trace = make_trace(o["trace_batches"], o["trace_large"], layout, o["full_bytes"], o["small_bytes"],
                       o["seed"])
    useful = sum(trace_payload(b, layout) for b in trace)
    assert tr["useful_bytes"] == useful and tr["batches"] == len(trace)
    size_only = sum(o["small_bytes"] if trace_payload(b, layout) <= o["small_bytes"] else o["full_bytes"]
                    for b in trace)
    assert tr["padded_size_only"]["wire_bytes"] == size_only
    assert tr["padded_streak"]["wire_bytes"] >= size_only
    trimmed = tr["trimmed_streak"]
    assert useful <= trimmed["wire_bytes"] <= useful + 256 * len(trace)
    assert trimmed["wire_over_useful"] <= 1.02
    for mode in ("padded_size_only", "padded_streak", "trimmed_streak"):
        assert tr[mode]["registrations_after_warmup"] == 0 and tr[mode]["bytes_verified"]
    assert report["e2e_loads"]["small"]["bytes_verified"] and report["e2e_loads"]["large"]["bytes_verified"]


def test_serving_section_checks_every_load_and_registers_nothing_after_warm_up(report):
    """Three processes, 16 loads in flight, K=1 and the default K: every phase's loads
    were checked block for block (a wrong byte fails the run), nothing was registered
    after warm-up in any process, and the figures are the ones the report prints."""
    from xavier_async.bench.serving import phase_loads

    s, o = report["serving"], BenchOptions(**{k: v for k, v in report["options"].items()})
    phases = phase_loads(o, bench_layout(o.full_bytes))
    assert s["topology"] == "three"  # the default on DRAM
    assert s["concurrency"] == 16 and set(s["runs"]) == {"seed", "k1", "default"}
    assert s["trace"]["loads"] == o.trace_batches and s["trace"]["large"] == o.trace_large
    for name, r in s["runs"].items():
        assert r["bytes_checked"]["ok"]
        # every phase, and the mixed trace again open loop (Poisson arrivals)
        assert r["bytes_checked"]["loads"] == sum(len(p) for p in phases.values()) + len(phases["mixed"])
        assert r["bytes_checked"]["blocks"] == sum(x.blocks for p in [*phases.values(), phases["mixed"]]
                                                   for x in p)
        ol = r["open_loop"]
        assert ol["rate_per_s"] > 0 and ol["small"]["n"] == sum(not x.large for x in phases["mixed"])
        assert ol["small_p99_over_unloaded_p50"] > 0 and r["concurrent_small"]["vs_one_at_a_time"] > 0
        assert r["registrations_after_warmup"] == {"loader": 0, "source1": 0, "source2": 0}, name
        assert set(r["rss_growth_bytes"]) == {"loader", "source1", "source2"}
        assert r["unloaded_small"]["n"] == len(phases["unloaded"])
        assert r["mixed"]["small"]["n"] + r["mixed"]["large"]["n"] == o.trace_batches
        assert r["mixed"]["useful_bytes"] == s["trace"]["useful_bytes"]
        layout = bench_layout(o.full_bytes)  # a large load: every published block, all layers
        per_load = layout.num_slots // 2 * layout.layers * layout.block_nbytes
        assert o.full_bytes - layout.layers * layout.block_nbytes < per_load <= o.full_bytes
        assert r["large_stream"]["useful_bytes"] == len(phases["large_stream"]) * per_load
        assert r["mixed"]["small"]["p99_us"] >= r["mixed"]["small"]["p50_us"] > 0
        if os.path.exists("/proc/self/schedstat"):  # each phase's cpu and run-queue wait
            assert set(r["cpu"]) == {"unloaded", "mixed", "concurrent_small", "large_stream", "open_loop"}
            for phase in r["cpu"].values():
                assert set(phase) == {"loader", "source1", "source2"}
                assert all(p["cpu_s"] > 0 and p["runqueue_wait_s"] >= 0 for p in phase.values())
                assert "main" in [t[0] for t in phase["loader"]["threads"]]   # its loop's thread
    for name, merge in (("seed", False), ("k1", True)):  # one slab each way
        assert s["runs"][name]["receive_slabs"] == s["runs"][name]["send_slabs"] == 1
        assert s["runs"][name]["merge_loads"] is merge
    assert s["runs"]["default"]["merge_loads"] is True
    for key in ("small_p99_mixed_vs_unloaded_p50", "concurrent_small_loads_per_s_vs_seed",
                "large_stream_vs_raw_full_copy", "serving_registrations_after_warmup",
                "serving_rss_growth_bytes", "serving_bytes_checked"):
        assert key in s["targets"], key
    assert s["targets"]["serving_registrations_after_warmup"]["met"]
    assert s["targets"]["serving_bytes_checked"]["met"]


@pytest.fixture(scope="module")
def duplex(tmp_path_factory):
    """``--only-serving --serving-topology duplex --quick --serving-rounds 2`` on DRAM: two
    processes over real NIXL, each loading from the other with 16 in flight while serving
    it, every run twice, alternated."""
    stdout, report = run_bench_cli(tmp_path_factory.mktemp("duplex"), "--only-serving",
                                   "--serving-topology", "duplex", "--serving-host-profile",
                                   "--serving-rounds", "2")
    flat = " ".join(stdout.split())  # the title wraps where the table's width says
    assert "rank 1 loads from rank 0" in flat and "rank 1: blocks checked" in stdout
    assert "the median of 2 alternating rounds" in flat and "rounds: least - most" in flat
    return report


def test_duplex_serving_checks_both_directions_and_registers_nothing_after_warm_up(duplex):
    """Duplex: rank 0's loads (all from rank 1) and rank 1's mirrored loads (all from
    rank 0), every phase checked block for block on each side (a wrong byte fails the run),
    nothing registered after warm-up in either process, the same figures on both sides."""
    from xavier_async.bench.serving import duplex_phases, slots_needed

    s, o = duplex["serving"], BenchOptions(**duplex["options"])
    assert o.serving_topology == "duplex" and s["topology"] == "duplex" and s["device"] == "cpu"
    layout = bench_layout(o.full_bytes)
    mine, theirs = duplex_phases(o, layout)
    assert s["concurrency"] == 16 and set(s["runs"]) == {"seed", "k1", "default"}
    assert s["rounds"] == 2 and [set(rd) for rd in s["round_runs"]] == [set(s["runs"])] * 2
    for name, r in s["runs"].items():
        assert r["topology"] == "duplex"
        for side, phases, rounds in ((r, mine, [rd[name] for rd in s["round_runs"]]),
                                     (r["peer"], theirs, [rd[name]["peer"] for rd in s["round_runs"]])):
            # rank 0 runs the mixed trace again open loop (Poisson arrivals), alone
            every = [*phases.values(), *([phases["mixed"]] if side is r else [])]
            checked = {"loads": sum(len(p) for p in every),
                       "blocks": sum(x.blocks for p in every for x in p), "ok": True}
            assert [x["bytes_checked"] for x in rounds] == [checked] * 2, name  # every round's
            assert side["bytes_checked"] == {"loads": 2 * checked["loads"],  # summed over them
                                             "blocks": 2 * checked["blocks"], "ok": True}, name
            assert side["unloaded_small"]["n"] == len(phases["unloaded"])
            assert side["mixed"]["small"]["n"] + side["mixed"]["large"]["n"] == o.trace_batches
            assert side["mixed"]["small"]["p99_us"] >= side["mixed"]["small"]["p50_us"] > 0
            assert side["large_stream"]["useful_bytes"] == sum(x.blocks for x in phases["large_stream"]) \
                * layout.block_nbytes
        assert r["bytes_checked"]["blocks"] > 0 and r["peer"]["bytes_checked"]["blocks"] > 0
        assert r["registrations_after_warmup"] == {"rank0": 0, "rank1": 0}, name
        assert set(r["rss_growth_bytes"]) == {"rank0", "rank1"}
        assert r["loader_slots"] == max(slots_needed(p) for p in [*mine.values(), *theirs.values()])
        both = r["both_directions"]
        assert both["large_stream_useful_gbps"] > r["large_stream"]["useful_gbps"] > 0
        assert both["mixed_useful_gbps"] > r["mixed"]["useful_gbps"] > 0
    assert s["runs"]["seed"]["receive_slabs"] == s["runs"]["seed"]["send_slabs"] == 1
    assert s["targets"]["serving_registrations_after_warmup"]["met"]
    both_sides = sum(r["bytes_checked"]["blocks"] + r["peer"]["bytes_checked"]["blocks"]
                     for r in s["runs"].values())
    assert s["targets"]["serving_bytes_checked"]["value"] == both_sides
    # the throughput target: the median of the two rounds' ratios, each within its range
    spread = s["spread"]["concurrent_small_loads_per_s_vs_seed"]
    assert spread["values"] == [rd["default"]["concurrent_small"]["loads_per_s"]
                                / rd["seed"]["concurrent_small"]["loads_per_s"] for rd in s["round_runs"]]
    assert s["targets"]["concurrent_small_loads_per_s_vs_seed"]["value"] == pytest.approx(sum(spread["values"]) / 2)


def test_duplex_serving_reports_stages_and_host_time_per_phase(duplex):
    """Per phase and per process: the stage table, and (``--serving-host-profile``) the
    host-time profile, in which each endpoint both served (``Source.on_load``) and loaded."""
    for name, r in duplex["serving"]["runs"].items():
        assert set(r["stages"]) == set(r["host_time"]) == {"mixed", "concurrent_small", "large_stream"}
        for phase, procs in r["host_time"].items():
            assert set(procs) == set(r["stages"][phase]) == {"rank0", "rank1"}, (name, phase)
            for proc, snap in procs.items():
                rows = {row[0]: row for row in snap["rows"]}
                assert snap["wall_us"] > 0 and len(rows) > 5, (name, phase, proc)
                assert rows["source.Source.on_load"][1] > 0, (name, phase, proc)
                assert any(k.startswith("task:") for k in rows), (name, phase, proc)
            assert r["stages"][phase]["rank0"]["receiver"]["total"]["n"] > 0


def test_host_profile_counts_wrapped_calls_and_uninstalls():
    import asyncio

    from xavier_async.layout import CacheLayout
    from xavier_async.planning import Planner
    from xavier_async.testing.hostprof import HostProfile

    original = asyncio.events.Handle._run, Planner.plan
    planner = Planner(CacheLayout.of({0: torch.zeros(4, 8)}), 1024)
    profile = HostProfile().install()
    try:
        assert (asyncio.events.Handle._run, Planner.plan) != original
        planner.plan({1: {0: {"k": 2}}})
        planner.plan({1: {0: {"k": 3}}})

        async def tick() -> None:
            await asyncio.sleep(0)
        asyncio.run(tick())
        snap = profile.snapshot()
        rows = {row[0]: row for row in snap["rows"]}
        assert rows["planning.Planner.plan"][1] == 2
        assert any(k.startswith("task:") for k in rows)
        profile.reset()
        assert profile.snapshot()["rows"] == []
    finally:
        profile.uninstall()
    assert (asyncio.events.Handle._run, Planner.plan) == original


def test_duplex_traces_mirror_each_other():
    """Rank 0 loads only from rank 1 and rank 1 only from rank 0; the mirrored trace has
    the same counts with its own seed; destinations start above the published slots and
    never overlap within a phase."""
    from xavier_async.bench.serving import duplex_phases, requests_for

    o = BenchOptions(full_bytes=FULL, small_bytes=SMALL, quick=True)
    layout = bench_layout(FULL)
    mine, theirs = duplex_phases(o, layout)
    assert {x.src for p in mine.values() for x in p} == {1}
    assert {x.src for p in theirs.values() for x in p} == {0}
    for name in mine:
        assert len(mine[name]) == len(theirs[name]), name
    for name in ("mixed", "large_stream"):  # (warm-up takes the start of each trace)
        assert sum(x.large for x in mine[name]) == sum(x.large for x in theirs[name]), name
    assert [x.keys for x in mine["mixed"]] != [x.keys for x in theirs["mixed"]]
    for phase in (*mine.values(), *theirs.values()):
        slots = [s for req in requests_for(phase, layout.num_slots) for layers in req.values()
                 for s in next(iter(layers.values())).values()]
        assert min(slots) == layout.num_slots and len(set(slots)) == len(slots)


def test_serving_topology_option():
    """auto: duplex on CUDA (one process per GPU), three on DRAM; anything else is refused."""
    from xavier_async.bench.serving import resolve_topology
    assert resolve_topology(BenchOptions(), "cuda") == "duplex"
    assert resolve_topology(BenchOptions(), "cpu") == "three"
    assert resolve_topology(BenchOptions(serving_topology="duplex"), "cpu") == "duplex"
    assert resolve_topology(BenchOptions(serving_topology="three"), "cuda") == "three"
    with pytest.raises(ValueError, match="serving_topology"):
        BenchOptions(serving_topology="ring")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--serving-topology", "ring"])
    assert build_parser().parse_args(["bench", "--serving-topology", "duplex"]).serving_topology == "duplex"


def test_serving_slabs_option():
    """--serving-slabs K: the slab count compared with K=1 (None: the engine's default);
    anything but an int from 1 to 1024 is refused."""
    assert BenchOptions().serving_slabs is None
    assert BenchOptions(serving_slabs=8).serving_slabs == 8
    for bad in (0, 1025, 2.0, "4", True):
        with pytest.raises(ValueError, match="serving_slabs"):
            BenchOptions(serving_slabs=bad)
    assert build_parser().parse_args(["bench", "--serving-slabs", "8"]).serving_slabs == 8
    assert build_parser().parse_args(["bench"]).serving_slabs is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--serving-slabs", "0"])


@pytest.mark.parametrize("name, lowest, highest", [
    ("serving_slabs", 1, 1024), ("serving_small_trips", 1, 1024), ("serving_piece_bytes", 0, None),
    ("serving_bulk_bytes", 0, None), ("serving_copy_threads", 0, 64),
    ("serving_direct_write_regions", 0, 4096)])
def test_serving_int_options_take_their_range_or_none(name, lowest, highest):
    """Each optional int setting takes None and its bounds, and refuses one past either
    end, a float, a string and a bool, naming itself and its range."""
    for good in (None, lowest) + (() if highest is None else (highest,)):
        assert getattr(BenchOptions(**{name: good}), name) == good
    span = f">= {lowest}" if highest is None else f"from {lowest} to {highest}"
    bads = [lowest - 1, float(lowest), str(lowest), True] + ([] if highest is None else [highest + 1])
    for bad in bads:
        with pytest.raises(ValueError, match=f"^{name} must be an int {span}, got "):
            BenchOptions(**{name: bad})


def test_serving_rounds_option():
    """--serving-rounds N: how many alternating rounds of the serving runs (1 to 100)."""
    assert BenchOptions().serving_rounds == 1
    assert BenchOptions(serving_rounds=3).serving_rounds == 3
    for bad in (0, 101, 2.0, True, "3"):
        with pytest.raises(ValueError, match="serving_rounds"):
            BenchOptions(serving_rounds=bad)
    assert build_parser().parse_args(["bench", "--serving-rounds", "3"]).serving_rounds == 3
    assert build_parser().parse_args(["bench"]).serving_rounds == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--serving-rounds", "0"])


def test_median_run_takes_the_median_the_worst_counters_and_sums_the_checks():
    """Several rounds of one run become one: figures the median (ints the lower median),
    registrations and RSS growth the worst round's, blocks checked summed (``ok`` only if
    every round's was), tables and text from the first round."""
    from xavier_async.bench.serving import median_run, round_spread

    def run(p50: float, loads_s: float, regs: int, rss: int, blocks: int, ok: bool, n: int) -> dict:
        return {"receive_slabs": 4, "topology": "three", "unloaded_small": {"p50_us": p50, "n": n},
                "concurrent_small": {"loads_per_s": loads_s},
                "registrations_after_warmup": {"loader": regs, "source1": 0},
                "rss_growth_bytes": {"loader": rss}, "bytes_checked": {"blocks": blocks, "ok": ok},
                "stages": {"mixed": {"round": p50}}, "host_time": {"rows": [[str(p50)]]}}

    rounds = [run(300.0, 9.0, 0, 10, 5, True, 7), run(100.0, 3.0, 2, 30, 6, True, 9),
              run(200.0, 5.0, 1, 20, 7, False, 8)]
    m = median_run(rounds)
    assert m["unloaded_small"] == {"p50_us": 200.0, "n": 8}
    assert m["concurrent_small"] == {"loads_per_s": 5.0}
    assert m["registrations_after_warmup"] == {"loader": 2, "source1": 0}
    assert m["rss_growth_bytes"] == {"loader": 30}
    assert m["bytes_checked"] == {"blocks": 18, "ok": False}
    assert m["stages"] == rounds[0]["stages"] and m["host_time"] == rounds[0]["host_time"]
    assert m["receive_slabs"] == 4 and m["topology"] == "three"
    assert median_run(rounds[:1]) is rounds[0]
    assert median_run(rounds[:2])["unloaded_small"]["n"] == 7  # the lower median of two ints
    default = [dict(rounds[0], small_p99_mixed_over_unloaded_p50=4.0, large_stream={"vs_raw_full_copy": 0.5}),
               dict(rounds[1], small_p99_mixed_over_unloaded_p50=6.0, large_stream={"vs_raw_full_copy": 0.3})]
    spread = round_spread([{"default": default[0], "seed": rounds[1]},
                           {"default": default[1], "seed": rounds[2]}])
    assert spread["concurrent_small_loads_per_s_vs_seed"] == {"values": [3.0, 0.6], "min": 0.6, "max": 3.0}
    assert spread["small_p99_mixed_vs_unloaded_p50"]["values"] == [4.0, 6.0]
    assert spread["large_stream_vs_raw_full_copy"] == {"values": [0.5, 0.3], "min": 0.3, "max": 0.5}


@pytest.mark.asyncio
async def test_peer_replay_checks_what_it_loaded():
    """The peer process's replay/check_replay (the duplex bench's rank 1): loads from this
    endpoint land above its published slots and are checked against this endpoint's
    pattern; bytes that are not that pattern fail the check, naming the block; a replay
    into the published slots is refused before anything moves."""
    import anyio

    from xavier_async import Endpoint, EndpointConfig
    from xavier_async.testing.peer_process import PeerProcess, PeerSpec, split_caches
    from xavier_async.transports.nixl import NixlTransport

    spec = LayoutSpec(layers=2, num_slots=12, block_shape=(4, 64), dtype="bfloat16")
    published, cfg = 4, {"full_bytes": 64 << 10, "small_bytes": 8 << 10}

    def req(keys, slot0=published):
        return {0: {layer: {k: slot0 + i for i, k in enumerate(keys)} for layer in range(spec.layers)}}

    with PeerProcess(PeerSpec(rank=1, layout=spec, seed=3, config=cfg, published=published,
                              torch_threads=1)) as p:
        async def call(cmd, arg=None):
            return await anyio.to_thread.run_sync(p.call, cmd, arg)

        for seed, ok in ((3, True), (4, False)):  # the child expects rank 0's pattern of seed 3
            caches = split_caches(spec, published, 0, seed)
            async with Endpoint(0, caches, NixlTransport(), EndpointConfig(**cfg)) as ep:
                for slot in range(published):
                    ep.publish(slot, slot)
                await ep.connect(p.address)
                with anyio.fail_after(30):
                    while 0 not in await call("peers"):
                        await anyio.sleep(0.01)
                with pytest.raises(RuntimeError, match="slots >= published"):
                    await call("replay", {"requests": [req([1], slot0=2)], "concurrency": 1})
                r = await call("replay", {"requests": [req([3, 1]), req([0, 2, 1], slot0=6)],
                                          "concurrency": 2})
                assert len(r["latencies"]) == 2 and min(r["latencies"]) > 0
                if ok:
                    assert await call("check_replay") == {"loads": 2, "blocks": 2 * 2 + 3 * 2}
                else:
                    with pytest.raises(RuntimeError, match="block 3 from rank 0 layer 0 differs"):
                        await call("check_replay")
            with anyio.fail_after(30):  # rank 0 leaves before the next round connects again
                while 0 in await call("peers"):
                    await anyio.sleep(0.01)


def test_serving_byte_check_names_a_wrong_block():
    """The serving section's check fails on one flipped byte in one destination slot."""
    from xavier_async.bench.serving import Load, check_phase, requests_for
    from xavier_async.testing.peer_process import pattern_caches, zero_caches

    spec = LayoutSpec(layers=3, num_slots=8, block_shape=(4, 8), dtype="bfloat16")
    expected = {1: pattern_caches(spec, 1, 0), 2: pattern_caches(spec, 2, 0)}
    reqs = requests_for([Load(1, (5, 2), (0, 2), False), Load(2, (7,), (0, 1, 2), False)])
    caches = zero_caches(spec)
    for req in reqs:
        for src, layers in req.items():
            for layer, blocks in layers.items():
                for key, slot in blocks.items():
                    caches[layer][slot] = expected[src][layer][key]
    assert check_phase(caches, reqs, expected) == 2 * 2 + 3
    caches[1][2].view(-1).view(torch.uint8)[5] ^= 1      # Load(2)'s block 7, layer 1, slot 2
    with pytest.raises(AssertionError, match="rank 2 layer 1"):
        check_phase(caches, reqs, expected)


def test_slab_counts_reach_the_config():
    """K goes to EndpointConfig as receive_slabs/send_slabs; None keeps the defaults;
    merging is on unless a run turns it off (the seed's design)."""
    from xavier_async import EndpointConfig
    from xavier_async.bench.serving import RUNS, config_for, config_kwargs, slab_counts
    assert config_kwargs(3, full_bytes=FULL) == {"full_bytes": FULL, "receive_slabs": 3, "send_slabs": 3,
                                                 "merge_loads": True}
    assert config_kwargs(None, False, full_bytes=FULL) == {"full_bytes": FULL, "merge_loads": False}
    small = EndpointConfig(full_bytes=FULL).small_bytes
    assert slab_counts(config_for(3, full_bytes=FULL)) == {"receive_slabs": 3, "send_slabs": 3,
                                                           "merge_loads": True,
                                                           "merge_small_bytes": small,
                                                           "small_round_trips": None,
                                                           "trimmed": False, "copy_threads": 2,
                                                           "split_copies": False,
                                                           "direct_write_regions": None}
    assert slab_counts(config_for(3, full_bytes=FULL, merge_small_bytes=FULL))["merge_small_bytes"] == FULL
    default = EndpointConfig()
    assert slab_counts(config_for(None)) == {"receive_slabs": default.receive_slabs,
                                             "send_slabs": default.send_slabs, "merge_loads": True,
                                             "merge_small_bytes": default.small_bytes,
                                             "small_round_trips": None, "trimmed": False,
                                             "copy_threads": default.copy_threads,
                                             "split_copies": False,
                                             "direct_write_regions": None}
    from xavier_async.bench.serving import endpoint_base
    from xavier_async.bench.suite import BenchOptions
    with pytest.raises(ValueError, match="serving_merge_small"):
        BenchOptions(serving_merge_small=1024)  # below the small view
    o = BenchOptions(full_bytes=FULL, small_bytes=SMALL, serving_trimmed=True, serving_merge_small=FULL,
                     serving_small_trips=2)
    merged, seed = (slab_counts(config_for(1, m, **endpoint_base(o, m))) for m in (True, False))
    assert merged["trimmed"] and seed["trimmed"]             # --serving-trimmed: every run
    assert (merged["merge_small_bytes"], seed["merge_small_bytes"]) == (FULL, SMALL)  # merged runs only
    assert (merged["small_round_trips"], seed["small_round_trips"]) == (2, None)      # merged runs only
    for bad in (0, 1025, 1.0, True):
        with pytest.raises(ValueError, match="serving_small_trips"):
            BenchOptions(serving_small_trips=bad)
    assert build_parser().parse_args(["bench", "--serving-small-trips", "1"]).serving_small_trips == 1
    assert build_parser().parse_args(["bench"]).serving_small_trips is None
    for threads in (0, 3):                                   # --serving-copy-threads: every run
        o = BenchOptions(full_bytes=FULL, small_bytes=SMALL, serving_copy_threads=threads)
        assert {slab_counts(config_for(k, m, **endpoint_base(o, m)))["copy_threads"]
                for k, m in ((1, False), (1, True), (None, True))} == {threads}
    for bad in (-1, 65, 1.0, True):
        with pytest.raises(ValueError, match="serving_copy_threads"):
            BenchOptions(serving_copy_threads=bad)
    assert build_parser().parse_args(["bench", "--serving-copy-threads", "0"]).serving_copy_threads == 0
    o = BenchOptions(full_bytes=FULL, small_bytes=SMALL, serving_split_copies=True)
    assert {slab_counts(config_for(k, m, **endpoint_base(o, m)))["split_copies"]  # --serving-split-copies
            for k, m in ((1, False), (1, True), (None, True))} == {True}
    assert build_parser().parse_args(["bench", "--serving-split-copies"]).serving_split_copies is True
    assert build_parser().parse_args(["bench"]).serving_split_copies is False
    for regions in (0, 64):                                  # --serving-direct-write-regions: every run
        o = BenchOptions(full_bytes=FULL, small_bytes=SMALL, serving_direct_write_regions=regions)
        assert {slab_counts(config_for(k, m, **endpoint_base(o, m)))["direct_write_regions"]
                for k, m in ((1, False), (1, True), (None, True))} == {regions}
    for bad in (-1, 4097, 1.0, True):
        with pytest.raises(ValueError, match="serving_direct_write_regions"):
            BenchOptions(serving_direct_write_regions=bad)
    assert build_parser().parse_args(
        ["bench", "--serving-direct-write-regions", "64"]).serving_direct_write_regions == 64
    plain = endpoint_base(BenchOptions(full_bytes=FULL, small_bytes=SMALL), True)
    assert plain == {"full_bytes": FULL, "small_bytes": SMALL, "map_eagerly": True}
    assert RUNS == (("seed", 1, False), ("k1", 1, True), ("default", None, True))


def test_serving_flags(capsys):
    """--no-serving and --only-serving exclude each other; --only-serving needs NIXL (it
    fails before starting anything with the local transport)."""
    from xavier_async.bench.cli import main
    assert build_parser().parse_args(["bench"]).serving
    assert not build_parser().parse_args(["bench", "--no-serving"]).serving
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--no-serving", "--only-serving"])
    assert main(["bench", "--only-serving", "--transport", "local"]) == 2
    assert "over NIXL" in capsys.readouterr().err


def test_memory_over_loads_and_the_descriptor_path_are_reported(report):
    """Memory over real loads (bytes of the last loads checked) is in the targets; the
    descriptor section checked every path's bytes and registered nothing after warm-up."""
    ml = report["memory_loads"]
    assert ml["loads"] == 500 and ml["bytes_verified"]  # --quick caps 10,000 loads at 500
    assert ml["device_growth_bytes"] == 0               # DRAM: no device memory at all
    # RSS is judged over a second window; the first (one-time growth) is reported apart
    assert isinstance(ml["first_window_rss_growth_bytes"], int)
    for key in ("load_memory_python_bytes", "load_memory_device_bytes", "load_memory_rss_bytes"):
        assert report["targets"][key]["limit"] == 0
    d = report["descriptors"]
    assert d["registrations_after_warmup"] == 0 and d["cache_registrations"] == 1
    for row in d["shapes"]:
        assert all(row[p]["bytes_verified"] for p in ("packed", "prepped", "runs", "direct")), row["shape"]
    assert d["rule"]["text"] and d["rule_to_slots"]["text"]


def test_the_snapshot_section_runs_inside_the_quick_bench(report):
    """On by default: its loads' bytes checked, nothing registered after warm-up in any of
    its four processes, the direct-write rule printed (tests/test_bench_snapshots.py checks
    the rest on --only-snapshot)."""
    s = report["snapshot"]
    assert "error" not in s, s.get("error")
    assert s["bytes_verified"] and s["blocks_checked"] > 0 and s["as_predicted"]
    assert set(s["registrations_after_warmup"].values()) == {0}
    assert s["direct_write_regions"] == s["pool_paths"]["rule"]["max_regions"]


def test_the_protocol_floor_moves_the_load_rows_shapes_and_checks_its_bytes(report):
    """Issue 24's floor: two bare NIXL processes, the load rows' shapes, every mode timed,
    the gathered bytes checked; the targets against it are in the targets table."""
    pf, e2e = report["protocol_floor"], report["e2e_loads"]
    assert "error" not in pf, pf.get("error")
    assert set(pf) == set(e2e) - {"small_blocks"}  # (small_blocks: the small shape again)
    assert e2e["small_blocks"]["payload_bytes"] == e2e["small"]["payload_bytes"]
    assert e2e["small_blocks"]["bytes_verified"]
    for name, row in pf.items():
        assert row["bytes_ok"], name
        assert row["bytes"] == e2e[name]["payload_bytes"], name
        for mode in ("notify", "asyncio", "gather"):
            assert row[mode]["n"] >= 10 and row[mode]["median_us"] > 0, (name, mode)
    for key in ("load_small_vs_protocol_floor", "load_blocks_small_vs_protocol_floor",
                "load_small_vs_raw_small", "load_one_layer_vs_raw_small", "load_large_vs_raw_full"):
        t = report["targets"][key]
        assert t["value"] > 0 and t["met"] == (t["value"] <= t["limit"]), key


def test_the_load_timeline_splits_each_sides_time(report):
    """Issue 24's host time: one-hash loads with every stage marked in both processes;
    each side's busy time is NIXL's calls, copies and Python, the stages the source runs
    appear on its side, and the loaded bytes are checked."""
    lt = report["load_timeline"]
    assert "error" not in lt, lt.get("error")
    for api in ("load", "load_blocks"):
        row = lt[api]
        assert row["bytes_verified"] and row["loads"] > 0, api
        for side in ("receiver", "source"):
            assert row[f"{side}.busy"] > 0 and row[f"{side}.nixl"] > 0, (api, side)
            parts = row[f"{side}.nixl"] + row[f"{side}.copy"] + row[f"{side}.python"]
            assert parts == pytest.approx(row[f"{side}.busy"], rel=0.5), (api, side)
        for stage in ("source.decode", "source.parse", "source.lookup", "source.agent.transfer",
                      "receiver.unpack", "receiver.agent.send_notif"):
            assert row[stage] > 0, (api, stage)
        assert row["load"] >= row["receiver.busy"], api
    for key in ("host_python_us_receiver", "host_python_us_source"):
        t = report["targets"][key]
        assert t["limit"] == 15 and t["met"] == (t["value"] <= t["limit"]), key


def test_options_are_validated():
    with pytest.raises(ValueError):
        BenchOptions(transport="tcp")
    with pytest.raises(ValueError):
        BenchOptions(small_bytes=2 << 20, full_bytes=1 << 20)
    with pytest.raises(ValueError):
        BenchOptions(alloc_loads=0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--full", "-3"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--full", "lots"])


def test_local_transport_bench_runs_in_process(monkeypatch):
    """The in-process variant (memcpy floor) goes through the same sections; a failing
    serving section is reported without losing them."""
    import anyio

    from xavier_async.bench import run, serving

    async def broken(o):
        raise AssertionError("blocks from rank 2 layer 1 differ")
    monkeypatch.setattr(serving, "serving", broken)
    o = BenchOptions(transport="local", full_bytes=FULL, small_bytes=SMALL, quick=True, copies=20,
                     loads=10, trace_batches=30, trace_large=3, alloc_copies=60, alloc_loads=100)
    r = anyio.run(run, o)
    assert r["environment"]["transport"] == "local" and r["floor"]["kind"] == "memcpy"
    assert r["seed_cases"]["sustained_small"]["wire_bytes"] == 20 * SMALL
    assert r["trace"]["trimmed_streak"]["wire_over_useful"] <= 1.02
    assert r["serving"] == {"error": "AssertionError: blocks from rank 2 layer 1 differ"}
    assert r["memory_loads"]["bytes_verified"] and "descriptors" not in r  # needs NIXL
    assert "snapshot" not in r  # so does the snapshot-store section


def test_serving_section_needs_nixl():
    import anyio

    from xavier_async.bench.serving import serving, serving_tables
    s = anyio.run(serving, BenchOptions(transport="local"))
    assert "NIXL" in s["skipped"] and serving_tables(s)[0][2] == ["skipped"]


def test_the_installed_command_is_the_bench_cli():
    """The `xavier-async` console script of pyproject.toml points at the command line."""
    import importlib
    from pathlib import Path
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    target = meta["project"]["scripts"]["xavier-async"]
    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_a_pinned_rig_gives_this_thread_its_cpus_back(monkeypatch):
    """A rig pinned to one CPU (hosts with >= 4 cores, CPU runs) pins this process only
    while the rig lives: this thread and the threads started meanwhile get their CPUs back,
    so that nothing started later (the protocol floor's source, the serving section's
    peers) inherits that one CPU and time-slices on it (16 ms loads on a 16-core host)."""
    import anyio

    from xavier_async.bench import suite
    from xavier_async.testing.peer_process import check_loaded, pattern_caches, zero_slots

    before = os.sched_getaffinity(0)
    cpus = sorted(before)[:2]
    monkeypatch.setattr(suite, "pick_cpus", lambda n=2: cpus)
    o = BenchOptions(full_bytes=FULL, small_bytes=SMALL, device="cpu", pin_cpus=True, quick=True)
    seen = []

    import threading

    release = threading.Event()
    started_inside = threading.Thread(target=release.wait)  # as anyio's workers are

    async def body(rig):
        seen.append(os.sched_getaffinity(0))
        started_inside.start()
        seen.append(os.sched_getaffinity(started_inside.native_id))
        req = suite._load_request(1, rig.layout.layers, rig.layout)
        zero_slots(rig.ep.caches, req)
        await rig.ep.load(req)
        return check_loaded(rig.ep.caches, req, {suite.PEER: pattern_caches(rig.layout, suite.PEER, o.seed)})

    try:
        assert anyio.run(suite._with_rig, o, body) == bench_layout(FULL).layers
        assert seen == [{cpus[0]}, {cpus[0]}]
        assert os.sched_getaffinity(0) == before
        # a thread started while the rig was pinned gets the CPUs back too (the processes
        # it starts later, the serving section's peers, must not share one CPU)
        assert os.sched_getaffinity(started_inside.native_id) == before
    finally:
        release.set()
        started_inside.join(10)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_the_protocol_floor_runs_where_it_is_told_not_where_its_thread_was_pinned():
    """Called from a thread pinned to one CPU (a worker thread started while a rig was
    pinned), the floor puts its loader and its source on the CPUs it is given, checks its
    bytes, and gives the thread its one CPU back."""
    import threading

    from xavier_async.bench.protocol_floor import _Loader, protocol_floor

    layout = LayoutSpec(layers=2, num_slots=8, block_shape=(4, 64), dtype="bfloat16")
    every = sorted(os.sched_getaffinity(0))
    out: dict = {}

    def pinned_thread():
        os.sched_setaffinity(0, every[:1])
        out["floor"] = protocol_floor(layout, 64 << 10, "cpu", iters=5, warmup=2,
                                      names=["small"], cpus=(every[1:2], every[:1]))
        out["after"] = os.sched_getaffinity(0)
        loader = _Loader("cpu", layout, 64 << 10, 0, source_cpus=every)
        try:
            loader.load(0, True)  # (the connection is up: the source hears its quit)
            out["source"] = loader.source_cpus
            out["loaded"] = loader.check(0)
        finally:
            loader.close()

    t = threading.Thread(target=pinned_thread)
    t.start()
    t.join(120)
    assert out["floor"]["small"]["bytes_ok"] and out["floor"]["small"]["gather"]["n"] == 5
    assert out["after"] == set(every[:1])
    assert out["source"] == every and out["loaded"]  # not the spawning thread's one CPU


def test_bench_help_fits_a_screen_and_help_all_lists_every_experiment_flag(capsys):
    from xavier_async.bench.cli import EXPERT_FLAGS
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    short = capsys.readouterr().out
    assert len(short.splitlines()) <= 50
    assert "--serving-" not in short and "--help-all" in short and "--vllm" in short
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help-all"])
    full = capsys.readouterr().out
    assert all(flag in full for flag in EXPERT_FLAGS)
    # hidden from the help, still parsed
    assert build_parser().parse_args(["bench", "--serving-trimmed", "--no-pin"]).serving_trimmed


def test_the_vllm_section_prints_decode_while_serving_against_its_target():
    """The decode-while-serving line carries the ratio, the target, what B loaded, its
    failures, the bytes check and the control (pure: a result as serving_rows makes it)."""
    from xavier_async.bench import vllm_ttft

    sv = {"alone_tokens_per_s": [1200.0, 1100.0], "serving_tokens_per_s": 760.0,
          "b_computing_tokens_per_s": 1000.0, "vs_alone": 760 / 1150, "vs_b_computing": 0.76,
          "rounds": 3, "control_rounds": 1, "loads": 24, "load_failures": 1,
          "bytes_loaded": 100_000_000, "load_mb_per_s": 500.0, "first_tokens_equal": 23,
          "first_tokens_of": 24}
    text = vllm_ttft.table({"prefixes": [], "serving": sv})
    assert "760.0 tok/s against 1200.0, 1100.0 alone" in text
    assert f"= 0.66 of alone (target >= {vllm_ttft.DECODE_WHILE_SERVING_TARGET:.2f})" in text
    assert "B loaded 24 times, 100 MB (500 MB/s), 1 failures, first tokens equal 23/24" in text
    assert "serving / control 0.76" in text
    assert "decode" not in vllm_ttft.table({"prefixes": []}).lower()

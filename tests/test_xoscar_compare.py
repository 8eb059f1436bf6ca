"""`xavier-async bench --compare xoscar`: the seed's four cases through xoscar's copy_to over
NIXL (two processes) next to ours. Structure, byte and registration counts are checked,
timings never."""

from __future__ import annotations

import pytest

from xavier_async.bench import cli
from xavier_async.bench import suite as bench
from xavier_async.bench import xoscar_anchor as anchor_xoscar
from xavier_async.bench import BenchOptions

from .conftest import run_bench_cli

pytestmark = pytest.mark.asyncio  # real NIXL processes: asyncio (pytest-asyncio)

FULL, SMALL, COPIES = 2 << 20, 64 << 10, 40
CASES = ("always_full", "alternating_size_only", "alternating_streak", "sustained_small")


def test_compare_without_xoscar_exits_2_with_the_install_hint(monkeypatch, capsys):
    monkeypatch.setattr(anchor_xoscar, "available", lambda: False)
    assert cli.main(["bench", "--compare", "xoscar", "--quick"]) == 2
    assert "pip install 'xavier-async[xoscar]'" in capsys.readouterr().err


def test_compare_option_is_validated():
    with pytest.raises(ValueError, match="compare"):
        BenchOptions(compare="ray")
    assert BenchOptions(compare="xoscar").compare == "xoscar"


async def test_a_failing_anchor_is_reported_not_fatal(monkeypatch):
    async def boom(*args, **kwargs):
        raise RuntimeError("no NIXL here")

    monkeypatch.setattr(anchor_xoscar, "available", lambda: True)
    monkeypatch.setattr(anchor_xoscar, "run_cases", boom)
    out = await bench.compare_xoscar(BenchOptions(), {"floor": {}, "seed_cases": {}}, "cpu")
    assert out == {"error": "RuntimeError: no NIXL here"}
    title, rows, _ = cli._compare_rows({}, out)
    assert "did not run" in title and rows == [["RuntimeError: no NIXL here"]]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    pytest.importorskip("nixl")
    pytest.importorskip("xoscar")
    if not anchor_xoscar.available():
        pytest.skip("xoscar without its NIXL channel")
    stdout, report = run_bench_cli(tmp_path_factory.mktemp("bench"), "--copies", str(COPIES),
                                   "--loads", "10", "--trace-batches", "40", "--compare", "xoscar")
    assert "Anchor, side by side" in stdout and "xoscar" in stdout
    return report


def test_xoscar_cases_are_complete_and_verified(report):
    assert report["options"]["compare"] == "xoscar"
    xo = report["compare"]["xoscar"]
    assert "error" not in xo, xo.get("error")
    assert xo["all_copies_over_nixl"] and "NIXL" in xo["transport"] and xo["memory"] == "DRAM"
    assert xo["processes"] == 2 and xo["versions"]["xoscar"] and xo["registrations_counted_by"]
    for case in CASES:
        c = xo["cases"][case]
        assert c["copies"] == COPIES and c["n"] == COPIES
        assert c["median_us"] > 0 and c["p95_us"] >= c["median_us"] and c["mean_us"] > 0
        assert c["ratio_mean_to_floor"] > 0 and c["floor_mean_us"] > 0
        assert c["bytes_verified"] is True and c["verified_bytes"] in (FULL, SMALL)
        assert c["nixl_writes"] == COPIES  # every copy was a NIXL WRITE, none fell back to the socket
        s = xo["speedup_vs_xavier"][case]
        assert s["median"] > 0 and s["mean"] > 0


def test_xoscar_bytes_and_registrations_are_consistent(report):
    xo = report["compare"]["xoscar"]["cases"]
    half = COPIES // 2
    assert xo["always_full"]["wire_bytes"] == COPIES * FULL
    assert xo["sustained_small"]["wire_bytes"] == COPIES * SMALL == xo["sustained_small"]["useful_bytes"]
    assert xo["sustained_small"]["copies_small"] == COPIES
    assert xo["alternating_size_only"]["wire_bytes"] == half * (FULL + SMALL)
    assert xo["alternating_size_only"]["copies_small"] == half
    assert xo["alternating_streak"]["wire_bytes"] == 2 * half * FULL
    assert xo["alternating_streak"]["copies_small"] == 0
    # one registration per channel, keyed by buffer identity: same view -> none after warm-up
    for case in ("always_full", "alternating_streak", "sustained_small"):
        assert xo[case]["registrations_after_warmup"] == 0, case
        assert xo[case]["peer_registrations_after_warmup"] == 0, case
        assert xo[case]["metadata_exchanges_after_warmup"] == 0, case
    # size-only selection switches views on every copy: both ends re-register, metadata again
    alt = xo["alternating_size_only"]
    for key in ("registrations_after_warmup", "peer_registrations_after_warmup",
                "metadata_exchanges_after_warmup"):
        assert COPIES - 1 <= alt[key] <= COPIES, (key, alt[key])
    # ours, same run: no registrations at all after warm-up
    for case in CASES:
        assert report["seed_cases"][case]["registrations_after_warmup"] == 0

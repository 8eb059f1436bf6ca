"""`xavier-async demo`: two Qwen2 replicas (same random weights) in two processes over real
NIXL. Replica B answers warm requests from prefix blocks loaded from replica A and every
answer is compared with B recomputing the prefix itself: on the CPU in float32 the tokens,
the logits and the loaded KV bytes must be equal bit for bit."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("nixl")
pytest.importorskip("transformers")

from xavier_async.demo import add_arguments, run, run_demo
from xavier_async.demo.driver import lookup
from xavier_async.demo.model import BLOCK, SMALL, block_hashes, cacheable_blocks

#: small enough for 2 busy cores: 2 cold prompts of 4 blocks, 16 warm requests in flight
SMALL_RUN = ["--cold", "2", "--warm", "16", "--prefix-blocks", "4", "--suffix-tokens", "20",
             "--new-tokens", "4", "--concurrency", "16"]


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*SMALL_RUN, *extra])


def _check_answers(res: dict) -> None:
    assert res["exact"] and res["problems"] == [], res["problems"]
    assert sorted({r["id"] for r in res["served"]}) == list(range(16))
    for r in res["served"]:
        assert r["hits"] == 4, "every warm request shares 4 full blocks with a cold prompt"
        assert r["tokens_equal"] is True and r["logits_equal"] is True, r
        assert r["max_abs_diff"] == 0.0
        assert len(r["tokens"]) == 4


def test_demo_warm_answers_equal_recomputation_and_bytes_add_up():
    res = run_demo(_args("--cancel", "2"))
    _check_answers(res)
    assert res["ok"]
    assert res["load_failures"] == 0 and res["cancelled"] == 2
    loaded = [r for r in res["served"] if r["loaded"]]
    assert len(loaded) == 16, "the 14 undisturbed requests and the 2 cancelled ones, re-issued"
    assert all(r["kv_equal"] is True for r in loaded), "loaded blocks = recomputed blocks, byte for byte"
    # byte accounting, from the source's metrics: whole blocks; a cancelled load may have
    # moved its blocks (a started copy finishes), nothing else moved
    bb = SMALL.block_nbytes
    assert res["block_bytes"] == bb == 4 * 2 * 2 * 16 * 32 * 4
    assert res["blocks_loaded"] == 16 * 4
    useful, wire = res["useful_bytes"], res["wire_bytes"]
    assert useful % bb == 0 and 64 * bb <= useful <= (64 + res["blocks_cancelled"]) * bb
    assert wire >= useful
    b = res["metrics"]["B"]["peers"][0]
    # every batch: a copy of its own, or merged into another's while both waited for a slab
    assert b["load_errors"] == 0 and b["batches_received"] + b["batches_merged"] >= 16
    assert res["recompute"]["requests"] == 16 and res["load"]["requests"] == 14


def test_demo_source_killed_mid_load_falls_back_to_recomputation():
    """Replica A is frozen, B's first load goes out, then A is SIGKILLed: that load fails
    with PeerLostError, later ones cannot reach A; every request recomputes its prefix
    and still answers exactly what the reference answered."""
    res = run_demo(_args("--cancel", "0", "--kill-source"))
    _check_answers(res)
    assert res["ok"] and res["source_killed"]
    assert res["blocks_loaded"] == 0 and res["load_failures"] == 16
    assert "PeerLostError" in res["fallbacks"]
    assert res["useful_bytes"] is None  # the source's metrics died with it


def test_block_hashes_chain_over_tokens():
    salt = b"model"
    t = list(range(3 * BLOCK + 1))
    h = block_hashes(t, 3, salt)
    assert len(set(h)) == 3
    assert block_hashes(t[:2 * BLOCK] + [7] * BLOCK, 3, salt)[:2] == h[:2]
    changed = [999] + t[1:]
    assert all(x != y for x, y in zip(block_hashes(changed, 3, salt), h)), "a change moves every later hash"
    assert block_hashes(t, 3, b"other model") != h
    assert cacheable_blocks(3 * BLOCK) == 2 and cacheable_blocks(3 * BLOCK + 1) == 3
    with pytest.raises(ValueError):
        block_hashes(t[:BLOCK], 2, salt)


def test_lookup_takes_the_longest_prefix_on_one_replica():
    directory = {"a": (0, 5), "b": (0, 6), "c": (1, 2), "d": (0, 7)}
    assert lookup(directory, ["a", "b", "c", "d"]) == (0, ["a", "b"])
    assert lookup(directory, ["x", "a"]) == (None, [])
    assert lookup(directory, ["c"]) == (1, ["c"])


def test_bad_options_fail_before_any_process_starts(capsys):
    assert run(_args("--prefill-chunk", "20")) == 2
    assert "multiple of 16" in capsys.readouterr().err
    assert run(_args("--cancel", "16")) == 2

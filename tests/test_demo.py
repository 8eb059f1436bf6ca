"""`xavier-async demo`: Qwen2 replicas (same random weights) in three processes over real
NIXL, each running a batched engine loop. Replica B answers warm requests three times:
recomputing every prefix (the reference), loading the prefixes from source A (default
endpoint) and from source C (``trimmed=True``); every answer is compared with the
reference, and on the CPU in float32 the tokens, the logits and the loaded KV bytes must
be equal bit for bit. The sources run with the snapshot store: their paged caches are
smaller than the shared prefix set, their engines publish with ``publish_blocks`` after
each step and reuse the slots, and the store's two tiers serve. The engine's own pieces
(the paged model, the scheduler, the loop, the directory) are tested here without
processes."""

from __future__ import annotations

import argparse
import random

import pytest

pytest.importorskip("nixl")
pytest.importorskip("transformers")

import anyio
import anyio.lowlevel
import torch

from xavier_async.demo import add_arguments, run, run_demo
from xavier_async.demo.driver import (
    DemoError,
    apply_publish_log,
    break_even_blocks,
    lookup,
    make_workload,
    shape_of,
    sizing,
    sweep_sizes,
    tier_figures,
)
from xavier_async.demo.engine import Engine, Request, completed_blocks, schedule
from xavier_async.demo.model import (
    BLOCK,
    QWEN25_05B,
    SMALL,
    PagedKV,
    PagedModel,
    StepItem,
    StepResult,
    block_hashes,
    blocks_for,
    cacheable_blocks,
)

#: small enough for 2 busy cores: 2 cold prompts of 4 blocks, 16 warm requests in flight,
#: one cold long prompt among them, a two-size sweep
SMALL_RUN = ["--cold", "2", "--warm", "16", "--prefix-blocks", "4", "--suffix-tokens", "20",
             "--new-tokens", "4", "--concurrency", "16", "--long-prompts", "1", "--long-blocks", "8",
             "--step-tokens", "128", "--sweep", "1,8", "--sweep-reps", "1"]


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*SMALL_RUN, *extra])


def _check_answers(res: dict, column: str) -> list[dict]:
    """Every request of a load column answered, exactly as the reference did."""
    assert res["exact"] and res["problems"] == [], res["problems"]
    served = res["columns"][column]["served"]
    assert sorted(r["id"] for r in served) == sorted(q["id"] for q in res["columns"]["recompute"]["served"])
    for r in served:
        assert r["tokens_equal"] is True and r["logits_equal"] is True, r
        assert r["max_abs_diff"] == 0.0
        assert len(r["tokens"]) == 4
        assert r["hits"] == (4 if r["kind"] == "warm" else 0), "warm requests share 4 full blocks"
    return served


def test_demo_warm_answers_equal_recomputation_and_bytes_add_up():
    res = run_demo(_args("--cancel", "2"))
    assert res["ok"]
    bb = SMALL.block_nbytes
    assert res["block_bytes"] == bb == 4 * 2 * 2 * 16 * 32 * 4
    # the reference's own prefixes: B's computed bytes are A's computed bytes
    assert res["recompute_equal_source"] == 16
    for column in ("load", "trimmed"):
        served = _check_answers(res, column)
        col = res["columns"][column]
        assert col["failures"] == 0 and col["cancelled"] == 2
        loaded = [r for r in served if r["loaded"]]
        assert len(loaded) == 16, "the 14 undisturbed requests and the 2 cancelled ones, re-issued"
        # loaded blocks = recomputed blocks = the source's blocks, byte for byte
        assert all(r["kv_equal"] is True for r in loaded)
        assert col["blocks_loaded"] == 16 * 4 and col["requests"] == 14
        # byte accounting, from the source's metrics: whole blocks; a cancelled load may have
        # moved its blocks (a started copy finishes), nothing else moved
        useful, wire = col["useful_bytes"], col["wire_bytes"]
        assert useful % bb == 0 and 64 * bb <= useful <= (64 + col["blocks_cancelled"]) * bb
        assert wire >= useful
    assert res["columns"]["trimmed"]["wire_bytes"] == res["columns"]["trimmed"]["useful_bytes"], \
        "trimmed copies move the payload only (whole blocks are 256-byte aligned)"
    assert res["columns"]["load"]["wire_bytes"] > res["columns"]["load"]["useful_bytes"]
    b = res["metrics"]["B"]["peers"]
    for source in (0, 2):  # every batch: its own copy, or merged into another's
        assert b[source]["load_errors"] == 0
        assert b[source]["batches_received"] + b[source]["batches_merged"] >= 16
    # the snapshot store, at the defaults: the sources' paged caches (9 slots: the largest
    # request) are smaller than the 16 shared prefix blocks, and the device tier (4 blocks)
    # smaller than the working set, so it demotes to the host tier, which holds the rest
    st = res["store"]
    assert st["on"] and st["source_slots"] == 9 < st["prefix_blocks"] == 2 * 4 + 8
    for name in ("A", "C"):
        src = st["sources"][name]
        assert src["store"]["device_slots"] == 4 and src["store"]["host_slots"] == 16
        assert src["available"] == 16 and src["evicted"] == src["skipped"] == src["failed"] == 0
        assert src["demoted"] > 0, "the device tier filled and spilled into the host tier"
        assert src["cache_evicted"] > 0, "the engine reused slots of published blocks"
        assert src["publish_calls"] >= 2, "one publish_blocks per step that completed blocks"
    for column in ("load", "trimmed"):
        _check_tiers(res["columns"][column], 64)
    rc = res["columns"]["recompute"]
    assert rc["requests"] == 16 and rc["blocks_computed"] == 64 and len(rc["long_ttft_ms"]) == 1
    # the engine batched: fewer steps than tokens, several requests per step
    assert rc["steps"] < rc["rows"]
    # the sweep: every size loaded from both sources and answered exactly
    sweep = res["sweep"]
    assert [r["blocks"] for r in sweep["rows"]] == [1, 8]
    assert set(sweep["break_even_blocks"]) == {"load", "trimmed"}


def _check_tiers(col: dict, loaded_blocks: int, device: int | None = None) -> None:
    """Loads came from both tiers; the LoadResults' tier counts add up to the blocks
    loaded (a merged load's share is rounded down: less than one (layer, block) pair per
    tier and load); the batches split between the tiers."""
    t = col["tiers"]
    assert col["blocks_loaded"] == loaded_blocks
    slack = 2 * t["loads"] / SMALL.layers
    assert t["device_blocks"] > 0 and t["host_blocks"] > 0
    assert loaded_blocks - slack <= t["device_blocks"] + t["host_blocks"] <= loaded_blocks
    if device is not None:
        assert device - slack <= t["device_blocks"] <= device
        assert loaded_blocks - device - slack <= t["host_blocks"] <= loaded_blocks - device
    assert t["device_batches"] >= 1 and t["host_batches"] >= 1 and t["live_batches"] == 0
    assert t["device_batches"] + t["host_batches"] == t["batches"] == t["loads"]


def test_demo_with_a_small_source_cache_and_small_tiers_serves_both_tiers_and_follows_evictions():
    """Three cold prompts of 4 blocks through sources whose paged cache holds one request
    at a time (6 slots: each request reuses the slots of the one before) and whose store
    has 4 blocks per tier. The first prompt's blocks are demoted to the host tier; the
    second's are demoted next, find the host tier full and are dropped (evicted: the
    directory unregisters them); the third's stay on the device tier. Warm requests load
    from both tiers, those sharing the second prompt are routed to nothing and recompute
    (no load fails), and every answer and loaded byte is checked as always."""
    res = run_demo(_args("--cold", "3", "--sweep", "none", "--cancel", "0", "--source-slots", "6",
                         "--device-tier-mib", "0.125", "--host-tier-mib", "0.125"))
    assert res["ok"], res["problems"]
    st = res["store"]
    assert st["source_slots"] == 6 < st["prefix_blocks"] == 12
    for name in ("A", "C"):
        src = st["sources"][name]
        assert src["store"]["device_slots"] == src["store"]["host_slots"] == 4
        assert src["store"]["device_used"] == src["store"]["host_used"] == 4
        assert src["available"] == 12 and src["demoted"] == 4, "the first prompt's blocks"
        assert src["evicted"] == src["unregistered"] == 4 and src["skipped"] == 0
        assert src["cache_evicted"] >= 4, "the later requests took the slots of the earlier ones"
    evicted = {f"w{i}" for i in range(1, 16, 3)}  # round robin: the second prompt's sharers
    ref = res["columns"]["recompute"]["served"]
    assert {r["id"] for r in ref if r["kind"] == "warm" and r["hits"] == 0} == evicted
    for column in ("load", "trimmed"):
        col = res["columns"][column]
        assert col["failures"] == 0, "the directory routed only to loadable blocks"
        for r in col["served"]:
            assert r["tokens_equal"] is True and r["logits_equal"] is True, r
            assert r["loaded"] == (r["kind"] == "warm" and r["id"] not in evicted)
            assert not r["loaded"] or r["kv_equal"] is True
        # 6 requests of the first prompt from the host tier, 5 of the third from the device tier
        _check_tiers(col, 11 * 4, device=5 * 4)


def test_demo_source_killed_mid_load_falls_back_to_recomputation():
    """Source A is frozen, B's first load goes out, then A is SIGKILLed: that load fails
    with PeerLostError, later ones cannot reach A; every request of that column
    recomputes its prefix and still answers exactly what the reference answered. Source C
    is untouched and serves the trimmed column."""
    res = run_demo(_args("--cancel", "0", "--kill-source", "--sweep", "none"))
    assert res["ok"] and res["source_killed"]
    _check_answers(res, "load")
    col = res["columns"]["load"]
    assert col["blocks_loaded"] == 0 and col["failures"] == 16
    assert "PeerLostError" in col["fallbacks"]
    assert col["useful_bytes"] is None  # the source's metrics died with it
    trimmed = _check_answers(res, "trimmed")
    assert all(r["loaded"] and r["kv_equal"] for r in trimmed if r["kind"] == "warm")
    assert res["sweep"]["rows"] == []


# -- the engine's pieces, without processes ---------------------------------------------
def _serve(model: PagedModel, prompts: list[list[int]], step_tokens: int, new: int,
           computed: dict[int, int] | None = None) -> list[Request]:
    """Serve ``prompts`` through the scheduler and ``model.step``, all in flight at once."""
    reqs = [Request(f"r{i}", p, model.kv.alloc(blocks_for(len(p), new)), new,
                    computed=(computed or {}).get(i, 0), snapshot_blocks=len(p) // BLOCK)
            for i, p in enumerate(prompts)]
    running = list(reqs)
    while running:
        plan = schedule(running, step_tokens)
        result = model.step([item for _, item in plan])
        k = 0
        for i, (r, item) in enumerate(plan):
            r.computed += len(item.ids)
            if item.sample:
                r.out.append(result.tokens[k])
                r.logits.append(result.logits[k])
                k += 1
            if i in result.snapshots:
                r.snapshot = result.snapshots[i]
        running = [r for r in running if not r.finished]
    return reqs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(SMALL.vocab) for _ in range(n)] for n in (150, 37, 80, 200, 17)]


@pytest.fixture
def one_thread():
    """torch on one thread, as in the replicas (``--threads 1``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_paged_model_is_batch_invariant_on_the_cpu(prompts, one_thread):
    """CPU float32: a request's logits and KV bytes are the same alone in one chunk, and
    batched with others in chunks cut at other places (what makes loaded and recomputed
    answers comparable bit for bit)."""
    together = _serve(PagedModel(SMALL, 0, torch.device("cpu"), 200), prompts, 48, 5)
    for i, p in enumerate(prompts):
        alone = _serve(PagedModel(SMALL, 0, torch.device("cpu"), 200), [p], 512, 5)[0]
        assert alone.out == together[i].out
        assert torch.equal(torch.stack(alone.logits), torch.stack(together[i].logits))
        assert torch.equal(alone.snapshot.view(torch.uint8), together[i].snapshot.view(torch.uint8))


def test_paged_model_with_a_loaded_prefix_answers_as_when_computing_it(prompts, one_thread):
    """The engine's core claim, without transfers: blocks copied in from another replica's
    cache (same weights) and a request joining with them computed gives the same answer."""
    source = PagedModel(SMALL, 0, torch.device("cpu"), 200)
    ref = _serve(source, prompts, 64, 4)
    dest = PagedModel(SMALL, 0, torch.device("cpu"), 200)
    src_slots = [r.slots for r in ref]
    warm = [dest.kv.alloc(blocks_for(len(p), 4)) for p in prompts]
    for layer, cache in dest.kv.caches.items():
        for s_slots, d_slots, p in zip(src_slots, warm, prompts):
            n = cacheable_blocks(len(p))
            cache[d_slots[:n]] = source.kv.caches[layer][s_slots[:n]]
    reqs = [Request(f"w{i}", p, slots, 4, computed=cacheable_blocks(len(p)) * BLOCK)
            for i, (p, slots) in enumerate(zip(prompts, warm))]
    running = list(reqs)
    while running:
        plan = schedule(running, 64)
        result = dest.step([item for _, item in plan])
        k = 0
        for r, item in plan:
            r.computed += len(item.ids)
            if item.sample:
                r.out.append(result.tokens[k])
                r.logits.append(result.logits[k])
                k += 1
        running = [r for r in running if not r.finished]
    for a, b in zip(ref, reqs):
        assert a.out == b.out and torch.equal(torch.stack(a.logits), torch.stack(b.logits))


@pytest.mark.parametrize("invariant", [True, False], ids=["tiled", "sdpa"])
def test_paged_attention_computes_the_model(prompts, invariant):
    """Our driver around the model's layers gives transformers' own forward's logits."""
    model = PagedModel(SMALL, 0, torch.device("cpu"), 200, invariant=invariant)
    reqs = _serve(model, prompts, 64, 3)
    for p, r in zip(prompts, reqs):
        with torch.no_grad():
            full = model.model(input_ids=torch.tensor([p + r.out[:-1]])).logits[0, len(p) - 1:]
        assert torch.allclose(torch.stack(r.logits), full.float(), atol=1e-4, rtol=0)
        assert full.argmax(-1).tolist() == r.out


def test_schedule_decodes_first_then_prefills_in_order_within_the_budget():
    def req(rid: str, n: int, computed: int = 0, out: int = 0) -> Request:
        r = Request(rid, list(range(n)), list(range(blocks_for(n, 4))), 4, computed=computed)
        r.out = [7] * out
        if out:
            r.computed = n + out - 1
        return r
    decoding = req("d", 20, out=2)
    first, second = req("a", 100), req("b", 50, computed=32)
    plan = schedule([first, decoding, second], 64)
    assert [(r.rid, item.start, len(item.ids), item.sample) for r, item in plan] == [
        ("d", 21, 1, True), ("a", 0, 63, False)], "decode first; the budget cuts a's chunk"
    plan = schedule([second, first], 100)
    assert [(r.rid, item.start, len(item.ids), item.sample) for r, item in plan] == [
        ("b", 32, 18, True), ("a", 0, 82, False)]
    last = req("z", 20, out=3)
    last.snapshot_blocks = 1
    (_, item), = schedule([last], 8)
    assert item.snapshot_blocks == last.snapshot_blocks and item.sample, "its last token: copy aside"


def test_a_loading_request_never_holds_up_the_others_and_keeps_its_place():
    """A request whose prefix is loading does not hold up the others: they run meanwhile.
    When it joins, it keeps its arrival order (its chunk goes before a later request's).
    A fake model; steps counted, nothing timed."""
    steps: list[list[tuple[str, int]]] = []

    async def main() -> None:
        owners: dict[int, str] = {}
        loaded = anyio.Event()

        async def run_step(items: list[StepItem]) -> StepResult:
            steps.append([(owners[id(it.slots)], len(it.ids)) for it in items])
            if len(steps) == 2:
                loaded.set()  # the load completes during the second step
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            n = sum(it.sample for it in items)
            return StepResult([1] * n, torch.zeros(n, 4))
        engine = Engine(run_step, 64)

        async def request(rid: str, n: int, computed: int = 0) -> None:
            r = Request(rid, list(range(n)), list(range(blocks_for(n, 3))), 3, computed=computed)
            owners[id(r.slots)] = rid
            if rid == "early":
                await loaded.wait()  # stands for `await endpoint.load(...)`
            await engine.generate(r)

        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.serve)
            async with anyio.create_task_group() as reqs:
                reqs.start_soon(request, "early", 40, 32)
                await anyio.sleep(0.01)
                reqs.start_soon(request, "later", 300)
            tg.cancel_scope.cancel()
    anyio.run(main)
    assert steps[0] == [("later", 64)] and steps[1] == [("later", 64)], "ran while early loaded"
    assert steps[2] == [("early", 8), ("later", 56)], "early joined in its arrival place"


def test_break_even_is_where_loading_wins_from_then_on():
    assert break_even_blocks([(1, 5.0, 3.0), (2, 2.0, 3.0), (4, 1.0, 9.0)]) == 2
    assert break_even_blocks([(1, 1.0, 3.0), (2, 4.0, 3.0), (4, 1.0, 9.0)]) == 4
    assert break_even_blocks([(1, 1.0, 3.0), (2, 1.0, 3.0)]) == 1
    assert break_even_blocks([(1, 1.0, 3.0), (2, 5.0, 3.0)]) is None


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
    assert run(_args("--step-tokens", "8")) == 2
    assert "--step-tokens (8)" in capsys.readouterr().err
    assert run(_args("--cancel", "16")) == 2
    assert run(_args("--sweep", "1,x")) == 2
    assert "--sweep" in capsys.readouterr().err
    assert run(_args("--source-slots", "4")) == 2
    assert "--source-slots (4) must hold the largest cold request (9 slots)" in capsys.readouterr().err


# -- the sources' cache, publishing and the directory, without processes ----------------
def test_paged_kv_reuses_the_least_recently_freed_slots_and_counts_evicted_blocks():
    """As a prefix cache: freed slots keep their blocks until taken again, least recently
    freed first (a request's tail first); taking one that held a block evicts it."""
    kv = PagedKV(SMALL, 6, torch.device("cpu"))
    a = kv.alloc(3)
    b = kv.alloc(2)
    assert a == [0, 1, 2] and b == [3, 4] and kv.free_slots == 1
    kv.release(a, ["h0", "h1", "h2"])
    kv.release(b, ["k0"])  # only its first slot holds a published block
    assert kv.cached == {0: "h0", 1: "h1", 2: "h2", 3: "k0"} and kv.evicted == 0
    assert kv.alloc(3) == [5, 2, 1], "never used first, then a's slots, its tail first"
    assert kv.evicted == 2 and kv.cached == {0: "h0", 3: "k0"}
    with pytest.raises(RuntimeError, match="out of KV slots"):
        kv.alloc(4)


def test_the_engine_publishes_once_per_step_before_the_steps_requests_finish():
    """Every block a step completed, of every request, goes out in one publish call after
    that step; a request that finishes in that step is told only after the call returned
    (so its slots are never freed, and reused, before their blocks are copied out)."""
    calls: list[tuple[list[str], list[int]]] = []
    done_during_publish: list[set[str]] = []

    async def main() -> None:
        reqs: list[Request] = []

        async def run_step(items: list[StepItem]) -> StepResult:
            n = sum(it.sample for it in items)
            return StepResult([1] * n, torch.zeros(n, 4))

        async def publish(keys: list[str], slots: list[int]) -> None:
            calls.append((keys, slots))
            await anyio.sleep(0.01)
            done_during_publish.append({r.rid for r in reqs if r.done.is_set()})
        engine = Engine(run_step, 40, publish=publish)
        # a: 3 full blocks (+1 token), one decode token: finishes in its last prefill step;
        # b: 2 full blocks, cut by the step budget
        a = Request("a", list(range(3 * BLOCK + 1)), [10, 11, 12, 13], 1,
                    publish=["a0", "a1", "a2"])
        b = Request("b", list(range(2 * BLOCK + 5)), [20, 21, 22], 2, publish=["b0", "b1"])
        reqs += [a, b]
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.serve)
            async with anyio.create_task_group() as run:
                run.start_soon(engine.generate, a)
                run.start_soon(engine.generate, b)
            tg.cancel_scope.cancel()
        assert a.published == 3 and b.published == 2
    anyio.run(main)
    # step 1: a's first 40 tokens (2 blocks); step 2: a's last 9 tokens and b's first 31
    # (1 block); step 3: b's last 6 (1 block); b's decode step publishes nothing
    assert calls == [(["a0", "a1"], [10, 11]), (["a2", "b0"], [12, 20]), (["b1"], [21])]
    assert done_during_publish == [set(), set(), {"a"}], "a finished in step 2, told after its publish"


def test_completed_blocks_are_whole_blocks_of_the_keys_given():
    r = Request("r", list(range(40)), [7, 8, 9], 1, publish=["x", "y"])
    r.computed = 31
    assert completed_blocks([r]) == (["x"], [7])
    r.computed = 40  # past two blocks: only the keys given are published
    assert completed_blocks([r]) == (["y"], [8]) and completed_blocks([r]) == ([], [])


def test_the_directory_follows_the_stores_evictions_in_order():
    directory = {"old": (0, 1)}
    log = [{"available": [("a", 3), ("b", 4)], "evicted": [], "skipped": [], "failed": [], "demoted": 0},
           {"available": [("c", 3)], "evicted": ["old", "a"], "skipped": ["d"], "failed": ["e"],
            "demoted": 1}]
    counts = apply_publish_log(directory, 0, log)
    assert directory == {"b": (0, 4), "c": (0, 3)}, "evicted keys unregistered, skipped ones never in"
    assert counts == {"available": 3, "evicted": 2, "skipped": 1, "failed": 1, "demoted": 1,
                      "unregistered": 2}
    # a warm request whose prefix lost its first block is routed to nothing
    assert lookup(directory, ["a", "b"]) == (None, [])


def test_tier_figures_split_merged_loads_by_their_blocks():
    layers = SMALL.layers
    loads = [{"batches": 1, "device_blocks": 4 * layers, "host_blocks": 0},
             {"batches": 1, "device_blocks": 2 * layers, "host_blocks": 2 * layers},  # merged
             {"batches": 1, "device_blocks": 2 * layers, "host_blocks": 2 * layers},
             {"batches": 2, "device_blocks": 0, "host_blocks": 8 * layers}]
    t = tier_figures(loads, layers)
    assert t["device_blocks"] == 8 and t["host_blocks"] == 12
    assert (t["device_batches"], t["host_batches"], t["batches"], t["loads"]) == (2, 3, 5, 4)
    assert tier_figures([{"batches": 1, "device_blocks": 0, "host_blocks": 0}], layers)["live_batches"] == 1


def _sizes(*extra: str) -> tuple:
    args = _args(*extra)
    from xavier_async.demo.driver import fill_defaults
    fill_defaults(args)
    shape = shape_of(args)
    sizes = sweep_sizes(args)
    return args, shape, make_workload(args, shape.vocab), sizes


def test_sizing_defaults_make_the_source_cache_and_the_device_tier_smaller_than_the_set():
    args, shape, work, sizes = _sizes()
    s = sizing(args, shape, work, sizes)
    assert s.store and s.prefix_blocks == 16 and s.largest_request == 9
    assert s.largest_request <= s.source_slots < s.prefix_blocks
    assert s.device_tier_bytes == 4 * SMALL.block_nbytes < s.prefix_blocks * SMALL.block_nbytes
    assert s.host_tier_bytes == s.prefix_blocks * SMALL.block_nbytes
    args, shape, work, sizes = _sizes("--device", "cuda")
    s = sizing(args, QWEN25_05B, work, sizes)
    assert s.device_tier_bytes == 256 * 2**20 and s.host_tier_bytes is None, "the seed's tier"
    args, shape, work, sizes = _sizes("--source-slots", "8")
    with pytest.raises(DemoError, match="largest cold request"):
        sizing(args, shape, work, sizes)
    args, shape, work, sizes = _sizes("--device-tier-mib", "0", "--host-tier-mib", "0")
    s = sizing(args, shape, work, sizes)
    assert not s.store and s.source_slots >= 2 * 5 + 9, "no store: the sources keep every slot"
    args, shape, work, sizes = _sizes("--device-tier-mib", "0", "--host-tier-mib", "0",
                                      "--source-slots", "9")
    with pytest.raises(DemoError, match="without the snapshot store"):
        sizing(args, shape, work, sizes)


class _EvictedSource:
    """An endpoint whose source evicted the block between routing and loading."""

    async def load(self, request: dict) -> None:
        from xavier_async import RemoteError
        await anyio.lowlevel.checkpoint()
        raise RemoteError("block key(s) ['h0'] not published in layer 0")

    async def load_blocks(self, peer: int, keys: list, slots: list) -> None:
        await self.load({peer: {"all": dict(zip(keys, slots))}})


def test_a_load_of_a_block_evicted_after_routing_falls_back_to_recomputation(one_thread):
    """The directory said the source held the prefix, the store evicted it before the
    load: the load fails, the request recomputes its prefix in the same slots (counted
    as a fallback) and answers exactly as the reference did."""
    from xavier_async.demo.replica import Replica
    model = PagedModel(SMALL, 0, torch.device("cpu"), 64)
    replica = Replica(model, _EvictedSource(), None, 64, store=False)
    rng = random.Random(3)
    tokens = [rng.randrange(SMALL.vocab) for _ in range(2 * BLOCK + 5)]
    req = {"id": "w0", "tokens": tokens, "hits": ["h0", "h1"], "source": 0}
    out: dict = {}

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(replica.engine.serve)
            out["ref"] = await replica.run_batch({"mode": "recompute", "requests": [req], "new_tokens": 3})
            out["load"] = await replica.run_batch({"mode": "load", "requests": [req], "new_tokens": 3})
            tg.cancel_scope.cancel()
    anyio.run(main)
    (r,) = out["load"]["requests"]
    assert r["fallback"] == "RemoteError" and not r["loaded"]
    assert r["tokens_equal"] is True and r["logits_equal"] is True
    assert model.kv.free_slots == 64, "both requests freed their slots"

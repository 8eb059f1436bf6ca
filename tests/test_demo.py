"""`xavier-async demo`: Qwen2 replicas (same random weights) in three processes over real
NIXL, each running a batched engine loop. Replica B answers warm requests three times:
recomputing every prefix (the reference), loading the prefixes from source A (default
endpoint) and from source C (``trimmed=True``); every answer is compared with the
reference, and on the CPU in float32 the tokens, the logits and the loaded KV bytes must
be equal bit for bit. The engine's own pieces (the paged model, the scheduler, the loop)
are tested here without processes."""

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
from xavier_async.demo.driver import break_even_blocks, lookup
from xavier_async.demo.engine import Engine, Request, schedule
from xavier_async.demo.model import (
    BLOCK,
    SMALL,
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
    rc = res["columns"]["recompute"]
    assert rc["requests"] == 16 and rc["blocks_computed"] == 64 and len(rc["long_ttft_ms"]) == 1
    # the engine batched: fewer steps than tokens, several requests per step
    assert rc["steps"] < rc["rows"]
    # the sweep: every size loaded from both sources and answered exactly
    sweep = res["sweep"]
    assert [r["blocks"] for r in sweep["rows"]] == [1, 8]
    assert set(sweep["break_even_blocks"]) == {"load", "trimmed"}


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

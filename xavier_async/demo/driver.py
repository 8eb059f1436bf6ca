"""The demo's driver (the parent process): it starts three replicas, owns the block
directory (block hash -> (rank, slot)), routes requests, checks every warm answer and
prints the table and the break-even sweep.

Replicas: A (rank 0) and C (rank 2) are sources that serve the same cold prompts, A with
the default endpoint (copies through the chosen slab view) and C with
``EndpointConfig(trimmed=True)`` (copies only the payload); B (rank 1) is the replica
under test. B serves the same warm requests three times: recomputing every prefix (the
reference), loading the prefixes from A, loading them from C.

The sources run with the snapshot store, as the seed's deployment did: their engines
publish blocks with ``publish_blocks`` and reuse the slots, so a source's paged cache
(``--source-slots``) is smaller than the shared prefix set, and the store's two tiers
(``--device-tier-mib``, ``--host-tier-mib``) keep serving the blocks the cache evicted.

The directory stands for what a real stack already has: a router's prefix index or a
block tracker that replicas report published blocks to (vLLM's KV events, Dynamo's KV
router, the seed's block tracker). The demo keeps it as a plain dict in this process,
fed by each ``publish_blocks`` result in order: keys that became available are
registered, keys the store evicted to make room are unregistered.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .._checks import cli_int
from ..sizes import MiB
from .model import (
    BLOCK,
    QWEN25_05B,
    SMALL,
    ModelShape,
    block_hashes,
    blocks_for,
    cacheable_blocks,
)

#: ranks: the default source, the replica under test, the trimmed source
A, B, C = 0, 1, 2
#: the three columns of the table: (key, title, source rank)
COLUMNS = (("recompute", "recompute", None), ("load", "load from peer", A),
           ("trimmed", "load from peer, trimmed", C))

#: defaults per device
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": dict(cold=4, warm=32, prefix_blocks=8, suffix_tokens=24, new_tokens=8, long_prompts=2,
                long_blocks=32, step_tokens=256, sweep="1,2,4,8,16,32,64,128,256", sweep_reps=5),
    "cuda": dict(cold=8, warm=64, prefix_blocks=64, suffix_tokens=64, new_tokens=16, long_prompts=4,
                 long_blocks=128, step_tokens=2048, sweep="1,2,4,8,16,32,64,128,256", sweep_reps=5),
}
#: the suffix a sweep request computes after its prefix
SWEEP_SUFFIX = 8
#: pause before each sweep request: the endpoints' pollers spin for a while after traffic
#: (on a 2-core machine they would share the cores with the next request's model thread)
SWEEP_SETTLE_S = 0.1


class DemoError(RuntimeError):
    """A replica failed or the demo's options are unusable."""


class ReplicaProcess:
    """One replica in a child process (multiprocessing, spawn), driven over a pipe."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from .replica import replica_main
        ctx = multiprocessing.get_context("spawn")
        self.rank = int(spec["rank"])
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=replica_main, args=(theirs, spec),
                                name=f"xavier-demo-replica-{self.rank}")
        self.proc.start()
        theirs.close()
        self.address: str | None = None
        self.store = False

    def wait_ready(self, timeout: float) -> None:
        ready = self.reply(timeout)
        self.address = ready["address"]
        #: whether its endpoint copies published blocks into a snapshot store
        self.store = bool(ready["store"])

    def reply(self, timeout: float, on_event: Callable[[str], None] | None = None) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(deadline - time.monotonic(), 0)):
                state = "exited" if not self.proc.is_alive() else "did not answer"
                raise DemoError(f"replica {self.rank} {state} (timeout {timeout:.0f} s)")
            try:
                status, value = self.conn.recv()
            except EOFError:
                raise DemoError(f"replica {self.rank} exited ({self.proc.exitcode})") from None
            if status == "event":
                if on_event is not None:
                    on_event(value)
                continue
            if status != "ok":
                raise DemoError(f"replica {self.rank} failed: {value}")
            return value

    def send(self, cmd: str, arg: Any = None) -> None:
        self.conn.send((cmd, arg))

    def call(self, cmd: str, arg: Any = None, timeout: float = 600.0,
             on_event: Callable[[str], None] | None = None) -> Any:
        self.send(cmd, arg)
        return self.reply(timeout, on_event)

    def stop(self) -> None:
        """SIGSTOP: the replica freezes (it serves nothing) until killed."""
        if self.proc.pid is None:
            raise DemoError(f"replica {self.rank} never started")
        os.kill(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL: the replica dies without closing anything."""
        self.proc.kill()
        self.proc.join(10)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=timeout)
            except Exception:
                pass
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self.conn.close()


# -- the workload -----------------------------------------------------------------------
@dataclass
class Workload:
    """Token ids: cold prompts (``prefix_blocks`` full blocks + a 1-15 token tail), warm
    prompts (one cold prompt's full blocks, round robin, + a 1..``suffix_tokens`` suffix),
    long cold prompts that share nothing, and the sweep's prompt (its first ``n`` blocks
    are the prefix of size ``n``)."""

    cold: list[list[int]]
    warm: list[list[int]]
    long: list[list[int]]
    sweep: list[int]


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]
    prefixes = [tokens(args.prefix_blocks * BLOCK) for _ in range(args.cold)]
    cold = [p + tokens(rng.randint(1, BLOCK - 1)) for p in prefixes]
    warm = [prefixes[i % args.cold] + tokens(rng.randint(1, args.suffix_tokens))
            for i in range(args.warm)]
    long = [tokens(args.long_blocks * BLOCK + rng.randint(1, BLOCK - 1)) for _ in range(args.long_prompts)]
    sizes = sweep_sizes(args)
    sweep = tokens(max(sizes) * BLOCK + 1) if sizes else []
    return Workload(cold, warm, long, sweep)


def sweep_sizes(args: argparse.Namespace) -> list[int]:
    """The ``--sweep`` prefix sizes in blocks (``none``: no sweep)."""
    text = str(args.sweep).strip().lower()
    if text in ("", "none", "0"):
        return []
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise DemoError(f"--sweep takes block counts like 1,4,16 or 'none', got {args.sweep!r}") from None
    if not sizes or sizes[0] < 1:
        raise DemoError(f"--sweep sizes must be positive block counts, got {args.sweep!r}")
    return sizes


def lookup(directory: dict[str, tuple[int, int]], hashes: Sequence[str]) -> tuple[int | None, list[str]]:
    """The longest prefix of ``hashes`` held by one replica: (its rank, those hashes)."""
    hits: list[str] = []
    owner: int | None = None
    for h in hashes:
        entry = directory.get(h)
        if entry is None or (owner is not None and entry[0] != owner):
            break
        owner = entry[0]
        hits.append(h)
    return owner, hits


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def placement(args: argparse.Namespace) -> tuple[dict[int, str], str]:
    """Device of each replica, and a sentence saying where they run: the sources (A, C)
    where a two-process run puts process 0, B where it puts process 1
    (:func:`~xavier_async.testing.devices.peer_device`: one GPU holds all three)."""
    if args.device == "cpu":
        return {A: "cpu", B: "cpu", C: "cpu"}, (
            f"cpu: three replica processes (sources A and C, B under test), "
            f"{args.threads} torch thread(s) each")
    import torch

    from ..testing.devices import SHARED_GPU_NOTE, peer_device
    src, under_test = peer_device(0, "cuda"), peer_device(1, "cuda")
    name = torch.cuda.get_device_name(0)
    where = {A: src.device, B: under_test.device, C: src.device}
    if under_test.shared:
        return where, f"cuda: ONE GPU visible ({name}): A, B and C share cuda:0; {SHARED_GPU_NOTE}"
    return where, (f"cuda: sources A and C on {src.device}, B on {under_test.device} "
                   f"({torch.cuda.device_count()} x {name})")


# -- the run ----------------------------------------------------------------------------
@dataclass
class Sizing:
    """The sources' paged cache and snapshot tiers for one run (see :func:`sizing`)."""

    #: distinct blocks the sources publish (every cold prompt's full blocks, the sweep's)
    prefix_blocks: int
    #: the most slots one cold request holds at once
    largest_request: int
    #: slots of each source's paged cache
    source_slots: int
    #: the tiers' budgets (host None: the library's default)
    device_tier_bytes: int
    host_tier_bytes: int | None

    @property
    def store(self) -> bool:
        return bool(self.device_tier_bytes or self.host_tier_bytes is None or self.host_tier_bytes)


def sizing(args: argparse.Namespace, shape: ModelShape, work: Workload, sizes: Sequence[int]) -> Sizing:
    """Size the sources' cache and tiers. Defaults: a cache of half the shared prefix set
    (at least the largest request), so that the sources evict their own slots; on the CPU a
    device tier of half the cold prompts' blocks, so that it fills and demotes blocks to a
    host tier with room for the whole set (both tiers serve, nothing is evicted from the
    store); on CUDA the seed's 256 MiB device tier and the library's host tier."""
    new = args.new_tokens
    need = [blocks_for(len(t), new) for t in work.cold] + ([blocks_for(len(work.sweep), new)] if sizes else [])
    prefix = args.cold * args.prefix_blocks + (max(sizes) if sizes else 0)
    bb = shape.block_nbytes
    if args.device == "cpu":
        device = max(args.cold * args.prefix_blocks // 2, 1) * bb
        host: int | None = prefix * bb
    else:
        device, host = 256 * MiB, None
    if args.device_tier_mib is not None:
        device = round(args.device_tier_mib * MiB)
    if args.host_tier_mib is not None:
        host = round(args.host_tier_mib * MiB)
    out = Sizing(prefix, max(need), 0, device, host)
    least = max(out.largest_request, 3)  # 3: the warm-up request
    if not out.store:  # the sources keep every slot they publish: room for all of them
        least = max(sum(need), 3)
        if args.source_slots is not None and args.source_slots < least:
            raise DemoError(f"--source-slots ({args.source_slots}) must hold every cold prompt "
                            f"({least} slots) without the snapshot store (both tiers 0)")
        out.source_slots = args.source_slots or least + 4
        return out
    if args.source_slots is not None and args.source_slots < least:
        raise DemoError(f"--source-slots ({args.source_slots}) must hold the largest cold "
                        f"request ({least} slots)")
    out.source_slots = args.source_slots or max(least, prefix // 2)
    return out


def apply_publish_log(directory: dict[str, tuple[int, int]], rank: int,
                      log: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Follow a source's ``publish_blocks`` results in order: keys the store evicted are
    unregistered, keys it made available are registered (at the slot they were published
    from; the source may have reused it since: the store serves the block). Returns the
    counts."""
    counts = {"available": 0, "evicted": 0, "skipped": 0, "failed": 0, "demoted": 0, "unregistered": 0}
    for entry in log:
        for h in entry["evicted"]:
            counts["unregistered"] += directory.pop(h, None) is not None
        for h, slot in entry["available"]:
            directory[h] = (rank, int(slot))
        counts["available"] += len(entry["available"])
        counts["evicted"] += len(entry["evicted"])
        counts["skipped"] += len(entry["skipped"])
        counts["failed"] += len(entry["failed"])
        counts["demoted"] += int(entry["demoted"])
    return counts


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole demo; return every figure and check as a JSON-able dict."""
    fill_defaults(args)
    shape = shape_of(args)
    sizes = sweep_sizes(args)
    work = make_workload(args, shape.vocab)
    salt = f"qwen2-random-seed{args.seed}-{shape}".encode()
    size = sizing(args, shape, work, sizes)
    devices, where = placement(args)
    new = args.new_tokens
    per_warm = blocks_for(args.prefix_blocks * BLOCK + args.suffix_tokens, new)
    per_long = max((blocks_for(len(t), new) for t in work.long), default=0)
    b_slots = max(args.concurrency * max(per_warm, per_long),
                  blocks_for(max(sizes, default=0) * BLOCK + SWEEP_SUFFIX, 1)) + 4
    common = dict(shape=asdict(shape), seed=args.seed, threads=args.threads, step_tokens=args.step_tokens)
    src_spec = dict(common, num_slots=size.source_slots, device_tier_bytes=size.device_tier_bytes,
                    host_tier_bytes=size.host_tier_bytes)
    specs = [dict(src_spec, rank=A, device=devices[A], trimmed=False),
             # B publishes nothing: no store (its tiers would be allocated and registered for nothing)
             dict(common, rank=B, device=devices[B], num_slots=b_slots, trimmed=False,
                  device_tier_bytes=0, host_tier_bytes=0),
             dict(src_spec, rank=C, device=devices[C], trimmed=True)]
    replicas: dict[int, ReplicaProcess] = {}
    killed = False
    t_start = time.perf_counter()
    try:
        for spec in specs:  # all start (import torch, build the model) at the same time
            replicas[int(spec["rank"])] = ReplicaProcess(spec)
        for r in replicas.values():
            r.wait_ready(args.start_timeout)
        ra, rb, rc = replicas[A], replicas[B], replicas[C]
        for source_proc in (ra, rc):
            rb.call("connect", source_proc.address)

        # 1. cold prompts on both sources: prefill, publish (the engines call publish_blocks
        #    after each step), report to the directory. The sweep's prompt goes first, so
        #    that the cold prompts' blocks are the most recently published: the device tier
        #    holds the latest of them, the earlier ones are demoted to the host tier, and
        #    the warm requests load from both.
        cold_reqs = [{"id": f"c{i}", "tokens": t, "hashes": block_hashes(t, cacheable_blocks(len(t)), salt)}
                     for i, t in enumerate(work.cold)]
        waves = [cold_reqs]
        if sizes:
            waves.insert(0, [{"id": "sweep", "tokens": work.sweep,
                              "hashes": block_hashes(work.sweep, max(sizes), salt)}])
        directory: dict[int, dict[str, tuple[int, int]]] = {A: {}, C: {}}
        source_digests: dict[int, dict[str, str]] = {A: {}, C: {}}
        published: dict[int, dict[str, Any]] = {
            rank: {"available": 0, "evicted": 0, "skipped": 0, "failed": 0, "demoted": 0,
                   "unregistered": 0, "publish_calls": 0, "publish_s": 0.0, "cache_evicted": 0}
            for rank in (A, C)}
        for wave in waves:
            cold_arg = {"mode": "cold", "requests": wave, "new_tokens": new, "concurrency": args.concurrency}
            for source_proc in (ra, rc):
                source_proc.send("batch", cold_arg)
            for rank in (A, C):
                res = replicas[rank].reply(600.0)
                for key, n in apply_publish_log(directory[rank], rank, res["publish_log"]).items():
                    published[rank][key] += n
                published[rank]["publish_calls"] += res["publish_calls"]
                published[rank]["publish_s"] += res["publish_s"]
                published[rank]["cache_evicted"] += res["cache"]["evicted"]
                published[rank]["cache_slots"] = res["cache"]["slots"]
                published[rank]["cache_held"] = res["cache"]["cached"]
                for r in res["requests"]:
                    for h, d in zip(r["hashes"], r["digests"]):
                        source_digests[rank][h] = d
        for rank, proc in ((A, ra), (C, rc)):
            published[rank]["store_on"] = proc.store
            published[rank]["store"] = proc.call("metrics").get("snapshot")

        # 2. route warm requests: the longest cached prefix and who holds it; long prompts
        #    share nothing and arrive among the warm ones
        def routed(source: int | None) -> list[dict[str, Any]]:
            reqs: list[dict[str, Any]] = []
            for i, t in enumerate(work.warm):
                _, hits = lookup(directory[A if source is None else source],
                                 block_hashes(t, cacheable_blocks(len(t)), salt))
                reqs.append({"id": f"w{i}", "tokens": t, "hits": hits, "source": source})
            for k, t in enumerate(work.long):
                at = (k + 1) * len(reqs) // (len(work.long) + 1)
                reqs.insert(at, {"id": f"l{k}", "kind": "long", "tokens": t, "hits": [], "source": None})
            return reqs
        base = {"new_tokens": new, "concurrency": args.concurrency}

        # 3. the reference: B recomputes every prefix itself
        phases: dict[str, dict[str, Any]] = {}
        phases["recompute"] = rb.call("batch", {**base, "mode": "recompute", "requests": routed(None)})

        # 4. B loads the prefixes from A, then from C; some requests are cancelled mid-load
        cancel = [f"w{(k + 1) * args.warm // (args.cancel + 1)}" for k in range(args.cancel)]

        def on_event(event: str) -> None:
            nonlocal killed
            if event == "loading" and not killed:
                ra.kill()  # failure injection: the source dies with B's loads in flight
                killed = True
        if args.kill_source:
            ra.stop()  # frozen: B's first load stays in flight until A is killed
        phases["load"] = rb.call("batch", {**base, "mode": "load", "requests": routed(A), "cancel": cancel,
                                           "signal_loading": args.kill_source}, on_event=on_event)
        phases["trimmed"] = rb.call("batch", {**base, "mode": "load", "requests": routed(C), "cancel": cancel})
        # 5. the cancelled requests again: the cache they left behind must still serve right
        again: dict[str, dict[str, Any]] = {}
        for key, source in (("load", A), ("trimmed", C)):
            ids = {r["id"] for r in phases[key]["requests"] if r["cancelled"]}
            reqs = [r for r in routed(source) if r["id"] in ids]
            again[key] = rb.call("batch", {**base, "mode": "load", "requests": reqs}) if reqs else \
                {"requests": [], "wall_s": 0.0}
        metrics = {"A": None if killed else ra.call("metrics"), "B": rb.call("metrics"),
                   "C": rc.call("metrics")}

        # 6. the break-even sweep: one request at a time, prefixes of n blocks (routed by the
        #    directory like any request: a block the store evicted is recomputed)
        sweep: list[dict[str, Any]] = []
        if sizes and not killed:
            for n in sizes:
                t = work.sweep[:n * BLOCK] + random.Random(n).choices(range(shape.vocab), k=SWEEP_SUFFIX)
                hashes = block_hashes(t, n, salt)
                for rep in range(args.sweep_reps):
                    one = {"new_tokens": 1, "concurrency": 1}
                    row: dict[str, Any] = {"blocks": n, "rep": rep}
                    for key, _title, src in COLUMNS:
                        mode = "recompute" if src is None else "load"
                        _, hits = lookup(directory[A if src is None else src], hashes)
                        req = {"id": f"s{n}.{rep}", "kind": "sweep", "tokens": t, "hits": hits, "source": src}
                        time.sleep(SWEEP_SETTLE_S)  # every replica's poller idle again
                        res = rb.call("batch", {**one, "mode": mode, "requests": [req]})
                        row[key] = res["requests"][0]
                    sweep.append(row)
    finally:
        for r in replicas.values():
            r.close()
    res = summarize(args, shape, phases, again, source_digests, metrics, killed, sweep)
    res["placement"] = {"A": devices[A], "B": devices[B], "C": devices[C], "note": where}
    res["store"] = store_summary(size, shape, published)
    res["run_s"] = time.perf_counter() - t_start
    return res


def store_summary(size: Sizing, shape: ModelShape, published: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The sources' cache and tiers, and what publishing did on each (JSON)."""
    bb = shape.block_nbytes
    return {"on": all(p["store_on"] for p in published.values()), "configured": size.store,
            "device_tier_bytes": size.device_tier_bytes, "host_tier_bytes": size.host_tier_bytes,
            "block_bytes": bb, "prefix_blocks": size.prefix_blocks, "source_slots": size.source_slots,
            "largest_request_slots": size.largest_request,
            "sources": {name: published[rank] for name, rank in (("A", A), ("C", C))}}


# -- checks and figures -------------------------------------------------------------------
def check_answer(r: dict[str, Any], exact: bool, rtol: float, source: dict[str, str],
                 logit_rtol: float | None = None) -> list[str]:
    """Problems with one served request against the reference, and of its loaded blocks
    against the source's bytes. ``rtol``: the near-tie margin (a token may differ only
    where the reference led by less); ``logit_rtol``: the largest |logit difference|
    accepted when not exact (default ``rtol``); both relative to the request's largest
    |logit|."""
    problems: list[str] = []
    rid = r["id"]
    tol = rtol * (r.get("max_abs_ref") or 0.0)
    logit_tol = (rtol if logit_rtol is None else logit_rtol) * (r.get("max_abs_ref") or 0.0)
    if r.get("tokens_equal") is None:
        problems.append(f"request {rid}: no reference to compare with")
    elif exact and r["tokens_equal"] is not True:
        problems.append(f"request {rid}: tokens differ from the recomputed reference")
    for step, margin in r.get("flips") or ():
        if margin > tol:  # a choice the reference made clearly: it must be ours too
            problems.append(f"request {rid}: token {step} differs where the reference led "
                            f"by {margin:.4g} > tolerance {tol:.4g}")
    if exact and r.get("logits_equal") is False:
        problems.append(f"request {rid}: logits not bit-equal (max |diff| {r['max_abs_diff']})")
    if not exact and r.get("max_abs_diff") is not None and r["max_abs_diff"] > logit_tol:
        problems.append(f"request {rid}: max |logit diff| {r['max_abs_diff']:.4g} > logit rtol "
                        f"{logit_rtol if logit_rtol is not None else rtol} "
                        f"x max |logit| {r['max_abs_ref']:.4g}")
    if r["loaded"]:
        if exact and r.get("kv_equal") is not True:
            problems.append(f"request {rid}: loaded KV bytes differ from the recomputed ones")
        if r["digests"] != [source.get(h) for h in r["hit_hashes"]]:
            problems.append(f"request {rid}: loaded KV bytes differ from the source's")
    return problems


def _phase(reqs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    warm = [r for r in reqs if r.get("kind", "warm") == "warm" and "ttft_s" in r]
    long = [r for r in reqs if r.get("kind") == "long" and "ttft_s" in r]
    ttft = [r["ttft_s"] * 1e3 for r in warm]
    gen = sum(len(r.get("tokens", ())) for r in reqs)
    joined = [r["joined_s"] * 1e3 for r in warm if r["loaded"]]
    return {"requests": len(warm), "ttft_ms": ttft, "ttft_p50_ms": percentile(ttft, 0.5),
            "ttft_p95_ms": percentile(ttft, 0.95), "output_tokens": gen, "wall_s": wall,
            "tokens_per_s": gen / wall if wall > 0 else float("nan"),
            "long_ttft_ms": [r["ttft_s"] * 1e3 for r in long],
            "long_ttft_mean_ms": statistics.fmean([r["ttft_s"] * 1e3 for r in long]) if long else float("nan"),
            "load_p50_ms": percentile(joined, 0.5)}


def summarize(args: argparse.Namespace, shape: ModelShape, phases: dict[str, dict[str, Any]],
              again: dict[str, dict[str, Any]], source_digests: dict[int, dict[str, str]],
              metrics: dict[str, Any], killed: bool, sweep: list[dict[str, Any]]) -> dict[str, Any]:
    exact = shape.dtype == "float32" and args.device == "cpu"  # bit-exact claim: CPU float32 only
    block_bytes = shape.block_nbytes
    problems: list[str] = []
    ref = phases["recompute"]
    hits_of = {r["id"]: r["hits"] for r in ref["requests"]}
    expected = {r["id"] for r in ref["requests"]}
    columns: dict[str, Any] = {}
    all_served: list[dict[str, Any]] = []
    # the reference's own prefixes: B's computed bytes equal A's (CPU float32: required)
    rec_equal = sum(1 for r in ref["requests"] if r["hits"] and
                    r["digests"] == [source_digests[A].get(h) for h in r["hit_hashes"]])
    for key, _title, source in COLUMNS:
        phase = phases[key]
        if source is None:
            served, cancelled = phase["requests"], []
            wall = phase["wall_s"]
        else:
            served = [r for r in phase["requests"] if not r["cancelled"]] + again[key]["requests"]
            cancelled = [r for r in phase["requests"] if r["cancelled"]]
            wall = phase["wall_s"]
            missing = expected - {r["id"] for r in served}
            if missing:
                problems.append(f"{key}: requests {sorted(missing)[:8]} never answered")
            for r in served:
                problems += [f"{key}: {p}" for p in check_answer(r, exact, args.rtol, source_digests[source],
                                                                  args.logit_rtol)]
            all_served += served
        col = _phase([r for r in phase["requests"] if not r["cancelled"]], wall)
        loaded = sum(r["hits"] for r in served if r["loaded"])
        if source is not None:
            col["tiers"] = tier_figures([r["load"] for r in served if r["loaded"]], shape.layers)
        col.update(blocks_loaded=loaded,
                   blocks_computed=sum(hits_of.get(r["id"], 0) for r in served if not r["loaded"]),
                   failures=sum(1 for r in served if r["fallback"]),
                   fallbacks=sorted({r["fallback"] for r in served if r["fallback"]}),
                   cancelled=len(cancelled), blocks_cancelled=sum(r["hits"] for r in cancelled),
                   steps=phase.get("steps"), rows=phase.get("rows"), served=served)
        if source is not None:
            m = metrics["A" if source == A else "C"]
            peer = m.get("peers", {}).get(B, {}) if m else {}
            useful, wire = peer.get("useful_bytes"), peer.get("wire_bytes")
            col.update(useful_bytes=useful, wire_bytes=wire, batches=peer.get("batches_sent"),
                       copies_full=peer.get("copies_full"), copies_small=peer.get("copies_small"),
                       wire_over_useful=(wire / useful) if useful and wire is not None else None)
            if useful is not None:
                # a load cancelled mid-copy still moved its bytes (a started copy is finished)
                lo, hi = loaded * block_bytes, (loaded + col["blocks_cancelled"]) * block_bytes
                if not (lo <= useful <= hi and useful % block_bytes == 0):
                    problems.append(f"{key}: useful bytes {useful} not in [{lo}, {hi}] in whole blocks")
                if wire is not None and wire < useful:
                    problems.append(f"{key}: wire bytes {wire} < useful bytes {useful}")
        columns[key] = col
    if exact and rec_equal != sum(1 for r in ref["requests"] if r["hits"]):
        problems.append("recompute: B's computed prefix bytes differ from A's")

    sweep_res = summarize_sweep(sweep, exact, args.rtol, source_digests, problems, killed,
                                args.logit_rtol)
    return {
        "ok": not problems, "problems": problems,
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "model": shape.as_dict(), "exact": exact, "teacher_forced": not exact,
        "columns": columns, "block_bytes": block_bytes, "source_killed": killed,
        "recompute_equal_source": rec_equal,
        "correct": sum(1 for r in all_served if r.get("tokens_equal") is True),
        "answers": len(all_served),
        "near_tie_flips": sum(len(r.get("flips") or ()) for r in all_served),
        "logits_bit_equal": sum(1 for r in all_served if r.get("logits_equal") is True),
        "max_abs_logit_diff": max((r.get("max_abs_diff") or 0.0 for r in all_served), default=0.0),
        # the largest |logit difference| relative to its request's largest |logit|
        "max_rel_logit_diff": max(((r.get("max_abs_diff") or 0.0) / r["max_abs_ref"]
                                   for r in all_served if r.get("max_abs_ref")), default=0.0),
        "kv_loaded": sum(1 for r in all_served if r["loaded"]),
        "kv_bytes_equal": sum(1 for r in all_served if r["loaded"] and r.get("kv_equal") is True),
        "sweep": sweep_res, "metrics": metrics,
    }


def tier_figures(loads: Sequence[dict[str, int]], layers: int) -> dict[str, Any]:
    """Blocks and batches of a column's loads per snapshot tier, from their LoadResults.
    A LoadResult counts (layer, block) pairs: divided by ``layers`` into 16-token blocks of
    every layer. A load merged with others into one copy (``merge_loads``) is charged its
    share of that copy's tiers, so which tier one load's batch came from is not known:
    each load's batches are split between the tiers in proportion to its blocks (the
    totals are exact when the merged batches are the same size; the JSON keeps the
    fractions). A load served from neither tier (no store: live slots) counts as live."""
    dev = sum(x["device_blocks"] for x in loads)
    host = sum(x["host_blocks"] for x in loads)
    dev_batches = host_batches = 0.0
    live = 0
    for x in loads:
        d, h = x["device_blocks"], x["host_blocks"]
        if d + h:
            dev_batches += x["batches"] * d / (d + h)
            host_batches += x["batches"] * h / (d + h)
        else:
            live += x["batches"]
    n_dev = round(dev_batches)

    def blocks(n: int) -> int | float:
        return n // layers if n % layers == 0 else n / layers
    return {"device_blocks": blocks(dev), "host_blocks": blocks(host),
            "device_batches": n_dev, "host_batches": round(dev_batches + host_batches) - n_dev,
            "device_batches_exact": dev_batches, "host_batches_exact": host_batches,
            "live_batches": live, "batches": sum(x["batches"] for x in loads), "loads": len(loads)}


def summarize_sweep(sweep: list[dict[str, Any]], exact: bool, rtol: float,
                    source_digests: dict[int, dict[str, str]], problems: list[str],
                    killed: bool, logit_rtol: float | None = None) -> dict[str, Any]:
    """Median TTFT per prefix size and mode, and the break-even size per load mode."""
    sizes = sorted({row["blocks"] for row in sweep})
    rows = []
    for n in sizes:
        reps = [row for row in sweep if row["blocks"] == n]
        out: dict[str, Any] = {"blocks": n, "tokens": n * BLOCK}
        for key, _title, source in COLUMNS:
            ttft = [rep[key]["ttft_s"] * 1e3 for rep in reps if "ttft_s" in rep[key]]
            out[f"{key}_ms"] = statistics.median(ttft) if ttft else float("nan")
            out[f"{key}_samples_ms"] = ttft
            if source is not None:
                for rep in reps:
                    r = rep[key]
                    problems += [f"sweep {key}: {p}" for p in check_answer(
                        r, exact, rtol, source_digests[source], logit_rtol)]
                    if r["hits"] and not r["loaded"]:
                        problems.append(f"sweep {key}: request {r['id']} did not load ({r['fallback']})")
                # fewer: blocks of the sweep's prefix the store evicted (recomputed instead)
                out[f"{key}_held"] = min(rep[key]["hits"] for rep in reps)
        rows.append(out)
    break_even = {key: break_even_blocks([(r["blocks"], r[f"{key}_ms"], r["recompute_ms"]) for r in rows])
                  for key in ("load", "trimmed")} if rows else {}
    return {"rows": rows, "break_even_blocks": break_even, "skipped": "source killed" if killed else None}


def break_even_blocks(points: Sequence[tuple[int, float, float]]) -> int | None:
    """The smallest measured prefix size (blocks) from which loading is faster than
    recomputing at every larger size measured; ``None`` if recomputing wins at the largest."""
    best: int | None = None
    for n, load_ms, rec_ms in sorted(points, reverse=True):
        if not load_ms < rec_ms:
            break
        best = n
    return best


# -- output -----------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f} MiB"


def _count(x: float) -> str:
    """A count that may have a fraction (a merged load's share)."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _grid(rows: list[tuple[str, ...]]) -> list[str]:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(width[i]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(r))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def tier_batches(c: dict[str, Any], k: str, store: bool) -> str:
    """The seed's form: "N device-tier batches and M host-tier batches"."""
    if k == "recompute":
        return "-"
    t = c["tiers"]
    text = f"{t['device_batches']} device-tier batches and {t['host_batches']} host-tier batches"
    if t["live_batches"]:
        text += f" (+{t['live_batches']} from live slots)"
    return text if store else "n/a (no store: live slots)"


def store_lines(res: dict[str, Any]) -> list[str]:
    """The sources' paged cache and snapshot tiers, under the table."""
    st = res["store"]
    a = st["sources"]["A"]
    bb = st["block_bytes"]
    if not st["on"]:
        why = "both tiers 0" if not st["configured"] else "the endpoint turned it off (no Triton)"
        return [f"snapshot store: off ({why}): the sources serve their live slots and keep them "
                f"({st['source_slots']} slots each for {st['prefix_blocks']} shared prefix blocks)"]
    m = a["store"] or {}
    ds, hs = m.get("device_slots", 0), m.get("host_slots", 0)
    evicted = (f"{a['evicted']} evicted and unregistered from the directory" if a["evicted"] == a["unregistered"]
               else f"{a['evicted']} evicted, {a['unregistered']} unregistered from the directory")
    return [
        (f"snapshot store per source: device tier {ds} blocks ({_mib(ds * bb)}), host tier {hs} blocks "
         f"({_mib(hs * bb)}); after the cold prompts A's store held {m.get('device_used', 0)} blocks on "
         f"the device tier and {m.get('host_used', 0)} on the host tier ({a['demoted']} demoted, {evicted}, "
         f"{a['skipped']} skipped, {a['failed']} failed), published by {a['publish_calls']} publish_blocks "
         f"calls ({a['publish_s'] * 1e3:,.1f} ms in all)"),
        (f"sources' paged cache: {st['source_slots']} slots each for {st['prefix_blocks']} shared prefix "
         f"blocks: A's engine reused the slots of {a['cache_evicted']} published blocks (it held "
         f"{a.get('cache_held', 0)} at the end); the store serves them")]


def table(res: dict[str, Any]) -> str:
    cols = [res["columns"][k] for k, _, _ in COLUMNS]
    store = res["store"]["on"]

    def row(label: str, fmt: Callable[[dict[str, Any], str], str]) -> tuple[str, ...]:
        return (label, *(fmt(c, k) for c, (k, _, _) in zip(cols, COLUMNS)))

    def copy(c: dict[str, Any], k: str) -> str:
        if k == "recompute":
            return "-"
        if c.get("useful_bytes") is None:
            return "n/a (source gone)"
        return f"{_mib(c['wire_bytes'])} / {_mib(c['useful_bytes'])} ({c['wire_over_useful']:.3f}x)"
    rows = [
        ("", *(t for _, t, _ in COLUMNS)),
        row("warm requests", lambda c, k: str(c["requests"])),
        row("warm TTFT p50", lambda c, k: f"{c['ttft_p50_ms']:,.1f} ms"),
        row("warm TTFT p95", lambda c, k: f"{c['ttft_p95_ms']:,.1f} ms"),
        row("throughput (output tokens/s)", lambda c, k: f"{c['tokens_per_s']:,.1f}"),
        row("prefix load p50 (request start to loaded)", lambda c, k: "-" if k == "recompute"
            else f"{c['load_p50_ms']:,.1f} ms"),
        row("cold long-prompt TTFT (mean)", lambda c, k: f"{c['long_ttft_mean_ms']:,.1f} ms"
            if c["long_ttft_ms"] else "-"),
        row("prefix blocks", lambda c, k: f"{c['blocks_loaded']} loaded" if k != "recompute"
            else f"{c['blocks_computed']} computed"),
        row("copy bytes / useful bytes", copy),
        row("batches per tier", lambda c, k: tier_batches(c, k, store)),
        row("blocks per tier", lambda c, k: "-" if k == "recompute" else
            f"{_count(c['tiers']['device_blocks'])} device-tier + {_count(c['tiers']['host_blocks'])} host-tier"),
        row("failures (fell back to recompute)", lambda c, k: "-" if k == "recompute" else str(c["failures"])),
        row("cancellations (mid-load)", lambda c, k: "-" if k == "recompute" else str(c["cancelled"])),
        row("engine steps (rows per step)", lambda c, k: f"{c['steps']} ({c['rows'] / max(c['steps'], 1):.0f})"),
    ]
    lines = _grid(rows)
    m = res["model"]
    o = res["options"]
    lines += ["", f"model: Qwen2 {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads x "
                  f"{m['head_dim']}, {m['dtype']}, random weights; block {m['block_nbytes']:,} B; "
                  f"{o['concurrency']} requests in flight, at most {o['step_tokens']} tokens per step",
              f"workload: {o['warm']} warm requests sharing {o['prefix_blocks']}-block prefixes of "
              f"{o['cold']} cold prompts, {o['long_prompts']} cold long prompts of "
              f"{o['long_blocks']} blocks among them, {o['new_tokens']} tokens each",
              f"where: {res['placement']['note']}", *store_lines(res)]
    lines += ["", *sweep_table(res)]
    checks = (f"answers equal to the recomputed reference: {res['correct']}/{res['answers']}"
              + (f" (teacher-forced; near-tie flips {res['near_tie_flips']})" if res["teacher_forced"] else "")
              + f"; logits bit-equal: {res['logits_bit_equal']}; max |logit diff| {res['max_abs_logit_diff']:.3g}"
              f" ({res.get('max_rel_logit_diff', 0.0):.2%} of its request's largest |logit|); "
              f"loaded KV bytes equal to recomputed: {res['kv_bytes_equal']}/{res['kv_loaded']}")
    lines += ["", checks, "OK" if res["ok"] else "FAILED: " + "; ".join(res["problems"][:5])]
    return "\n".join(lines)


def _sweep_load(r: dict[str, Any], key: str) -> str:
    held = r.get(f"{key}_held", r["blocks"])
    return f"{r[f'{key}_ms']:,.2f} ms" + (f" ({held} held)" if held < r["blocks"] else "")


def sweep_table(res: dict[str, Any]) -> list[str]:
    sw = res["sweep"]
    if not sw["rows"]:
        return [f"break-even sweep: not run ({sw['skipped'] or '--sweep none'})"]
    reps = res["options"]["sweep_reps"]
    rows: list[tuple[str, ...]] = [("prefix (blocks / tokens)", "recompute", "load from peer",
                                    "load, trimmed", "faster")]
    for r in sw["rows"]:
        best = min(("recompute", "load", "trimmed"), key=lambda k: r[f"{k}_ms"])
        rows.append((f"{r['blocks']} / {r['tokens']}", f"{r['recompute_ms']:,.2f} ms",
                     _sweep_load(r, "load"), _sweep_load(r, "trimmed"),
                     {"recompute": "recompute", "load": "load", "trimmed": "load, trimmed"}[best]))
    device = res["options"]["device"]
    out = [f"break-even sweep: TTFT of one request alone, median of {reps}, {SWEEP_SUFFIX}-token suffix", ""]
    out += _grid(rows)
    for key, title in (("load", "load from peer"), ("trimmed", "load from peer, trimmed")):
        n = sw["break_even_blocks"].get(key)
        sizes = [r["blocks"] for r in sw["rows"]]
        if n is None:
            verdict = f"recomputing wins at {sizes[-1]} blocks (the largest measured)"
        elif n == sizes[0]:
            verdict = f"loading wins at every size measured (from {n} block{'s' if n > 1 else ''})"
        else:
            verdict = f"loading wins from {n} blocks ({n * BLOCK} tokens) up"
        out.append(f"break-even on {device}, {title}: {verdict}")
    return out


def plot(res: dict[str, Any], path: str) -> None:
    """TTFT distributions of the three columns, and the break-even sweep."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweep = res["sweep"]["rows"]
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7.5, 5), squeeze=False)
    ax = axes[0][0]
    colors = {"recompute": "#1f77b4", "load": "#ff7f0e", "trimmed": "#2ca02c"}
    for key, title, _ in COLUMNS:
        c = res["columns"][key]
        v = sorted(c["ttft_ms"])
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", color=colors[key],
                    label=f"{title} (p50 {c['ttft_p50_ms']:,.0f} ms)")
        for x in c["long_ttft_ms"]:
            ax.axvline(x, color=colors[key], linestyle=":", alpha=0.7)
    ax.set_xlabel("time to first token (ms); dotted: cold long prompts")
    ax.set_ylabel("fraction of warm requests")
    m, o = res["model"], res["options"]
    ax.set_title(f"Warm TTFT, Qwen2 {m['layers']}L {m['dtype']}, {o['device']}, {o['concurrency']} in flight")
    ax.legend()
    if sweep:
        ax2 = axes[0][1]
        x = [r["blocks"] for r in sweep]
        for key, title, _ in COLUMNS:
            ax2.plot(x, [r[f"{key}_ms"] for r in sweep], marker="o", color=colors[key], label=title)
        for key in ("load", "trimmed"):
            n = res["sweep"]["break_even_blocks"].get(key)
            if n is not None:
                ax2.axvline(n, color=colors[key], linestyle="--", alpha=0.6)
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("prefix (16-token blocks, log)")
        ax2.set_ylabel("TTFT, one request alone (ms, log)")
        ax2.set_title(f"Break-even: load vs recompute ({o['device']}; dashed: loading wins from here)")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line -----------------------------------------------------------------------
_positive = cli_int(1)
_non_negative = cli_int(0)


def _mib_arg(text: str) -> float:
    """An ``argparse`` type: a size in MiB, >= 0 (fractions allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of MiB: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite size >= 0: {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (for ``python -m xavier_async.demo`` and ``xavier-async demo``)."""
    g = parser.add_argument_group("demo")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: small float32 model, every replica on the CPU; cuda: the "
                        "Qwen2.5-0.5B shape in BF16, sources on GPU 0, B on GPU 1 (on "
                        "cuda:0 too when only one GPU is visible)")
    g.add_argument("--model", choices=("small", "qwen2.5-0.5b"),
                   help="model shape (default: small on cpu, qwen2.5-0.5b on cuda)")
    g.add_argument("--layers", type=_positive, help="override the model's layer count")
    g.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="override the model's dtype (answers are compared bit for bit only in "
                        "float32 on the CPU; otherwise teacher-forced, within --rtol)")
    g.add_argument("--cold", type=_positive, help="cold prompts on the sources")
    g.add_argument("--warm", type=_positive, help="warm requests on replica B, per column")
    g.add_argument("--prefix-blocks", type=_positive, help="16-token blocks each warm request shares")
    g.add_argument("--suffix-tokens", type=_positive, help="longest own suffix of a warm request")
    g.add_argument("--new-tokens", type=_positive, help="tokens decoded per request")
    g.add_argument("--long-prompts", type=_non_negative,
                   help="cold long prompts among the warm requests (the cold long-prompt row)")
    g.add_argument("--long-blocks", type=_positive, help="16-token blocks of a cold long prompt")
    g.add_argument("--concurrency", type=_positive, default=16, help="requests in flight at once")
    g.add_argument("--step-tokens", type=_positive,
                   help="token budget of one engine step (decode tokens + prefill chunks)")
    g.add_argument("--cancel", type=_non_negative, default=2,
                   help="warm requests cancelled mid-load, per load column")
    g.add_argument("--sweep", metavar="SIZES",
                   help="break-even sweep: prefix sizes in blocks, comma-separated, or 'none' "
                        "(default 1,2,4,...,256)")
    g.add_argument("--sweep-reps", type=_positive, help="runs per sweep size and mode (the median is shown)")
    g.add_argument("--source-slots", type=_positive,
                   help="slots of each source's paged cache (default: half the shared prefix set, "
                        "at least the largest cold request: the sources reuse the slots of "
                        "published blocks, which the snapshot store keeps serving)")
    g.add_argument("--device-tier-mib", type=_mib_arg,
                   help="each source's snapshot store device tier (default: cpu, half the cold "
                        "prompts' blocks, so that it demotes to the host tier; cuda, 256 MiB as "
                        "in the seed's deployment)")
    g.add_argument("--host-tier-mib", type=_mib_arg,
                   help="each source's snapshot store host tier (default: cpu, room for every "
                        "published block; cuda, the library's default). Both tiers 0: no store, "
                        "the sources serve and keep their live slots")
    g.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    g.add_argument("--threads", type=_positive, default=1, help="torch threads per replica")
    g.add_argument("--rtol", type=float, default=2 ** -5,
                   help="BF16 only: the near-tie margin, relative to the request's largest |logit| "
                        "(2**-5: eight BF16 steps there): a token may differ from the reference "
                        "(teacher-forced) only where the reference's choice led by less")
    g.add_argument("--logit-rtol", type=float, default=2 ** -3,
                   help="BF16 only: the largest |logit difference| accepted, relative to the "
                        "request's largest |logit| (default 2**-3: the first H200 run of the "
                        "batched engine measured 3.1-6.8%% with the loaded KV bit-equal to the "
                        "recomputed, from the suffix computed in GEMMs of another shape)")
    g.add_argument("--kill-source", action="store_true",
                   help="failure injection: SIGKILL source A while B's loads are in flight")
    g.add_argument("--start-timeout", type=float, default=300.0, help="seconds a replica may take to start")
    g.add_argument("--json", metavar="PATH", help="write every figure and check as JSON")
    g.add_argument("--plot", metavar="PATH", help="write a PNG of the TTFT distributions and the "
                                                  "sweep (needs matplotlib: the bench extra)")


def fill_defaults(args: argparse.Namespace) -> None:
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.cancel >= args.warm:
        raise DemoError(f"--cancel ({args.cancel}) must be below --warm ({args.warm})")
    if args.step_tokens < args.concurrency:
        raise DemoError(f"--step-tokens ({args.step_tokens}) must fit one decode token of each "
                        f"request in flight (--concurrency {args.concurrency})")
    sweep_sizes(args)


def shape_of(args: argparse.Namespace) -> ModelShape:
    name = getattr(args, "model", None) or ("qwen2.5-0.5b" if args.device == "cuda" else "small")
    shape = QWEN25_05B if name == "qwen2.5-0.5b" else SMALL
    if getattr(args, "layers", None):
        shape = ModelShape(**{**asdict(shape), "layers": args.layers})
    if getattr(args, "dtype", None):
        shape = ModelShape(**{**asdict(shape), "dtype": args.dtype})
    return shape


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed options; print the table. 0 when every check passed, 1 when
    one failed, 2 when the demo cannot run here."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("xavier-async demo needs transformers: pip install 'xavier-async[demo]'", file=sys.stderr)
        return 2
    if args.device == "cuda":
        from ..testing.devices import peer_device
        try:
            peer_device(1, "cuda")  # one replica per GPU; all on the one GPU there is
        except RuntimeError as exc:
            print(f"--device cuda: {exc}", file=sys.stderr)
            return 2
    try:
        res = run_demo(args)
    except DemoError as exc:
        print(f"xavier-async demo: {exc}", file=sys.stderr)
        return 2
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    if args.plot:
        plot(res, args.plot)
    return 0 if res["ok"] else 1

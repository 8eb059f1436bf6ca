"""The demo's driver (the parent process): it starts two replicas, owns the block
directory (block hash -> (rank, slot)), routes requests, checks every warm answer and
prints the table.

The directory stands for what a real stack already has: a router's prefix index or a
block tracker that replicas report published blocks to (vLLM's KV events, Dynamo's KV
router, the seed's block tracker). The demo keeps it as a plain dict in this process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .._checks import cli_int
from .model import BLOCK, QWEN25_05B, SMALL, ModelShape, block_hashes, cacheable_blocks

#: ranks of the two replicas
A, B = 0, 1

#: defaults per device: (shape, cold prompts, warm requests, prefix blocks, max suffix, new tokens)
DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": dict(cold=4, warm=32, prefix_blocks=8, suffix_tokens=24, new_tokens=8),
    "cuda": dict(cold=8, warm=64, prefix_blocks=64, suffix_tokens=64, new_tokens=16),
}


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

    def wait_ready(self, timeout: float) -> None:
        self.address = self._reply(timeout)

    def _reply(self, timeout: float, on_event: Callable[[str], None] | None = None) -> Any:
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

    def call(self, cmd: str, arg: Any = None, timeout: float = 600.0,
             on_event: Callable[[str], None] | None = None) -> Any:
        self.conn.send((cmd, arg))
        return self._reply(timeout, on_event)

    def stop(self) -> None:
        """SIGSTOP: the replica freezes (it serves nothing) until killed."""
        assert self.proc.pid is not None
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
def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Cold prompts (``prefix_blocks`` full blocks + a 1-15 token tail) and warm prompts
    (one cold prompt's full blocks, round robin, + a 1..``suffix_tokens`` suffix)."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]
    prefixes = [tokens(args.prefix_blocks * BLOCK) for _ in range(args.cold)]
    cold = [p + tokens(rng.randint(1, BLOCK - 1)) for p in prefixes]
    warm = [prefixes[i % args.cold] + tokens(rng.randint(1, args.suffix_tokens))
            for i in range(args.warm)]
    return cold, warm


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


# -- the run ----------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole demo; return every figure and check as a JSON-able dict."""
    fill_defaults(args)
    shape = shape_of(args)
    cold, warm = make_workload(args, shape.vocab)
    salt = f"qwen2-random-seed{args.seed}-{shape}".encode()
    from ..testing.devices import gpu_facts, peer_device
    dev_a, dev_b = peer_device(0, args.device).device, peer_device(1, args.device).device
    common = dict(shape=asdict(shape), seed=args.seed, threads=args.threads,
                  chunk_tokens=args.prefill_chunk, trimmed=args.trimmed)
    specs = [dict(common, rank=A, device=dev_a,
                  num_slots=args.cold * args.prefix_blocks + 4),
             dict(common, rank=B, device=dev_b,
                  num_slots=min(args.concurrency, args.warm) * (args.prefix_blocks + 1) + 4)]
    replicas: list[ReplicaProcess] = []
    killed = False
    try:
        for spec in specs:  # both start (import torch, build the model) at the same time
            replicas.append(ReplicaProcess(spec))
        for r in replicas:
            r.wait_ready(args.start_timeout)
        ra, rb = replicas
        assert ra.address is not None
        rb.call("connect", ra.address)

        # 1. cold prompts on A: prefill, publish, and report to the directory
        directory: dict[str, tuple[int, int]] = {}
        cold_reqs = [{"id": i, "tokens": t, "hashes": block_hashes(t, cacheable_blocks(len(t)), salt)}
                     for i, t in enumerate(cold)]
        cold_res = ra.call("batch", {"mode": "cold", "requests": cold_reqs, "new_tokens": args.new_tokens,
                                     "concurrency": args.concurrency})
        for r in cold_res["requests"]:
            for h, slot in r["published"]:
                directory[h] = (A, slot)

        # 2. route warm requests: the longest cached prefix and who holds it
        warm_reqs = []
        for i, t in enumerate(warm):
            owner, hits = lookup(directory, block_hashes(t, cacheable_blocks(len(t)), salt))
            warm_reqs.append({"id": i, "tokens": t, "hits": hits, "source": owner})
        base = {"requests": warm_reqs, "new_tokens": args.new_tokens, "concurrency": args.concurrency}

        # 3. the reference: B recomputes every prefix itself (same chunks as A)
        ref = rb.call("batch", {**base, "mode": "recompute"})

        # 4. B loads the prefixes from A; some requests are cancelled mid-load
        cancel = [(k + 1) * args.warm // (args.cancel + 1) for k in range(args.cancel)]

        def on_event(event: str) -> None:
            nonlocal killed
            if event == "loading" and not killed:
                ra.kill()  # failure injection: the source dies with B's loads in flight
                killed = True
        if args.kill_source:
            ra.stop()  # frozen: B's first load stays in flight until A is killed
        loaded = rb.call("batch", {**base, "mode": "load", "cancel": cancel,
                                   "signal_loading": args.kill_source}, on_event=on_event)
        # 5. the cancelled requests again: the cache they left behind must still serve right
        again = rb.call("batch", {**base, "mode": "load",
                                  "requests": [warm_reqs[i] for i in cancel]}) if cancel else \
            {"requests": [], "wall_s": 0.0}

        metrics_a = None if killed else ra.call("metrics")
        metrics_b = rb.call("metrics")
    finally:
        for r in replicas:
            r.close()
    res = summarize(args, shape, cold_res, ref, loaded, again, metrics_a, metrics_b, killed)
    # one GPU for both replicas (their timings are not the two-GPU ones) is said here
    res.update(devices={"A": dev_a, "B": dev_b}, **gpu_facts(args.device))
    return res


def summarize(args: argparse.Namespace, shape: ModelShape, cold_res: dict[str, Any], ref: dict[str, Any],
              loaded: dict[str, Any], again: dict[str, Any], metrics_a: dict[str, Any] | None,
              metrics_b: dict[str, Any], killed: bool) -> dict[str, Any]:
    exact = shape.dtype == "float32" and args.device == "cpu"  # bit-exact claim: CPU float32 only
    served = [r for r in loaded["requests"] if not r["cancelled"]] + again["requests"]
    cancelled = [r for r in loaded["requests"] if r["cancelled"]]
    problems: list[str] = []
    for r in served:
        rid = r["id"]
        tol = args.rtol * (r.get("max_abs_ref") or 0.0)
        if exact and r["tokens_equal"] is not True:
            problems.append(f"request {rid}: tokens differ from the recomputed reference")
        if not exact and r["tokens_equal"] is None:
            problems.append(f"request {rid}: no reference to compare with")
        for step, margin in r.get("flips") or ():
            if margin > tol:  # a choice the reference made clearly: it must be ours too
                problems.append(f"request {rid}: token {step} differs where the reference led "
                                f"by {margin:.4g} > tolerance {tol:.4g}")
        if exact and r["logits_equal"] is not True:
            problems.append(f"request {rid}: logits not bit-equal (max |diff| {r['max_abs_diff']})")
        if not exact and r["max_abs_diff"] is not None \
                and r["max_abs_diff"] > args.rtol * r["max_abs_ref"]:
            problems.append(f"request {rid}: max |logit diff| {r['max_abs_diff']:.4g} > rtol {args.rtol} "
                            f"x max |logit| {r['max_abs_ref']:.4g}")
        if exact and r["loaded"] and r["kv_equal"] is not True:
            problems.append(f"request {rid}: loaded KV bytes differ from the recomputed ones")
    missing = set(range(args.warm)) - {r["id"] for r in served}
    if missing:
        problems.append(f"warm requests {sorted(missing)[:8]} never answered")

    block_bytes = shape.block_nbytes
    blocks_loaded = sum(r["hits"] for r in served if r["loaded"])
    blocks_cancelled = sum(r["hits"] for r in cancelled)
    peer = (metrics_a or {}).get("peers", {}).get(B, {})
    useful = peer.get("useful_bytes") if metrics_a else None
    wire = peer.get("wire_bytes") if metrics_a else None
    if useful is not None:
        # a load cancelled mid-copy still moved its bytes (a started copy is finished)
        lo, hi = blocks_loaded * block_bytes, (blocks_loaded + blocks_cancelled) * block_bytes
        if not (lo <= useful <= hi and useful % block_bytes == 0):
            problems.append(f"useful bytes {useful} not in [{lo}, {hi}] in whole blocks")
        if wire is not None and wire < useful:
            problems.append(f"wire bytes {wire} < useful bytes {useful}")
    failures = [r for r in served if r["fallback"]]

    def phase(reqs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
        ttft = [r["ttft_s"] * 1e3 for r in reqs if "ttft_s" in r]
        gen = sum(len(r.get("tokens", ())) for r in reqs)
        return {"requests": len(reqs), "ttft_ms": ttft, "ttft_p50_ms": percentile(ttft, 0.5),
                "ttft_p95_ms": percentile(ttft, 0.95), "output_tokens": gen, "wall_s": wall,
                "tokens_per_s": gen / wall if wall > 0 else float("nan")}

    load_phase = [r for r in loaded["requests"] if not r["cancelled"]]
    return {
        "ok": not problems, "problems": problems,
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "model": shape.as_dict(), "exact": exact,
        "cold": phase(cold_res["requests"], cold_res["wall_s"]),
        "recompute": phase(ref["requests"], ref["wall_s"]),
        "load": phase(load_phase, loaded["wall_s"]),
        "block_bytes": block_bytes, "blocks_loaded": blocks_loaded,
        "blocks_recomputed": sum(r["hits"] for r in ref["requests"]),
        "blocks_cancelled": blocks_cancelled, "useful_bytes": useful, "wire_bytes": wire,
        "wire_over_useful": (wire / useful) if useful and wire is not None else None,
        "load_failures": len(failures),
        "fallbacks": sorted({r["fallback"] for r in failures}),
        "cancelled": len(cancelled), "source_killed": killed,
        "correct": sum(1 for r in served if r["tokens_equal"] is True),
        "near_tie_flips": sum(len(r.get("flips") or ()) for r in served) if not exact else 0,
        "teacher_forced": not exact,
        "logits_bit_equal": sum(1 for r in served if r["logits_equal"] is True),
        "max_abs_logit_diff": max((r["max_abs_diff"] or 0.0 for r in served), default=0.0),
        "kv_bytes_equal": sum(1 for r in served if r["loaded"] and r["kv_equal"] is True),
        "served": served, "metrics": {"A": metrics_a, "B": metrics_b},
    }


# -- output -----------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.2f} MiB"


def table(res: dict[str, Any]) -> str:
    rc, ld = res["recompute"], res["load"]
    w = res["wire_over_useful"]
    rows = [
        ("", "recompute", "load from peer"),
        ("warm requests", str(rc["requests"]), str(ld["requests"])),
        ("TTFT p50", f"{rc['ttft_p50_ms']:.1f} ms", f"{ld['ttft_p50_ms']:.1f} ms"),
        ("TTFT p95", f"{rc['ttft_p95_ms']:.1f} ms", f"{ld['ttft_p95_ms']:.1f} ms"),
        ("throughput (output tokens/s)", f"{rc['tokens_per_s']:.1f}", f"{ld['tokens_per_s']:.1f}"),
        ("prefix blocks", f"{res['blocks_recomputed']} computed",
         f"{res['blocks_loaded']} loaded"),
        ("useful bytes", "-", _mib(res["useful_bytes"])),
        ("bytes on the wire", "-", _mib(res["wire_bytes"])),
        ("wire / useful", "-", "-" if w is None else f"{w:.3f}"),
        ("load failures (fell back)", "-", f"{res['load_failures']}"),
        ("cancelled mid-load", "-", f"{res['cancelled']}"),
    ]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(width[i]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(r))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    m = res["model"]
    lines += ["", f"model: Qwen2 {m['layers']} layers, hidden {m['hidden']}, {m['kv_heads']} KV heads x "
                  f"{m['head_dim']}, {m['dtype']}; block {m['block_nbytes']:,} B",
              f"tokens equal to the recomputed reference: {res['correct']}/{len(res['served'])}"
              f"{' (teacher-forced; near-tie flips ' + str(res['near_tie_flips']) + ')' if res['teacher_forced'] else ''}; "
              f"logits bit-equal: {res['logits_bit_equal']}; max |logit diff| "
              f"{res['max_abs_logit_diff']:.3g}; loaded blocks' KV bytes equal: {res['kv_bytes_equal']}",
              "OK" if res["ok"] else "FAILED: " + "; ".join(res["problems"][:5])]
    if res.get("note"):
        lines.append(f"note: {res['note']}")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("recompute", "recompute prefix"), ("load", "load prefix from peer")):
        v = sorted(res[key]["ttft_ms"])
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of warm requests")
    m = res["model"]
    ax.set_title(f"warm TTFT, Qwen2 {m['layers']}L {m['dtype']}, {res['options']['concurrency']} in flight")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- command line -----------------------------------------------------------------------
_positive = cli_int(1)
_non_negative = cli_int(0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (for ``python -m xavier_async.demo`` and ``xavier-async demo``)."""
    g = parser.add_argument_group("demo")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: small float32 model, both replicas on the CPU; cuda: the "
                        "Qwen2.5-0.5B shape in BF16, replica A on cuda:0, B on cuda:1 (both on "
                        "cuda:0 with one GPU, time-sliced)")
    g.add_argument("--cold", type=_positive, help="cold prompts on replica A")
    g.add_argument("--warm", type=_positive, help="warm requests on replica B")
    g.add_argument("--prefix-blocks", type=_positive, help="16-token blocks each warm request shares")
    g.add_argument("--suffix-tokens", type=_positive, help="longest own suffix of a warm request")
    g.add_argument("--new-tokens", type=_positive, help="tokens decoded per request")
    g.add_argument("--concurrency", type=_positive, default=16, help="requests in flight at once")
    g.add_argument("--cancel", type=_non_negative, default=2, help="warm requests cancelled mid-load")
    g.add_argument("--prefill-chunk", type=_positive, default=512,
                   help="prefill chunk in tokens (a multiple of 16)")
    g.add_argument("--layers", type=_positive, help="override the model's layer count")
    g.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    g.add_argument("--threads", type=_positive, default=1, help="torch threads per replica")
    g.add_argument("--trimmed", action="store_true", help="move only the payload (EndpointConfig(trimmed=True))")
    g.add_argument("--rtol", type=float, default=2 ** -5,
                   help="BF16 only: largest |logit difference| accepted (teacher-forced), relative "
                        "to the request's largest |logit| (2**-5: eight BF16 steps there), and the "
                        "margin below which the reference's choice counts as a near-tie")
    g.add_argument("--model", choices=("small", "qwen2.5-0.5b"),
                   help="model shape (default: small on cpu, qwen2.5-0.5b on cuda)")
    g.add_argument("--kill-source", action="store_true",
                   help="failure injection: SIGKILL replica A while B's loads are in flight")
    g.add_argument("--start-timeout", type=float, default=300.0, help="seconds a replica may take to start")
    g.add_argument("--json", metavar="PATH", help="write every figure and check as JSON")
    g.add_argument("--plot", metavar="PATH", help="write a TTFT plot (needs matplotlib: the bench extra)")


def fill_defaults(args: argparse.Namespace) -> None:
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.prefill_chunk % BLOCK:
        raise DemoError(f"--prefill-chunk must be a multiple of {BLOCK}, got {args.prefill_chunk}")
    if args.cancel >= args.warm:
        raise DemoError(f"--cancel ({args.cancel}) must be below --warm ({args.warm})")


def shape_of(args: argparse.Namespace) -> ModelShape:
    name = getattr(args, "model", None) or ("qwen2.5-0.5b" if args.device == "cuda" else "small")
    shape = QWEN25_05B if name == "qwen2.5-0.5b" else SMALL
    if getattr(args, "layers", None):
        shape = ModelShape(**{**asdict(shape), "layers": args.layers})
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
            peer_device(1, "cuda")  # one replica per GPU; both on the one GPU there is
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

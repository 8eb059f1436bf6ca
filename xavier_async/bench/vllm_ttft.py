"""``xavier-async bench --vllm``: B's time to first token inside real vLLM on the CPU.

Two replicas, one core each (A on CPU 0, B on CPU 1), the test model (a small Qwen2 with
real random weights). For each prefix length, A computes a prompt; B is given the prefix
plus one token (``max_tokens=1``, so its TTFT is the call's wall time) and:

* **recompute**: a prefix nobody holds (B computes it all);
* **xavier**: loads the prefix from A through ``XavierConnector`` (sync loads);
* **nixl**: vLLM's own NixlConnector, P/D (A prefills with ``do_remote_decode``; B gets
  its ``kv_transfer_params``), the anchor, in the same invocation.

Beside them, B's **one step**: a 2-token prompt, nothing to load, A alive. Every figure
is a median over ``reps`` prompts; tokens are compared with A's own answer.

And **decode while serving** (:func:`serving_rows`): A's output tokens/s decoding a batch
alone and while B loads A's prefixes as fast as it can, the ratio against the target
(issue 34: >= 0.90)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..testing.vllm_replica import (
    Replica,
    ReplicaSpec,
    first_token_latencies,
    make_model,
    xavier_config,
)
from . import schedstat

PREFIXES = (128, 256, 512, 1024, 2048, 4096)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4096) for _ in range(n)]


def _ttft(replica: Replica, prompt: list[int]) -> tuple[float, list[int]]:
    g = replica.generate([prompt], 1)
    return g.seconds, g.tokens[0]


def _ms(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e3


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] * 1e3


#: the 16-in-flight block: requests, their shared prefix length, tokens each decodes
BATCH, BATCH_PREFIX, BATCH_TOKENS = 16, 1024, 16
_STATS = {"disable_log_stats": False}   # vLLM fills RequestOutput.metrics (per-request TTFT)


def _batch_figures(ttfts: Sequence[float | None], tokens: list[list[int]], seconds: float
                   ) -> dict[str, Any]:
    """Requests that arrived together: TTFT p50/p95 (vLLM's per-request metric; the call's
    wall time where vLLM gave none) and output tokens/s over the call."""
    ts = [t for t in ttfts if t is not None] or [seconds]
    return {"ttft_p50_ms": _pct(ts, 0.5), "ttft_p95_ms": _pct(ts, 0.95),
            "tokens_per_s": sum(map(len, tokens)) / seconds, "wall_ms": seconds * 1e3,
            "tokens": tokens}


def _batch(replica: Replica, prompts: list[list[int]]) -> dict[str, Any]:
    """``prompts`` arriving together at ``replica``, each decoding ``BATCH_TOKENS``."""
    g = replica.generate(prompts, BATCH_TOKENS)
    return _batch_figures(g.ttfts, g.tokens, g.seconds)


def _xavier_pair(model: str, tag: str, port: int, llm_kwargs: dict[str, Any] | None = None,
                 **b_extra: Any) -> tuple[Replica, Replica]:
    """A (rank 0, CPU 0, listening on ``port``) and B (rank 1, CPU 1, ``port + 1``) with
    ``XavierConnector``, each writing its stats to a file of its own; started, not yet
    ready. ``b_extra``: more of B's connector settings."""
    stats = f"/tmp/xavier-async-vllm-{tag}-{os.getpid()}-{{r}}-{{tp}}.json"
    addresses = (f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}")

    def replica(rank: int, **extra: Any) -> Replica:
        cfg = xavier_config(rank, addresses[rank], [addresses[1 - rank]],
                            stats_file=stats.replace("{r}", "ab"[rank]), **extra)
        return Replica(ReplicaSpec(model, str(rank), cfg, llm_kwargs=dict(llm_kwargs or {})),
                       wait=False)

    return replica(0), replica(1, **b_extra)


def xavier_rows(model: str, prefixes: Sequence[int], reps: int, mode: str = "sync",
                batch: bool = True) -> dict[str, Any]:
    """A (CPU 0) and B (CPU 1) with ``XavierConnector``; B loads in ``mode``."""
    a, b = _xavier_pair(model, "bench", 7511, _STATS, load_mode=mode)
    rows: dict[Any, Any] = {"mode": mode}
    try:
        a.wait_ready(), b.wait_ready()
        time.sleep(1.0)                                   # the replicas find each other
        rng = random.Random(1)
        rows["one_step_ms"] = _ms([_ttft(b, _ids(rng, 2))[0] for _ in range(reps + 3)][3:])
        lags: list[float] = []
        for n in prefixes:
            rec, load, hit, same = [], [], [], 0
            for _ in range(reps + 1):
                prefix = _ids(rng, n)
                rec.append(_ttft(b, _ids(rng, n) + [7])[0])
                a.generate([prefix + [5]], 1)
                time.sleep(0.2)                           # the announcement reaches B
                sa, sb = a.stats(), b.stats()
                lags.append(sb["last_announce_received"] - sa["last_publish_step_end"])
                t_load, tok = _ttft(b, prefix + [7])
                load.append(t_load)
                hit.append(_ttft(b, prefix + [8])[0])     # B's own prefix cache: the floor
                same += tok == a.generate([prefix + [7]], 1).tokens[0]
            rows[n] = {"recompute_ms": _ms(rec[1:]), "xavier_ms": _ms(load[1:]),
                       "local_hit_ms": _ms(hit[1:]), "tokens_equal": same, "tokens_of": reps + 1}
        rows["announce_ms"] = {"p50": _pct(lags, 0.5), "max": max(lags) * 1e3, "n": len(lags)}
        if batch:
            fresh = [_ids(rng, BATCH_PREFIX) + [7] for _ in range(BATCH)]
            rows["batch_recompute"] = _batch(b, fresh)
            held = [_ids(rng, BATCH_PREFIX) for _ in range(BATCH)]
            a.generate([p + [5] for p in held], 1)
            time.sleep(0.3)
            before = b.stats()
            got = _batch(b, [p + [7] for p in held])
            after = b.stats()
            want = a.generate([p + [7] for p in held], BATCH_TOKENS).tokens
            got["first_tokens_equal"] = sum(x[:1] == y[:1] for x, y in zip(got["tokens"], want))
            got["loads"] = after["loads"] - before["loads"]
            got["load_failures"] = after["load_failures"] - before["load_failures"]
            rows["batch_xavier"] = got
        sa, sb = a.stats(), b.stats()
        rows["publish_ms_per_step"] = sa["publish_seconds"] / max(1, sa["publishes"]) * 1e3
        rows["blocks_per_publish"] = sa["blocks_published"] / max(1, sa["publishes"])
        rows["load_ms_per_load"] = sb["load_seconds"] / max(1, sb["loads"]) * 1e3
        rows["stages_b"], rows["stages_a"] = sb.get("stages", {}), sa.get("stages", {})
    finally:
        a.close()
        b.close()
    return rows


#: decode while serving: A's batch (requests, prompt tokens, tokens each decodes) and
#: the prefixes B loads from A over and over (how many, tokens each)
DECODE_BATCH, DECODE_PROMPT, DECODE_TOKENS = 16, 16, 96
SERVED_PREFIXES, SERVED_PREFIX = 8, 1024
#: issue 34: a replica serving a peer's loads at full rate keeps this share of its decode
DECODE_WHILE_SERVING_TARGET = 0.90


def serving_rows(model: str) -> dict[str, Any]:
    """A (CPU 0) decodes a batch alone; while B (CPU 1) loads A's prefixes as fast as it
    can (B's own prefix cache reset before each round, so every round loads them all
    again); while B computes prompts of the same length itself (the control: B as busy,
    A serving nothing); and alone again. A's output tokens/s each time and what B loaded.
    B's first tokens are compared with A's own answers."""
    a, b = _xavier_pair(model, "serving", 7521)
    rng = random.Random(3)

    def decode() -> float:
        g = a.generate([_ids(rng, DECODE_PROMPT) for _ in range(DECODE_BATCH)], DECODE_TOKENS)
        return sum(map(len, g.tokens)) / g.seconds

    cpu: dict[str, Any] = {}   # per phase: A's and B's process trees on a core / waiting
    pids = {name: r.proc.pid for name, r in (("a", a), ("b", b)) if r.proc.pid is not None}

    def decode_timed(phase: str) -> float:
        with schedstat.measured(pids, cpu, phase, tree=True, top=4):
            return decode()

    def decode_during(one_round: Any, phase: str) -> tuple[float, int, float]:
        """A's decode while B repeats ``one_round``: tokens/s, B's rounds, their seconds."""
        stop, rounds = threading.Event(), [0]

        def loop() -> None:
            while not stop.is_set():
                one_round()
                rounds[0] += 1

        t0 = time.perf_counter()
        worker = threading.Thread(target=loop, daemon=True)
        worker.start()
        try:
            tokens_per_s = decode_timed(phase)
        finally:
            stop.set()
            worker.join(timeout=300)
        return tokens_per_s, rounds[0], time.perf_counter() - t0

    try:
        a.wait_ready(), b.wait_ready()
        time.sleep(1.0)
        held = [_ids(rng, SERVED_PREFIX) for _ in range(SERVED_PREFIXES)]
        a.generate([p + [5] for p in held], 1)
        want = a.generate([p + [7] for p in held], 1).tokens
        time.sleep(0.3)                                   # the announcements reach B
        decode()                                          # warm-up
        alone = [decode_timed("alone")]
        equal = [0, 0]

        def load_round() -> None:
            b.reset_prefix_cache()
            got = b.generate([p + [7] for p in held], 1).tokens
            equal[0] += sum(x == y for x, y in zip(got, want))
            equal[1] += len(want)

        def compute_round() -> None:
            b.generate([_ids(rng, SERVED_PREFIX) + [7] for _ in held], 1)

        before = b.stats()
        serving, rounds, seconds = decode_during(load_round, "serving")
        after = b.stats()
        control, control_rounds, _ = decode_during(compute_round, "b_computing")
        alone.append(decode())
        moved = after["bytes_loaded"] - before["bytes_loaded"]
        return {"alone_tokens_per_s": alone, "serving_tokens_per_s": serving,
                "b_computing_tokens_per_s": control,
                "vs_alone": serving / statistics.mean(alone), "vs_b_computing": serving / control,
                "rounds": rounds, "control_rounds": control_rounds,
                "loads": after["loads"] - before["loads"],
                "load_failures": after["load_failures"] - before["load_failures"],
                "bytes_loaded": moved, "load_mb_per_s": moved / seconds / 1e6,
                "first_tokens_equal": equal[0], "first_tokens_of": equal[1],
                # A's and B's processes (engine cores included) during A's decode: cpu
                # seconds, and seconds runnable but waiting for a core (Linux schedstat)
                **({"cpu": cpu} if cpu else {})}
    finally:
        a.close()
        b.close()


def plain_rows(model: str, prefixes: Sequence[int], reps: int) -> dict[str, Any]:
    """B without a connector (A alive, with one): the no-hit overhead's reference."""
    a = Replica(ReplicaSpec(model, "0", xavier_config(0, "127.0.0.1:7511", ["127.0.0.1:7512"]),
                            llm_kwargs=_STATS), wait=False)
    b = Replica(ReplicaSpec(model, "1", None, llm_kwargs=_STATS), wait=False)
    rows: dict[Any, Any] = {}
    try:
        a.wait_ready(), b.wait_ready()
        rng = random.Random(1)
        rows["one_step_ms"] = _ms([_ttft(b, _ids(rng, 2))[0] for _ in range(reps + 3)][3:])
        for n in prefixes:
            rows[n] = {"recompute_ms": _ms([_ttft(b, _ids(rng, n) + [7])[0]
                                           for _ in range(reps + 1)][1:])}
    finally:
        a.close()
        b.close()
    return rows


def _nixl_llm(model: str, role: str, cpu: str, port: str) -> Any:
    os.setpgrp()
    os.environ.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=port,
                      VLLM_CPU_OMP_THREADS_BIND=cpu, VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_LOGGING_LEVEL="WARNING")
    from vllm import LLM
    return LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
               max_model_len=8192, block_size=128, seed=0,
               enable_prefix_caching=False, disable_log_stats=False,
               kv_transfer_config=dict(kv_connector="NixlConnector", kv_role=role,
                                       kv_buffer_device="cpu",
                                       kv_connector_extra_config={"num_threads": 1}))


def _nixl_prefill(model: str, conn: Any) -> None:
    llm = _nixl_llm(model, "kv_producer", "0", "5600")
    from vllm import SamplingParams
    conn.send("ready")
    while (prompts := conn.recv()) is not None:
        sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        conn.send([(o.kv_transfer_params, list(o.outputs[0].token_ids)) for o in outs])


def _nixl_decode(model: str, conn: Any) -> None:
    llm = _nixl_llm(model, "kv_consumer", "1", "5601")
    from vllm import SamplingParams
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        prompts, params, max_tokens = msg
        sps = [SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                              extra_args={"kv_transfer_params": p} if p else None) for p in params]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        conn.send((wall, [list(o.outputs[0].token_ids) for o in outs], first_token_latencies(outs)))


def nixl_rows(model: str, prefixes: Sequence[int], reps: int, batch: bool = True) -> dict[str, Any]:
    """The anchor: vLLM's NixlConnector P/D on the same prompts' shapes and model."""
    ctx = mp.get_context("spawn")
    (pa, ca), (pb, cb) = ctx.Pipe(), ctx.Pipe()
    procs = [ctx.Process(target=_nixl_prefill, args=(model, ca)),
             ctx.Process(target=_nixl_decode, args=(model, cb))]
    for p in procs:
        p.start()
    rows: dict[Any, Any] = {}

    def prefill(prompts: list[list[int]]) -> list[Any]:
        pa.send(prompts)
        got: list[Any] = pa.recv()
        return got

    def decode(prompts: list[list[int]], params: list[Any], max_tokens: int) -> Any:
        pb.send((prompts, params, max_tokens))
        return pb.recv()

    try:
        for conn in (pa, pb):
            if not conn.poll(300) or conn.recv() != "ready":
                raise RuntimeError("a NixlConnector replica did not start")
        rng = random.Random(2)
        rows["one_step_ms"] = _ms([decode([_ids(rng, 2)], [None], 1)[0]
                                   for _ in range(reps + 3)][3:])
        for n in prefixes:
            times, same = [], 0
            for _ in range(reps + 1):
                prompt = _ids(rng, n + 1)
                [(params, tok_a)] = prefill([prompt])
                t, [tok_b], _ = decode([prompt], [params], 1)
                same += tok_a == tok_b
                times.append(t)
            rows[n] = {"nixl_ms": _ms(times[1:]), "tokens_equal": same, "tokens_of": reps + 1}
        if batch:
            prompts = [_ids(rng, BATCH_PREFIX) + [7] for _ in range(BATCH)]
            pre = prefill(prompts)
            wall, tokens, ttfts = decode(prompts, [p for p, _ in pre], BATCH_TOKENS)
            got = _batch_figures(ttfts, tokens, wall)
            got["first_tokens_equal"] = sum(t[:1] == a for t, (_, a) in zip(tokens, pre))
            rows["batch_nixl"] = got
    finally:
        for conn in (pa, pb):
            try:
                conn.send(None)
            except OSError:
                pass
        time.sleep(1)
        for p in procs:
            if p.pid is not None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
            p.join(timeout=10)
    return rows


def run(model_dir: str = "/tmp/xavier-async-vllm-model", prefixes: Sequence[int] = PREFIXES,
        reps: int = 3, anchor: bool = True, batch: bool = True, serving: bool = True
        ) -> dict[str, Any]:
    """The section's figures (milliseconds), keyed by prefix length: XavierConnector with
    sync and async loads, B without a connector (the no-hit reference), NixlConnector;
    and A's decode throughput while B loads from it (:func:`serving_rows`)."""
    model = make_model(model_dir)
    out: dict[str, Any] = {"prefixes": list(prefixes), "reps": reps,
                           "xavier": xavier_rows(model, prefixes, reps, "sync", batch),
                           "xavier_async": xavier_rows(model, prefixes, reps, "async", batch),
                           "plain": plain_rows(model, prefixes, reps)}
    if anchor:
        out["nixl"] = nixl_rows(model, prefixes, reps, batch)
    if serving:
        out["serving"] = serving_rows(model)
    return out


def _f(x: Any, spec: str = ".1f") -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def table(result: dict[str, Any]) -> str:
    """The section as plain-text tables."""
    x, xa, pl, nx = (result.get(k, {}) for k in ("xavier", "xavier_async", "plain", "nixl"))
    step = x.get("one_step_ms", float("nan"))
    lines = [f"B one step (2-token prompt, A alive): {_f(step)} ms with XavierConnector, "
             f"{_f(pl.get('one_step_ms'))} ms without a connector, "
             f"{_f(nx.get('one_step_ms'))} ms with NixlConnector",
             f"{'prefix':>7} {'recompute':>10} {'no conn':>8} {'local hit':>10} {'xavier':>8} "
             f"{'x-async':>8} {'nixl':>8} {'x/step':>7} {'x/hit':>6} {'x/nixl':>7}  tokens equal "
             "(xavier, async, nixl)"]
    for n in result["prefixes"]:
        r, ra, rp, rn = x.get(n, {}), xa.get(n, {}), pl.get(n, {}), nx.get(n, {})
        xm, nm = r.get("xavier_ms", float("nan")), rn.get("nixl_ms", float("nan"))
        eq = ", ".join(f"{d['tokens_equal']}/{d['tokens_of']}" if d else "-" for d in (r, ra, rn))
        lines.append(f"{n:>7} {_f(r.get('recompute_ms')):>10} {_f(rp.get('recompute_ms')):>8} "
                     f"{_f(r.get('local_hit_ms')):>10} {_f(xm):>8} {_f(ra.get('xavier_ms')):>8} "
                     f"{_f(nm):>8} {xm / step:>7.2f} {xm / r.get('local_hit_ms', float('nan')):>6.2f} "
                     f"{xm / nm:>7.2f}  {eq}")
    batches = [("recompute", x.get("batch_recompute")), ("xavier (sync)", x.get("batch_xavier")),
               ("xavier (async)", xa.get("batch_xavier")), ("nixl", nx.get("batch_nixl"))]
    if any(b for _, b in batches):
        base = (x.get("batch_recompute") or {}).get("tokens_per_s")
        lines.append(f"{BATCH} requests at once, {BATCH_PREFIX}-token shared prefixes, "
                     f"{BATCH_TOKENS} tokens each:")
        lines.append(f"{'':>16} {'TTFT p50':>9} {'TTFT p95':>9} {'tok/s':>7} {'vs recompute':>13}")
        for name, b in batches:
            if b:
                ratio = b["tokens_per_s"] / base if base else float("nan")
                extra = (f"  first tokens equal {b['first_tokens_equal']}/{BATCH}"
                         if "first_tokens_equal" in b else "")
                if "load_failures" in b:
                    extra += f", loads {b['loads']}, failures {b['load_failures']}"
                lines.append(f"{name:>16} {b['ttft_p50_ms']:>9.1f} {b['ttft_p95_ms']:>9.1f} "
                             f"{b['tokens_per_s']:>7.1f} {ratio:>13.2f}{extra}")
    sv = result.get("serving")
    if sv:
        lines.append(
            f"A decoding {DECODE_BATCH} requests x {DECODE_TOKENS} tokens while B loads A's "
            f"{SERVED_PREFIXES} {SERVED_PREFIX}-token prefixes round after round: "
            f"{sv['serving_tokens_per_s']:.1f} tok/s against "
            f"{', '.join(f'{t:.1f}' for t in sv['alone_tokens_per_s'])} alone (before, after) "
            f"= {sv['vs_alone']:.2f} of alone (target >= {DECODE_WHILE_SERVING_TARGET:.2f}); "
            f"B loaded {sv['loads']} times, {sv['bytes_loaded'] / 1e6:.0f} MB "
            f"({sv['load_mb_per_s']:.0f} MB/s), {sv['load_failures']} failures, first tokens "
            f"equal {sv['first_tokens_equal']}/{sv['first_tokens_of']}; control, B computing "
            f"the same prompts itself: A {sv['b_computing_tokens_per_s']:.1f} tok/s (serving / "
            f"control {sv['vs_b_computing']:.2f})")
    for name, d in (("sync", x), ("async", xa)):
        if "announce_ms" in d:
            an = d["announce_ms"]
            lines.append(f"xavier ({name}): announcement, A's step end -> B's directory: p50 "
                         f"{an['p50']:.1f} ms, max {an['max']:.1f} ms over {an['n']}; A's publish "
                         f"{d['publish_ms_per_step']:.2f} ms a step ({d['blocks_per_publish']:.1f} "
                         f"blocks); B's load {d['load_ms_per_load']:.2f} ms each")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Any) -> None:
    """B's TTFT against the prefix length, one line per way (a PNG; needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = result["prefixes"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, field, label in (("xavier", "recompute_ms", "recompute"),
                              ("xavier", "xavier_ms", "XavierConnector (sync)"),
                              ("xavier_async", "xavier_ms", "XavierConnector (async)"),
                              ("nixl", "nixl_ms", "NixlConnector"),
                              ("xavier", "local_hit_ms", "B's own prefix cache")):
        rows = result.get(key, {})
        ys = [rows.get(n, {}).get(field) for n in ns]
        if all(y is not None for y in ys):
            ax.plot(ns, ys, marker="o", label=label)
    if "one_step_ms" in result.get("xavier", {}):
        ax.axhline(result["xavier"]["one_step_ms"], color="grey", ls=":", label="one engine step")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens (B computes one more)")
    ax.set_ylabel("B's TTFT, ms")
    ax.set_title("vLLM on the CPU, 2 replicas, one core each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["PREFIXES", "nixl_rows", "plain_rows", "plot", "run", "table", "xavier_rows"]

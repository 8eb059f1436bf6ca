"""``xavier-async bench --vllm``: B's time to first token inside real vLLM on the CPU.

Two replicas, one core each (A on CPU 0, B on CPU 1), the test model (a small Qwen2 with
real random weights). For each prefix length, A computes a prompt; B is given the prefix
plus one token (``max_tokens=1``, so its TTFT is the call's wall time) and:

* **recompute**: a prefix nobody holds (B computes it all);
* **xavier**: loads the prefix from A through ``XavierConnector`` (sync loads);
* **nixl**: vLLM's own NixlConnector, P/D (A prefills with ``do_remote_decode``; B gets
  its ``kv_transfer_params``), the anchor, in the same invocation.

Beside them, B's **one step**: a 2-token prompt, nothing to load, A alive. Every figure
is a median over ``reps`` prompts; tokens are compared with A's own answer."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ..testing.vllm_replica import (Replica, ReplicaSpec, make_model, xavier_config)

PREFIXES = (128, 256, 512, 1024, 2048, 4096)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4096) for _ in range(n)]


def _ttft(replica: Replica, prompt: list[int]) -> tuple[float, list[int]]:
    g = replica.generate([prompt], 1)
    return g.seconds, g.tokens[0]


def xavier_rows(model: str, prefixes: Sequence[int], reps: int, mode: str = "sync") -> dict[str, Any]:
    a = Replica(ReplicaSpec(model, "0", xavier_config(0, "127.0.0.1:7511", ["127.0.0.1:7512"])),
                wait=False)
    b = Replica(ReplicaSpec(model, "1", xavier_config(1, "127.0.0.1:7512", ["127.0.0.1:7511"],
                                                       load_mode=mode)), wait=False)
    rows: dict[Any, Any] = {}
    try:
        a.wait_ready(), b.wait_ready()
        rng = random.Random(1)
        steps = [_ttft(b, _ids(rng, 2))[0] for _ in range(reps + 2)][2:]
        rows["one_step_ms"] = statistics.median(steps) * 1e3
        for n in prefixes:
            rec, load, same = [], [], True
            for _ in range(reps + 1):
                prefix = _ids(rng, n)
                t_rec, _ = _ttft(b, _ids(rng, n) + [7])
                a.generate([prefix + [5]], 1)
                time.sleep(0.2)                           # the announcement reaches B
                t_load, tok = _ttft(b, prefix + [7])
                same &= tok == a.generate([prefix + [7]], 1).tokens[0]
                rec.append(t_rec)
                load.append(t_load)
            rows[n] = {"recompute_ms": statistics.median(rec[1:]) * 1e3,
                       "xavier_ms": statistics.median(load[1:]) * 1e3, "tokens_equal": same}
    finally:
        a.close()
        b.close()
    return rows


def _nixl_prefill(model: str, conn: Any) -> None:
    os.setpgrp()
    os.environ.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT="5600",
                      VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_LOGGING_LEVEL="WARNING")
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=8192, block_size=128, seed=0, enable_prefix_caching=False,
              kv_transfer_config=dict(kv_connector="NixlConnector", kv_role="kv_producer",
                                      kv_buffer_device="cpu",
                                      kv_connector_extra_config={"num_threads": 1}))
    conn.send("ready")
    while (ids := conn.recv()) is not None:
        sp = SamplingParams(max_tokens=1, detokenize=False,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        conn.send((out.kv_transfer_params, list(out.outputs[0].token_ids)))


def _nixl_decode(model: str, conn: Any) -> None:
    os.setpgrp()
    os.environ.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT="5601",
                      VLLM_CPU_OMP_THREADS_BIND="1", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_LOGGING_LEVEL="WARNING")
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
              max_model_len=8192, block_size=128, seed=0, enable_prefix_caching=False,
              kv_transfer_config=dict(kv_connector="NixlConnector", kv_role="kv_consumer",
                                      kv_buffer_device="cpu",
                                      kv_connector_extra_config={"num_threads": 1}))
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        ids, params = msg
        sp = SamplingParams(max_tokens=1, detokenize=False,
                            extra_args={"kv_transfer_params": params} if params else None)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        conn.send((time.perf_counter() - t0, list(out.outputs[0].token_ids)))


def nixl_rows(model: str, prefixes: Sequence[int], reps: int) -> dict[str, Any]:
    """The anchor: vLLM's NixlConnector P/D on the same prompts' shapes and model."""
    ctx = mp.get_context("spawn")
    (pa, ca), (pb, cb) = ctx.Pipe(), ctx.Pipe()
    procs = [ctx.Process(target=_nixl_prefill, args=(model, ca)),
             ctx.Process(target=_nixl_decode, args=(model, cb))]
    for p in procs:
        p.start()
    rows: dict[Any, Any] = {}
    try:
        for conn in (pa, pb):
            if not conn.poll(300) or conn.recv() != "ready":
                raise RuntimeError("a NixlConnector replica did not start")
        rng = random.Random(2)
        steps = []
        for _ in range(reps + 2):
            pb.send((_ids(rng, 2), None))
            steps.append(pb.recv()[0])
        rows["one_step_ms"] = statistics.median(steps[2:]) * 1e3
        for n in prefixes:
            times, same = [], True
            for _ in range(reps + 1):
                prompt = _ids(rng, n + 1)
                pa.send(prompt)
                params, tok_a = pa.recv()
                pb.send((prompt, params))
                t, tok_b = pb.recv()
                same &= tok_a == tok_b
                times.append(t)
            rows[n] = {"nixl_ms": statistics.median(times[1:]) * 1e3, "tokens_equal": same}
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
        reps: int = 3, anchor: bool = True) -> dict[str, Any]:
    """The section's figures (milliseconds), keyed by prefix length."""
    model = make_model(model_dir)
    out: dict[str, Any] = {"prefixes": list(prefixes), "reps": reps,
                           "xavier": xavier_rows(model, prefixes, reps)}
    if anchor:
        out["nixl"] = nixl_rows(model, prefixes, reps)
    return out


def table(result: dict[str, Any]) -> str:
    """The section as a plain-text table."""
    x, nx = result["xavier"], result.get("nixl", {})
    lines = [f"B one step (2-token prompt, A alive): {x['one_step_ms']:.1f} ms "
             f"(NixlConnector run: {nx.get('one_step_ms', float('nan')):.1f} ms)",
             f"{'prefix':>7} {'recompute':>10} {'xavier':>8} {'nixl':>8} {'xavier/step':>12} "
             f"{'xavier/nixl':>12} tokens"]
    for n in result["prefixes"]:
        r, a = x[n], nx.get(n, {})
        nixl = a.get("nixl_ms", float("nan"))
        lines.append(f"{n:>7} {r['recompute_ms']:>10.1f} {r['xavier_ms']:>8.1f} {nixl:>8.1f} "
                     f"{r['xavier_ms'] / x['one_step_ms']:>12.2f} {r['xavier_ms'] / nixl:>12.2f} "
                     f"{'equal' if r['tokens_equal'] and a.get('tokens_equal', True) else 'DIFFER'}")
    return "\n".join(lines)


__all__ = ["run", "table", "xavier_rows", "nixl_rows", "PREFIXES"]

"""vLLM replicas in child processes, for tests and the bench (needs the ``vllm`` extra).

:func:`make_model` writes a small Qwen2 with transformers' random init (real random
weights: vLLM's ``load_format="dummy"`` draws weights so small that wrong KV may not show
in the tokens). :class:`Replica` runs one ``vllm.LLM`` in a child process of its own
process group, pinned to the CPUs it is given, and answers ``generate`` (and
``reset_prefix_cache``) calls over a pipe;
:meth:`Replica.kill` and :meth:`Replica.close` end the whole group (vLLM's EngineCore and
worker processes would otherwise outlive an abrupt exit, busy-looping)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the model of BRIEF section 8: 8 layers, hidden 512, 8 heads, 2 KV heads, vocab 4096
MODEL_CONFIG: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)


def make_model(directory: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Write the test model to ``directory`` (once: an existing one is kept)."""
    d = Path(directory)
    if (d / "model.safetensors").exists():
        return str(d)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**{**MODEL_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(d), safe_serialization=True)
    return str(d)


def xavier_config(rank: int, listen: str, peers: Sequence[str], **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` of a replica with ``XavierConnector``."""
    return {"kv_connector": "XavierConnector", "kv_connector_module_path": "xavier_async.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"rank": rank, "listen": listen, "peers": list(peers),
                                          **extra}}


@dataclass
class ReplicaSpec:
    """One replica: the model, the CPUs it runs on, its ``kv_transfer_config`` (``None``:
    no connector) and ``LLM`` keyword arguments beyond the defaults."""

    model: str
    cpus: str = "0"
    kv_transfer_config: dict[str, Any] | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def _child(spec: ReplicaSpec, conn: Any) -> None:
    os.setpgrp()
    os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": spec.cpus, "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING", **spec.env})
    try:
        from vllm import LLM, SamplingParams
        kw: dict[str, Any] = dict(model=spec.model, skip_tokenizer_init=True, dtype="bfloat16",
                                  enforce_eager=True, max_model_len=8192, block_size=128, seed=0,
                                  enable_prefix_caching=True)
        if spec.kv_transfer_config is not None:
            kw["kv_transfer_config"] = spec.kv_transfer_config
        llm = LLM(**{**kw, **spec.llm_kwargs})
    except BaseException as exc:  # report, then exit: the parent raises it
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg[0] == "reset":
            conn.send(("reset", bool(llm.reset_prefix_cache())))
            continue
        _, prompts, max_tokens = msg
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        conn.send(("out", [list(o.outputs[0].token_ids) for o in outs],
                   [o.num_cached_tokens or 0 for o in outs], wall, first_token_latencies(outs)))


def first_token_latencies(outs: Any) -> list[float | None]:
    """Each request's time to first token from vLLM's own metrics (seconds), if given."""
    found: list[float | None] = []
    for o in outs:
        m = getattr(o, "metrics", None)
        t = getattr(m, "first_token_latency", None) if m is not None else None
        found.append(float(t) if t is not None else None)
    return found


@dataclass
class Generation:
    """What one :meth:`Replica.generate` call returned."""

    tokens: list[list[int]]
    cached_tokens: list[int]
    seconds: float
    ttfts: list[float | None]


class Replica:
    """A ``vllm.LLM`` in a child process group (started on construction, ~25 s)."""

    def __init__(self, spec: ReplicaSpec, *, wait: bool = True, start_timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, there = ctx.Pipe()
        self.spec = spec
        self.proc = ctx.Process(target=_child, args=(spec, there), daemon=False)
        self.proc.start()
        there.close()
        self._ready = False
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(self, timeout: float = 300.0) -> Replica:
        """Wait until the ``LLM`` has started (start several replicas, then wait for each)."""
        if self._ready:
            return self
        if not self._conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"vLLM replica did not start in {timeout} s")
        kind, detail = self._conn.recv()
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"vLLM replica failed to start: {detail}")
        self._ready = True
        return self

    @property
    def stats_file(self) -> str | None:
        cfg = self.spec.kv_transfer_config
        path = (cfg or {}).get("kv_connector_extra_config", {}).get("stats_file")
        return path if isinstance(path, str) else None

    def stats(self) -> dict[str, Any]:
        """The connector's stats as its worker last wrote them (TP rank 0)."""
        path = self.stats_file
        if not path:
            return {}
        with open(path.replace("{tp}", "0")) as f:
            data: dict[str, Any] = json.load(f)
        return data

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, *,
                 timeout: float = 300.0) -> Generation:
        """Greedy tokens for each prompt (token ids), with the call's wall time."""
        self._conn.send(("generate", list(map(list, prompts)), max_tokens))
        kind, tokens, cached, wall, ttfts = self._answer(timeout)
        return Generation(tokens, cached, wall, ttfts)

    def reset_prefix_cache(self, *, timeout: float = 60.0) -> bool:
        """Drop the replica's own prefix cache (vLLM's ``LLM.reset_prefix_cache``), so that
        a prompt it computed or loaded before is looked up again; whether vLLM did."""
        self._conn.send(("reset",))
        _, done = self._answer(timeout)
        return bool(done)

    def _answer(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"vLLM replica did not answer in {timeout} s")
        return self._conn.recv()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the replica's whole process group (``SIGSTOP`` freezes it)."""
        if self.proc.pid is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """End the replica's process group at once (idempotent)."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.join(timeout=10)

    def close(self) -> None:
        """Ask the replica to exit, then end whatever is left of its group."""
        try:
            self._conn.send(None)
            self.proc.join(timeout=15)
        except (OSError, BrokenPipeError):
            pass
        self.kill()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["make_model", "xavier_config", "ReplicaSpec", "Replica", "Generation", "MODEL_CONFIG",
           "first_token_latencies"]

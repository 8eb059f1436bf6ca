"""Tensor parallelism inside real vLLM engines: two replicas of TP=2 (two worker processes
each, every worker with its own endpoint on ``listen``'s port plus its TP rank) exchange
blocks TP rank to TP rank, and a TP=1 replica, whose blocks have another shape, is
refused at the handshake and recomputes, with the right tokens either way."""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (pip install -e '.[vllm]')")

from xavier_async.testing.vllm_replica import (Replica, ReplicaSpec, make_model,  # noqa: E402
                                               xavier_config)

BLOCK = 128
#: each TP worker holds one of the model's two KV heads: 8 layers x [1, 128, 2 x 64] bf16
TP_BLOCK_BYTES = 8 * 1 * BLOCK * 128 * 2
PORTS = {0: 7611, 1: 7621, 2: 7631}   # TP worker t listens on port + t
TP = {0: 2, 1: 2, 2: 1}


def address(rank: int) -> str:
    return f"127.0.0.1:{PORTS[rank]}"


def worker_stats(path: str, tp: int) -> dict:
    with open(path.replace("{tp}", str(tp))) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-tp")
    model = make_model(d / "model")

    def spec(rank: int) -> ReplicaSpec:
        peers = [address(r) for r in PORTS if r != rank]
        cfg = xavier_config(rank, address(rank), peers, load_timeout=2.0,
                            host_snapshot_bytes=32 << 20,
                            stats_file=str(d / f"stats-{rank}-{{tp}}.json"))
        kw = {"tensor_parallel_size": TP[rank], "distributed_executor_backend": "mp"} \
            if TP[rank] > 1 else {}
        return ReplicaSpec(model, "0|1" if TP[rank] > 1 else "1", cfg, llm_kwargs=kw)

    started = [Replica(spec(rank), wait=False) for rank in PORTS]
    try:
        yield tuple(r.wait_ready() for r in started)
    finally:
        for r in started:
            r.kill()


def test_tp2_replicas_load_tp_rank_to_tp_rank_and_a_tp1_replica_is_refused(replicas):
    a, b, c = replicas
    rng = random.Random(5)
    prefix = [rng.randrange(4096) for _ in range(4 * BLOCK)]
    prompt = prefix + [rng.randrange(4096) for _ in range(9)]
    a.generate([prefix + [5]], 1)                    # A computes and publishes 4 blocks
    time.sleep(1.0)                                  # its announcements reach B
    before = [worker_stats(b.stats_file, t) for t in (0, 1)]
    got = b.generate([prompt], 8)
    want = a.generate([prompt], 8)
    assert got.tokens == want.tokens
    assert got.cached_tokens == [4 * BLOCK]
    for t in (0, 1):                                 # each TP worker loaded its own half
        after = worker_stats(b.stats_file, t)
        assert after["peers"] == [0]
        assert after["blocks_loaded"] - before[t]["blocks_loaded"] == 4
        assert after["bytes_loaded"] - before[t]["bytes_loaded"] == 4 * TP_BLOCK_BYTES
        assert after["load_failures"] == 0
    # C (TP=1) has another block shape: no peer accepted it, it recomputes the same tokens
    other = c.generate([prompt], 8)
    assert other.tokens == want.tokens
    assert other.cached_tokens == [0]
    cs = c.stats()
    assert cs["peers"] == [] and cs["loads"] == 0 and cs["directory_keys"] == 0
    assert 2 not in worker_stats(a.stats_file, 0)["peers"]

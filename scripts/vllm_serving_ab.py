"""Decode while serving inside vLLM, with A's ``direct_write_regions`` set (issue 34).

The last row of ``xavier-async bench --vllm`` (:func:`xavier_async.bench.vllm_ttft.serving_rows`:
A decodes while B loads A's prefixes round after round; B's first tokens compared with
A's), with A's connector told ``direct_write_regions=N`` (0: A gathers every serve into a
send slab; ``default``: the connector's default, 64 on host memory). Prints the row,
A's direct writes and pack stage from its stats file, and per phase of A's decode the cpu
seconds and the seconds runnable but waiting for a core of A's and B's processes.

Usage: python scripts/vllm_serving_ab.py {default|N} [{default|N} ...]   (the vllm extra)"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

from xavier_async.bench import vllm_ttft


def main(settings: list[str]) -> None:
    real = vllm_ttft.xavier_config
    model = vllm_ttft.make_model("/tmp/xavier-async-vllm-model")
    for regions in settings:
        def config(rank: int, *args: object, _n: str = regions, **kw: object) -> dict[str, object]:
            if rank == 0 and _n != "default":
                kw["direct_write_regions"] = int(_n)
            return real(rank, *args, **kw)

        vllm_ttft.xavier_config = config
        r = vllm_ttft.serving_rows(model)
        a: dict[str, Any] = {}
        for path in glob.glob(f"/tmp/xavier-async-vllm-serving-{os.getpid()}-a-0.json"):
            with open(path) as f:
                a = json.load(f)
        pack = a.get("stages", {}).get("source", {}).get("pack", {})
        print(f"A direct_write_regions={regions}: A {r['serving_tokens_per_s']:.1f} tok/s while B "
              f"loads, {r['vs_alone']:.3f} of alone {[round(x, 1) for x in r['alone_tokens_per_s']]}, "
              f"{r['vs_b_computing']:.3f} of the control ({r['b_computing_tokens_per_s']:.1f}); B "
              f"{r['loads']} loads at {r['load_mb_per_s']:.0f} MB/s, {r['load_failures']} failures, "
              f"{r['first_tokens_equal']}/{r['first_tokens_of']} first tokens equal; A: "
              f"{a.get('direct_writes')} direct writes of {pack.get('n')} serves, pack p50 "
              f"{pack.get('p50_us')} us", flush=True)
        for phase, procs in r.get("cpu", {}).items():   # A's decode: alone, serving, B computing
            print(f"  {phase}: " + "; ".join(
                f"{name.upper()} cpu {p['cpu_of_wall']:.2f} waiting {p['runqueue_wait_of_wall']:.2f} "
                f"of the wall, busiest {p['threads'][:3]}" for name, p in procs.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["0", "default"])

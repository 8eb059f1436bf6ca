#!/usr/bin/env bash
# One-off diagnostics on the GPU pair: fused vs tensor packing, and the demo's BF16
# reproducibility with and without loads overlapping forwards.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_packing.py -k fused_kernel_on_cuda 2>&1 | tail -3 | tee "$OUT/kernel_test.txt"
timeout 200 python3 scripts/gpu_pack_timing.py 2>&1 | tail -6 | tee "$OUT/kernel_timing.txt"
for c in 1 16; do
  timeout 300 python3 -m xavier_async.bench demo --device cuda --warm 32 --cancel 0 --concurrency $c --json "$OUT/demo_c$c.json" 2>&1 | tail -4 | tee "$OUT/demo_c$c.txt"
done

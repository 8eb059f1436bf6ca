#!/usr/bin/env bash
# The VRAM path on a machine with two GPUs (the lent nvidia-h200-x2 here): NIXL wheels
# installed from .whl/, the NIXL process tests VRAM to VRAM, the raw NIXL floor tool, the
# full benchmark and the real-model demo. Results go to $OUT (or ./out).
# Usage: bash scripts/device_run.sh [tests] [kernels] [floor] [snapshot] [bench] [demo] [serving] [profile]
#   (default: tests kernels floor bench demo; snapshot: the snapshot-store section alone; serving: the serving section alone, duplex and three processes;
#    profile: the three-process serving section under py-spy, if its wheel is in .whl/;
#    matrix: the serving section once per line of $MATRIX, "tag: [NAME=value ...] bench flags";
#    SERVING_TOPOLOGIES, SERVING_ARGS and SERVING_TAG narrow and vary the serving step;
#    MATRIX_TIMEOUT: seconds per matrix run, default 280: three rounds of duplex took 213 s)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
steps=${*:-tests kernels floor bench demo}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; nproc;
  python3 -c 'import torch, nixl, anyio, transformers; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "anyio", anyio.__version__, "transformers", transformers.__version__)'; } 2>&1 | tee "$OUT/machine.txt"
for step in $steps; do case $step in
  tests) XAVIER_TEST_DEVICE=cuda NIXL_LOG_LEVEL=WARN timeout 300 python3 -m pytest -q -p no:cacheprovider -rf tests/test_nixl_process.py tests/test_concurrency_nixl.py tests/test_snapshots_nixl.py 2>&1 | tail -25 | tee "$OUT/pytest_cuda.txt" ;;
  kernels) { timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/test_packing.py -k fused_kernel_on_cuda 2>&1 | tail -5;
            timeout 200 python3 scripts/gpu_pack_timing.py 2>&1; timeout 200 python3 scripts/gpu_launch_timing.py 2>&1; } | tee "$OUT/kernels.txt" ;;
  floor) [ -f .whl/nixl_floor.py ] && NIXL_LOG_LEVEL=WARN timeout 120 python3 .whl/nixl_floor.py cuda 300 2>&1 | tee "$OUT/nixl_floor.txt" ;;
  snapshot) # the snapshot-store section alone: tiers, staging, demotion, store vs live slots
        timeout 400 python3 -m xavier_async.bench bench --only-snapshot --device cuda --json "$OUT/snapshot_cuda.json" 2>&1 | tee "$OUT/snapshot_cuda.txt" ;;
  bench) timeout 560 python3 -m xavier_async.bench bench --json "$OUT/bench_cuda.json" --plot "$OUT/bench_cuda.png" 2>&1 | tee "$OUT/bench_cuda.txt" ;;
  serving) for topo in ${SERVING_TOPOLOGIES:-duplex three}; do
            timeout 280 python3 -m xavier_async.bench bench --only-serving --serving-topology $topo ${SERVING_ARGS:-} --json "$OUT/serving_$topo${SERVING_TAG:-}.json" --plot "$OUT/serving_$topo${SERVING_TAG:-}.png" 2>&1 | tee "$OUT/serving_$topo${SERVING_TAG:-}.txt"; done ;;
  matrix) # the serving section once per line of $MATRIX ("tag: bench flags"), one topology each
          # (a line's leading NAME=value words are set in that run's environment)
          while IFS=: read -r tag args; do [ -n "$tag" ] || continue
            envs=(); set -- $args; while [ $# -gt 0 ] && [[ $1 == [A-Z]*=* ]]; do envs+=("$1"); shift; done
            for topo in ${SERVING_TOPOLOGIES:-duplex three}; do
              env "${envs[@]}" timeout ${MATRIX_TIMEOUT:-280} python3 -m xavier_async.bench bench --only-serving --serving-topology $topo "$@" --json "$OUT/serving_${topo}_$tag.json" > "$OUT/serving_${topo}_$tag.txt" 2>&1
              echo "$topo $tag: rc $?"; done; done <<< "${MATRIX:-}"
          # one archive: the device tool brings back only a few files per call
          (cd "$OUT" && tar czf matrix.tgz serving_*_* && rm -f serving_*_*) ;;
  profile) [ -x /tmp/site/bin/py-spy ] && timeout 280 /tmp/site/bin/py-spy record --subprocesses --rate ${PYSPY_RATE:-100} --format raw -o "$OUT/profile_three.txt" -- python3 -m xavier_async.bench bench --only-serving --serving-topology three --json "$OUT/serving_three_profiled.json" 2>&1 | tail -40 | tee "$OUT/profile_log.txt" ;;
  demo) # the demo as a serving engine: BF16 Qwen2.5-0.5B shape, 16 in flight, three columns and
        # the break-even sweep; with one GPU every replica shares cuda:0 (the output says so)
        timeout 560 python3 -m xavier_async.bench demo --device cuda --json "$OUT/demo_cuda.json" --plot "$OUT/demo_cuda.png" 2>&1 | tee "$OUT/demo_cuda.txt" ;;
  bench-quick) # the load rows beside the plain-Python protocol floor, with every stage (quick counts)
        # (BENCH_ARGS: more bench flags, BENCH_TAG: a suffix of its files)
        timeout 300 python3 -m xavier_async.bench bench --quick --no-serving --no-snapshot --no-descriptors --device cuda ${BENCH_ARGS:-} --json "$OUT/bench_quick_cuda${BENCH_TAG:-}.json" 2>&1 | tee "$OUT/bench_quick_cuda${BENCH_TAG:-}.txt" ;;
  demo-step) # one engine step of the demo's model, three shapes, and the profiler's busiest operators
        timeout 300 python3 scripts/demo_step_timing.py cuda 2>&1 | tee "$OUT/demo_step.txt" ;;
  protocol-floor) # the plain-Python protocol floor alone (the bench runs it beside its loads)
        timeout 200 python3 -c 'from xavier_async.bench.protocol_floor import main; main()' cuda 2>&1 | tee "$OUT/protocol_floor_cuda.txt" ;;
  demo-tiers) # the same with device tiers of 16 blocks (3 MiB) for its 288 published blocks, so
        # that both tiers serve, as in the CPU run (the 256 MiB default holds them all)
        timeout 560 python3 -m xavier_async.bench demo --device cuda --device-tier-mib 3 --json "$OUT/demo_cuda.json" --plot "$OUT/demo_cuda.png" 2>&1 | tee "$OUT/demo_cuda.txt" ;;
esac; done

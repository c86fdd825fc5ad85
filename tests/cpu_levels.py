"""The CPU kernel levels the kernel tests build (tests/test_cpu_kernels.py, test_kv_cache_dtype.py): the generic
build, this CPU's best level, and AVX2 wherever this CPU is above it. AVX2 has decode attention code of its own
(kernels/cpu/decode_avx2.h) that a test run on an AVX-512 machine would otherwise never execute; there it is marked
slow (one more build of the extension, about two minutes of CI's two cores)."""
import pytest

from vlinfer.platform import cpu_features


def kernel_levels() -> list:
    """pytest params, one per level, in CPU_ISAS order."""
    order = cpu_features.CPU_ISAS
    this_cpu = cpu_features.cpu_isa()
    levels = sorted({"generic", this_cpu}, key=order.index)
    params = [pytest.param(level, id=level) for level in levels]
    if order.index(this_cpu) > order.index("avx2"):
        params.insert(1, pytest.param("avx2", id="avx2", marks=pytest.mark.slow))
    return params

"""The CPU kernel levels the kernel tests build (tests/test_cpu_kernels.py, test_kv_cache_dtype.py):
this CPU's best level, the generic build, and AVX2 wherever this CPU is above it. AVX2 has decode
attention code of its own (cpu/csrc/decode_avx2.h) that a test run on an AVX-512 machine would
otherwise never execute. Each level is one more build of the extension (about two minutes of CI's
two cores), so only the level this CPU runs is in the default run; the others are marked slow (CI's
full run builds and tests them all)."""
import pytest

from vlinfer.platform import cpu_features


def kernel_levels() -> list:
    """pytest params, one per level, in CPU_ISAS order."""
    order = cpu_features.CPU_ISAS
    this_cpu = cpu_features.cpu_isa()
    levels = sorted({"generic", "avx2", this_cpu} if order.index(this_cpu) >= order.index("avx2")
                    else {this_cpu}, key=order.index)
    return [
        pytest.param(level, id=level, marks=() if level == this_cpu else pytest.mark.slow)
        for level in levels
    ]

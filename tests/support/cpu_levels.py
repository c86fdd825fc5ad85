"""The CPU kernel levels the kernel tests build (tests/ops/cpu/test_cpu_kernels.py,
test_kv_cache_dtype.py): this CPU's best level and every level below it that this CPU runs (generic,
AVX2, plain AVX-512). AVX2 has decode attention code of its own (cpu/csrc/decode_avx2.h), and plain
AVX-512 float32 panels without the BF16 kernels, that a test run on a higher machine would otherwise
never execute. Each level is one more build of the extension (about two minutes of CI's two cores),
so only the level this CPU runs is in the default run; the others are marked slow (CI's full run
builds and tests them all)."""
import pytest

from vlinfer.platform import cpu_features


def kernel_levels() -> list:
    """pytest params, one per level, in CPU_ISAS order."""
    order = cpu_features.CPU_ISAS
    this_cpu = cpu_features.cpu_isa()
    levels = order[:order.index(this_cpu) + 1]  # every level a CPU at or below this one runs
    return [
        pytest.param(level, id=level, marks=() if level == this_cpu else pytest.mark.slow)
        for level in levels
    ]

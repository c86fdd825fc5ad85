"""What the CPU can run: its /proc/cpuinfo flags, the highest instruction-set level of our compiled
kernels, and whether it has native half-precision arithmetic. Tests mock cpu_flags to stand for
other CPUs."""
import torch

# Instruction-set levels of our compiled CPU kernels, lowest first, and the /proc/cpuinfo flags each
# needs.
CPU_ISAS = ("generic", "avx2", "avx512", "avx512bf16")
_ISA_NEEDS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"},
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4 and later) has
    # AVX512-VNNI too; the GGUF kernels' integer dot products use it at this level.
    "avx512bf16": {
        "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16",
        "avx512_vnni"
    },
}
# Native half-precision arithmetic on x86: without it torch's bf16 matmul crawls (0.3 GFLOP/s
# against 140 for float32 on an AVX2-only EPYC), so "auto" computes in float32 there.
_NATIVE_HALF = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")
}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none to read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_isa(flags: frozenset[str] | None = None) -> str:
    """The highest of CPU_ISAS this CPU runs."""
    flags = cpu_flags() if flags is None else flags
    best = "generic"
    for isa in CPU_ISAS[1:]:
        if _ISA_NEEDS[isa] <= flags:
            best = isa
    return best


def cpu_has_native(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in _NATIVE_HALF.get(dtype, ()))

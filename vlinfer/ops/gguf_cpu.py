"""Our CPU kernels for GGUF Q8_0 / Q4_0 / Q4_1 linear layers (kernels/cpu/gguf_blocks.cpp), built on first use
with torch's extension builder, one extension per instruction-set level like vlinfer/ops/cpu.py's kernels. A
separate extension (rather than more sources in cpu.py's) because it is built with -ffp-contract=off: the kernel
dequantizes each block exactly as gguf-py does, which a compiler fusing `q * d + m` into one FMA would change.

Which path runs at which row count: up to SMALL_M_MAX rows (decode steps, small batches) each block's integers are
converted in registers and multiplied with its scales factored out (Q4_1: d * sum(q * x) + m * sum(x)), each weight
byte read once; above it each thread dequantizes tiles of TILE rows
and runs the dense matmul on them (prefill). The crossover was measured with bench/quantized.py --ops."""
import os

from vlinfer.ops.gguf_reference import block_bytes

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "kernels", "cpu", "gguf_blocks.cpp")
SMALL_M_MAX = 8
TILE = 64


def build_gguf_extension(isa: str):
    """Compile (first time for this level on this machine) and import the GGUF kernels for one level."""
    from torch.utils.cpp_extension import load as load_extension

    from vlinfer.ops.cpu_isa_flags import ISA_FLAGS
    source = os.path.abspath(SOURCE)
    if not os.path.exists(source):
        raise FileNotFoundError(f"kernel source {source} is missing (vlinfer must run from its source tree)")
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", *ISA_FLAGS[isa]]
    return load_extension(f"vlinfer_gguf_kernels_{isa}", [source], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                          verbose=False)


class GgufCpuKernels:
    """The built extension for one level, with the row-count switch."""

    def __init__(self, isa: str, small_m_max: int = SMALL_M_MAX, tile: int = TILE):
        self.ext = build_gguf_extension(isa)
        self.isa = self.ext.isa()
        self.small_m_max, self.tile = small_m_max, tile

    def linear(self, x, weight, ggml_type: int, bias=None):
        block_bytes(ggml_type)  # a clear error for a type the kernel does not take
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self.ext.gguf_linear(x2, weight, ggml_type, bias, self.small_m_max, self.tile)
        return y.reshape(*shape[:-1], y.shape[-1])

    def dequantize(self, weight, ggml_type: int):
        return self.ext.gguf_dequantize(weight, ggml_type)

"""Our CPU kernels for GGUF Q8_0 / Q4_0 / Q4_1 linear layers (csrc/gguf_blocks.cpp), prebuilt in a
wheel or built on first use, one extension per instruction-set level like the main kernels
(loader.py: EXTENSIONS["gguf"]). A separate extension (rather than more sources in the main one)
because it is built with -ffp-contract=off: embedding rows are dequantized exactly as gguf-py
does, which a compiler fusing `q * d + m` into one FMA would change.

The linear takes integer dot products per block against activations held as two int8 digits per 32
along K (ops/reference/gguf.py: gguf_linear and quantize_activations define it), on weights repacked
once at load into groups of 16 output rows (`pack`), at every row count: the integer path outruns
dequantizing to float32 and a float matmul in prefill too. Per-channel int8 layers run here too, as
Q8_0 blocks of d = 1 with their channel scales applied to the result (`row_scale`; quant.py); with
bf16 activations from a few rows up, where the CPU has AVX512-BF16, they run `int8_linear_bf16`
instead: the int8 weights widened to bf16 panels once per call, vdpbf16ps products."""
from vlinfer.ops.cpu import loader


def build_gguf_extension(isa: str):
    """The GGUF kernels for one level: prebuilt, or compiled on first use (loader.load)."""
    return loader.load(isa, "gguf")


class GgufCpuKernels:
    """The built extension for one level."""

    def __init__(self, isa: str):
        self.ext = build_gguf_extension(isa)
        self.isa = self.ext.isa()
        # int8_linear_bf16 runs (AVX512-BF16 builds)
        self.bf16_panels = bool(self.ext.bf16_panels_available())

    def pack(self, weight, ggml_type: int):
        """The file's blocks [N, K / 32 * block_bytes] -> the kernel's layout [N, K / 32,
        block_bytes]."""
        return self.ext.gguf_pack(weight.contiguous(), ggml_type)

    def linear(self, x, packed, ggml_type: int, bias=None, row_scale=None):
        """row_scale (float32 [N]) multiplies each output feature before the cast and the bias:
        per-channel int8 weights run as Q8_0 blocks of d = 1 (quant.py)."""
        # Called ~120 times per decode step of a small model: no Python work beyond the reshape (the
        # kernel checks the type, the layout and the shapes).
        if x.dim() == 2:
            return self.ext.gguf_linear(x, packed, ggml_type, bias, row_scale)
        y = self.ext.gguf_linear(x.reshape(-1, x.shape[-1]), packed, ggml_type, bias, row_scale)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def int8_linear_bf16(self, x, packed, row_scale, bias=None):
        """bf16 x against an int8 per-channel layer (Q8_0 blocks of d = 1, `pack`ed) as bf16 panels,
        no activation quantization: the faster path from about 8 rows where the CPU has AVX512-BF16
        (quant.py)."""
        if x.dim() == 2:
            return self.ext.int8_linear_bf16(x, packed, row_scale, bias)
        y = self.ext.int8_linear_bf16(x.reshape(-1, x.shape[-1]), packed, row_scale, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dequantize(self, weight, ggml_type: int):
        return self.ext.gguf_dequantize(weight, ggml_type)

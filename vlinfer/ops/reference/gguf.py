"""The GGUF block formats vlinfer keeps quantized in memory (Q8_0, Q4_0, Q4_1) and the pure-torch
ops that define their meaning: `dequantize` follows gguf-py's `dequantize_blocks` operation for
operation (so it is bit-identical to what transformers loads from the same file); `gguf_linear` is a
float32 matmul of the dequantized weight with the activations as the kernel holds them
(`quantize_activations`: two int8 digits per element, per 32 along K), cast to x's dtype. The
compiled CPU kernels (cpu/csrc/gguf_blocks.cpp) are tested against these; their integer block sums
are exact, so they differ from this only by float32 rounding.

Why two digits: llama.cpp quantizes these layers' activations to one int8 per element (its Q8 rule,
d = max|x| / 127), about 1% of error per layer, and that is enough to change the real SmolLM2-135M's
greedy answer to "What is the capital of France?" from "The capital of France is Paris." to
llama.cpp's own "L'Étoile, la Cité, ...". The second digit holds what the first left (|x - d q1| <=
d / 2) in units of d / 256: ~1e-5 of the block's largest value, below bf16 rounding, at the cost of
a second integer dot product per block.

A GGUF weight is kept as the file stores it: uint8 [N, K / 32 * block_bytes], one row of blocks per
output
feature, blocks running along K (ggml's ne[0]). Layouts (ggml-common.h):
  Q8_0: fp16 d, int8 qs[32]            w = q * d
  Q4_0: fp16 d, uint8 qs[16]           w[j] = ((qs[j] & 15) - 8) * d, w[j + 16] = ((qs[j] >> 4) - 8)
  * d
  Q4_1: fp16 d, fp16 m, uint8 qs[16]   w[j] = (qs[j] & 15) * d + m,  w[j + 16] = (qs[j] >> 4) * d +
  m"""
import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block, along K
# ggml type id -> (name, bytes per block); ids as in ggml.h / gguf.GGMLQuantizationType
GGUF_BLOCK_TYPES = {8: ("Q8_0", 34), 2: ("Q4_0", 18), 3: ("Q4_1", 20)}


def type_name(ggml_type: int) -> str:
    return GGUF_BLOCK_TYPES[ggml_type][
        0] if ggml_type in GGUF_BLOCK_TYPES else f"ggml type {ggml_type}"


def block_bytes(ggml_type: int) -> int:
    if ggml_type not in GGUF_BLOCK_TYPES:
        raise ValueError(
            f"GGUF blocks of {type_name(ggml_type)} are not kept quantized; expected one of "
            f"{', '.join(name for name, _ in GGUF_BLOCK_TYPES.values())}")
    return GGUF_BLOCK_TYPES[ggml_type][1]


def in_features(weight: torch.Tensor, ggml_type: int) -> int:
    """K of a [N, K / 32 * block_bytes] block tensor."""
    size = block_bytes(ggml_type)
    if weight.dim() != 2 or weight.dtype != torch.uint8 or weight.shape[1] % size:
        raise ValueError(f"a {type_name(ggml_type)} weight must be uint8 [N, K / 32 * {size}], got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    return weight.shape[1] // size * BLOCK


def dequantize(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [N, K] from the blocks, exactly as gguf-py computes it (float32 products and sums,
    one rounding each)."""
    rows, size = weight.shape[0], block_bytes(ggml_type)
    blocks = weight.reshape(rows, -1, size)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    if ggml_type == 8:  # Q8_0
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = blocks[..., size - 16:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1)
        if ggml_type == 2:  # Q4_0
            w = d * (q.to(torch.int8) - 8).float()
        else:  # Q4_1
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            w = d * q.float() + m
    return w.reshape(rows, -1)


def q8_0_blocks(q: torch.Tensor) -> torch.Tensor:
    """An int8 [N, K] weight (K a multiple of 32) as Q8_0 blocks of d = 1: dequantize gives q back
    exactly, so a per-channel int8 layer is this times its channel scales (how the CPU runs W8A16,
    ops/cpu/quant.py)."""
    n, k = q.shape
    if q.dtype != torch.int8 or k % BLOCK:
        raise ValueError(
            f"Q8_0 blocks take an int8 [N, K] weight with K a multiple of {BLOCK}, got {q.dtype} "
            f"{tuple(q.shape)}")
    d = torch.ones(n, k // BLOCK, 1, dtype=torch.float16).view(torch.uint8)
    return torch.cat([d, q.reshape(n, -1, BLOCK).view(torch.uint8)], dim=-1).reshape(n, -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as the GGUF linear sees it, in float32. Per 32 along K: d =
    max|x| / 127, q1 = round-half-even(x * (1 / d)), q2 = round-half-even((x - q1 * d) * (256 / d))
    clamped to [-127, 127], both int8; returns (256 q1 + q2) * (d / 256). Each product and
    difference is rounded once, as the kernel does."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q1 = torch.round(blocks * inverse)
    q2 = torch.round((blocks - q1 * d) * (inverse * 256)).clamp(-127, 127)
    return ((q1 * 256 + q2) * (d / 256)).reshape(x.shape)


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                bias: torch.Tensor | None = None):
    """quantize_activations(x) [..., K] @ dequantize(weight)^T in float32, cast to x's dtype (+
    bias)."""
    y = F.linear(quantize_activations(x), dequantize(weight, ggml_type)).to(x.dtype)
    return y if bias is None else y + bias


def gguf_embedding(ids: torch.Tensor, weight: torch.Tensor, ggml_type: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the dequantized table, in dtype: only the rows looked up are dequantized."""
    rows = weight.index_select(0, ids.reshape(-1))
    return dequantize(rows, ggml_type).to(dtype).reshape(*ids.shape, -1)

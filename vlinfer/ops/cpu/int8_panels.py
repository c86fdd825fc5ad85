"""Per-channel int8 linears on our VNNI panels (csrc/int8_vnni.cpp): the weight packed once at load
as int8 [N / 32, K / 4, 32, 4] with its channel scales and the weight sums that take back the
activations' +128 offset; each call quantizes its activations per row and takes vpdpbusd products.
Which path a call runs is decided here, in one place (`digits`):
- W8A16 layers (int8 on load, W8A16 checkpoints), float32 compute, and bf16 calls up to WIDEN_ROWS
  rows: the activations as 16-bit integers per row (two digits, each within max|x_row| / 65534 of
  its value), two vpdpbusd per 4 weights and row: half the weight bytes of bf16 for the same
  instruction count, which wins while the weights' bytes bound the call (decode).
- bf16 calls above WIDEN_ROWS rows: bf16 panels widened once per call, bf16(q * scale) (the
  reference's dequantized weight), through the dense bf16 tiles (digits = 0): the dense rate and
  the reference's numerics, plus one widening per panel and call.
- W8A8 checkpoints at every row count: dynamic per-token int8 activations (the reference's
  quantize_per_token: max|x_row| / 127, round half to even), one vpdpbusd per 4 weights and row.
int8 on load does not take W8A8 at many rows, though it is the fastest path there: per-token int8
activations doubled its bf16 prompt logits' error against transformers on the dequantized weights
(tests/layers/quantization/test_quantized.py bounds it at 1.5x transformers' own bf16 error;
docs/benchmarks.md).
WIDEN_ROWS: the widening costs about what the two digits' extra work over the bf16 tiles costs on
that many rows (bench/int8_linear.py measures both per row count; the table in docs/benchmarks.md).
"""
import torch

from vlinfer.platform import cpu_features

PANEL = 32  # outputs per panel
QUAD = 4  # k per int32 lane of vpdpbusd
WIDEN_ROWS = 32  # bf16 W8A16 calls above this many rows run the widened panels (docstring)


def int8_path(ext) -> str:
    """Which kernel per-channel int8 layers run on this build and CPU, and why (the op table logs
    it once). ext: the CPU kernels' extension of the level that runs."""
    flags = cpu_features.cpu_flags()
    if ext is not None and ext.int8_vnni_available():
        amx = (" (this CPU has AMX-INT8: its tiles are not used yet, the AVX512-VNNI kernels run)"
               if "amx_int8" in flags else "")
        return (f"int8 VNNI panels (AVX512-VNNI vpdpbusd){amx}: W8A16 with 16-bit activations "
                f"per row up to {WIDEN_ROWS} rows (and in float32), bf16 panels widened once per "
                f"call above; W8A8 checkpoints per-token int8 activations")
    if "avx512_vnni" in flags or "avx_vnni" in flags:
        why = ("this level's build has no AVX512-VNNI kernels" if "avx512_vnni" in flags else
               "AVX-VNNI (256-bit) kernels are not written yet")
        return f"the GGUF block kernel ({why}): two int8 digits per 32 activations"
    return ("the GGUF block kernel: no int8 dot product on this CPU (no VNNI / AMX-INT8), "
            "vpmaddubsw + vpmaddwd on two int8 digits per 32 activations")


def fits(n: int, k: int) -> bool:
    """Whole 32-output panels and whole quads of k."""
    return n % PANEL == 0 and k % QUAD == 0


def to_vnni_panels(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N / 32, K / 4, 32, 4]: per panel and quad of k, 32 outputs' 4 weights."""
    n, k = weight.shape
    return weight.reshape(n // PANEL, PANEL, k // QUAD, QUAD).transpose(1, 2).contiguous()


# Which path a layer's calls take (`digits`): "w8a8" one digit at every row count (W8A8
# checkpoints: their scheme's definition); "w8a16" the W8A16 rule of the module docstring.
POLICIES = ("w8a16", "w8a8")


def pack(weight: torch.Tensor, scale: torch.Tensor, policy: str, ext) -> dict:
    """weight int8 [N, K], scale [N] (per channel); policy: one of POLICIES; ext: the CPU kernels'
    extension that runs it."""
    if policy not in POLICIES:
        raise ValueError(f"int8 panel policy must be one of {POLICIES}, got {policy!r}")
    return {
        "kind": "int8_vnni", "weight": to_vnni_panels(weight.contiguous()),
        "comp": (128 * weight.to(torch.int32).sum(1)).to(torch.int32).contiguous(),
        "scale": scale.float().reshape(-1).contiguous(), "policy": policy, "ext": ext
    }


def digits(rows: int, dtype: torch.dtype, policy: str) -> int:
    """2 (W8A16, 16-bit activations), 0 (W8A16 on widened bf16 panels) or 1 (W8A8) for a call of
    `rows` rows: the rule of the module docstring. The fused decode layers (csrc/decode_layer.cpp
    `project`) apply the same W8A16 rule with WIDEN_ROWS passed in."""
    if policy == "w8a8":
        return 1
    return 0 if rows > WIDEN_ROWS and dtype == torch.bfloat16 else 2


def decode_kernel(weight: dict) -> dict | None:
    """A quantization method's decode_weight ({"scheme", "packed"}) -> its kernel where the fused
    decode layers run it (csrc/decode_layer.cpp calls int8_vnni_linear with `digits`' W8A16 rule,
    WIDEN_ROWS passed in): W8A16 on these panels; else None."""
    kernel = weight["packed"].get("cpu")
    if weight["scheme"] != "w8a16" or kernel is None or kernel["kind"] != "int8_vnni" or \
            kernel["policy"] != "w8a16":
        return None
    return kernel


def linear(x: torch.Tensor, kernel: dict, bias: torch.Tensor | None,
           force_digits: int | None = None) -> torch.Tensor:
    """x [..., K] float32 / bf16 -> [..., N] in x's dtype. force_digits: a path for benchmarks
    and tests, else `digits`."""
    k = x.shape[-1]
    rows = x.numel() // k
    d = digits(rows, x.dtype, kernel["policy"]) if force_digits is None else force_digits
    y = kernel["ext"].int8_vnni_linear(x.reshape(rows, k), kernel["weight"], kernel["comp"],
                                       kernel["scale"], bias, d)
    return y.reshape(*x.shape[:-1], y.shape[-1])

"""Per-channel int8 linears on the VNNI panels (vlinfer/ops/cpu/int8_panels.py, csrc/int8_vnni.cpp)
against the schemes' definitions written here: W8A8's per-token int8 activations (max|x| / 127,
round half to even, +128 offset taken back by the weight sums) and W8A16's 16-bit activations per
row; per-row errors, planted scale and offset bugs that must fail, the row-count rule, and which
path each CPU runs (flags mocked: AVX2-only, AVX-VNNI-only, AMX)."""
import logging

import pytest
import torch

from vlinfer.ops.cpu import CpuOps
from vlinfer.ops.cpu import int8_panels
from vlinfer.platform import cpu_features

TOP = {1: 127.0, 2: 32767.0}  # largest activation integer per digit count


@pytest.fixture(scope="module")
def ops():
    ops = CpuOps()
    if not ops.ext.int8_vnni_available():
        pytest.skip(f"the VNNI panels need AVX512-VNNI (this CPU's level: {ops.isa})")
    return ops


def int8_layer(n: int, k: int, seed: int) -> dict:
    """A per-channel int8 layer as quantization="int8" makes one: q = round(w / s), s = max|w_row|
    / 127."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    scale = w.abs().amax(1, keepdim=True) / 127
    return {"weight": torch.round(w / scale).to(torch.int8), "weight_scale": scale}


def quantize_rows(x: torch.Tensor, digits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation integers v and row scales s of the definition: s = max|x_row| / TOP in
    float32, v = round(x / s) half to even, clamped to [-TOP - (digits == 1), TOP]; a zero row has
    s = 0 and v = 0."""
    xf = x.float()
    s = xf.abs().amax(-1) / TOP[digits]
    v = torch.round(xf / torch.where(s > 0, s, torch.ones_like(s))[:, None])
    return v.clamp(-TOP[digits] - (digits == 1), TOP[digits]), s


def oracle(x, tensors, bias, digits):
    """float(sum v q) * w_scale * s (+ bias) in float32, the sums exact in float64, cast to x's
    dtype; digits 0: x @ bf16(q * w_scale)^T (+ bias), the dequantized weight rounded to x's dtype
    (bf16), sums in float64."""
    if digits == 0:
        w = (tensors["weight"].float() * tensors["weight_scale"].float()).to(x.dtype)
        y = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        return y.to(x.dtype)
    v, s = quantize_rows(x, digits)
    acc = (v.double() @ tensors["weight"].double().t()).float()
    y = acc * tensors["weight_scale"].float().reshape(1, -1) * s[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def per_row_err(out, expected) -> float:
    """The worst row's max abs error over that row's max |expected| (never a batch-wide max)."""
    err = (out.double() - expected.double()).abs().amax(-1)
    return (err / expected.double().abs().amax(-1).clamp_min(1e-30)).max().item()


# float32: the kernel's float32 products in the reference's order (a fused bias add rounds once
# less); bf16: one bf16 rounding of the output.
ROW_TOL = {torch.float32: 1e-6, torch.bfloat16: 2**-8}
SHAPES = [(1, 64, 64), (2, 96, 100), (3, 160, 260), (4, 64, 1536), (5, 128, 96), (17, 64, 576),
          (70, 96, 132)]


@pytest.mark.parametrize("digits", [1, 2, 0], ids=["w8a8", "w8a16", "w8a16-widened"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, n, k", SHAPES, ids=lambda v: str(v))
def test_vnni_panels_equal_the_scheme_definition(ops, rows, n, k, dtype, digits):
    """Tiles of 1-8 rows, one and two panels, K off 16 (masked tails): per row within ROW_TOL of
    the definition; W8A16 also within 1e-4 of float activations (the 16-bit rounding). The widened
    bf16 panels take bf16 only, and say so for float32."""
    tensors = int8_layer(n, k, rows + n + k)
    kernel = int8_panels.pack(tensors["weight"], tensors["weight_scale"], "w8a16", ops.ext)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    if digits == 0 and dtype == torch.float32:
        with pytest.raises(RuntimeError, match=r"widened bf16 panels\) takes bf16 x"):
            int8_panels.linear(x, kernel, bias, force_digits=digits)
        return
    out = int8_panels.linear(x, kernel, bias, force_digits=digits)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert per_row_err(out, oracle(x, tensors, bias, digits)) < ROW_TOL[dtype]
    if digits == 2 and dtype == torch.float32:
        w = tensors["weight"].double() * tensors["weight_scale"].double()
        assert per_row_err(out, x.double() @ w.t() + bias.double()) < 1e-4
    out3 = int8_panels.linear(x.reshape(1, rows, k), kernel, bias, force_digits=digits)
    assert torch.equal(out3.reshape(rows, n), out)


@pytest.mark.parametrize("digits", [1, 2], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_activation_quantizer_is_the_definition(ops, dtype, digits):
    """Bytes and scales equal the definition, ties included: a row whose largest value is TOP (s =
    1) holding exact halves rounds them to even; a zero row has scale 0 and zero integers."""
    g = torch.Generator().manual_seed(digits)
    x = torch.randn(6, 100, generator=g)
    x[1] = 0
    x[2, :8] = torch.tensor([2.5, -3.5, 0.5, -0.5, 1.5, 6.5, -7.5, TOP[digits]])
    x[2, 8:] = 0
    x = x.to(dtype)
    q, s = ops.ext.int8_vnni_quantize(x, digits)
    v, s_def = quantize_rows(x, digits)
    held = q[:, 0].int() - 128
    if digits == 2:
        held = held * 256 + q[:, 1].int()
    assert torch.equal(s, s_def)
    assert torch.equal(held.float(), v)
    assert s[1] == 0
    if x[2, 7].item() == TOP[digits]:  # bf16 holds 127 but not 32767: s = 1 only where it does
        assert v[2, :7].tolist() == [2, -4, 0, 0, 2, 6, -8]


@pytest.mark.parametrize("plant", ["scale off 1%", "scales swapped", "offset sum off by one"])
@pytest.mark.parametrize("rows, digits", [(1, 2), (40, 1), (40, 2), (40, 0)], ids=str)
def test_a_planted_bug_fails_the_per_row_check(ops, rows, digits, plant):
    """The check above stays able to fail: one channel's scale off by 1%, two channels' scales
    swapped across panels, or one channel's +128 compensation off by half a weight sum each fail
    it, on every path (float32 where the bound is tight; on the widened bf16 panels, whose bound is
    one bf16 rounding, a scale off by 1.5x in place of 1% and of the compensation)."""
    tensors = int8_layer(96, 128, 7)
    kernel = int8_panels.pack(tensors["weight"], tensors["weight_scale"], "w8a16", ops.ext)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    if digits == 0:  # bf16 only: one bf16 rounding bounds the check
        x = x.bfloat16()
    tol = ROW_TOL[x.dtype]
    expected = oracle(x, tensors, None, digits)
    good = int8_panels.linear(x, kernel, None, force_digits=digits)
    assert per_row_err(good, expected) < tol
    bad = dict(kernel, scale=kernel["scale"].clone(), comp=kernel["comp"].clone())
    if plant == "scale off 1%":
        bad["scale"][5] *= 1.01 if digits else 1.5
    elif plant == "scales swapped":
        bad["scale"][[3, 67]] = bad["scale"][[67, 3]]
    elif digits == 0:  # the widened panels take no compensation: plant a larger scale error
        bad["scale"][40] *= 1.5
    else:
        bad["comp"][40] += 64
    out = int8_panels.linear(x, bad, None, force_digits=digits)
    assert per_row_err(out, expected) > (4 if digits == 0 else 100) * tol


def test_the_row_rule_and_the_packing_choice(ops):
    """W8A16 with two digits up to WIDEN_ROWS rows and in float32, the widened bf16 panels
    above in bf16; W8A8 checkpoints W8A8 at every row count. Per-channel layers on whole panels pack
    as VNNI panels, others keep the block kernel."""
    top = int8_panels.WIDEN_ROWS
    for dtype in (torch.float32, torch.bfloat16):
        assert int8_panels.digits(top, dtype, "w8a16") == 2
        assert int8_panels.digits(1, dtype, "w8a8") == 1
        assert int8_panels.digits(4096, dtype, "w8a8") == 1
    assert int8_panels.digits(top + 1, torch.bfloat16, "w8a16") == 0
    assert int8_panels.digits(4096, torch.float32, "w8a16") == 2
    with pytest.raises(ValueError, match="policy must be one of"):
        int8_panels.pack(torch.zeros(32, 4, dtype=torch.int8), torch.ones(32), "w4", ops.ext)
    assert ops.pack_quantized_linear("w8a16", int8_layer(64, 64, 0))["cpu"]["kind"] == "int8_vnni"
    packed = ops.pack_quantized_linear("w8a8_dynamic", int8_layer(64, 64, 0))
    assert packed["cpu"]["kind"] == "int8_vnni" and packed["cpu"]["policy"] == "w8a8"
    assert ops.pack_quantized_linear("w8a16", int8_layer(48, 64, 0))["cpu"]["kind"] == "int8"


def test_zero_rows_and_zero_activations(ops):
    tensors = int8_layer(64, 64, 3)
    kernel = int8_panels.pack(tensors["weight"], tensors["weight_scale"], "w8a16", ops.ext)
    bias = torch.randn(64)
    assert int8_panels.linear(torch.zeros(0, 64), kernel, bias).shape == (0, 64)
    for rows, dtype in ((1, torch.float32), (9, torch.float32), (9, torch.bfloat16)):
        out = int8_panels.linear(torch.zeros(rows, 64, dtype=dtype), kernel, bias)
        assert torch.equal(out, bias.to(dtype).expand(rows, 64))


class _NoVnni:
    """A build without the VNNI panels (the AVX2 and plain AVX-512 levels)."""

    @staticmethod
    def int8_vnni_available():
        return False


@pytest.mark.parametrize("flags, ext, says", [
    ({"avx2"}, _NoVnni, "no int8 dot product on this CPU (no VNNI / AMX-INT8)"),
    ({"avx2", "avx_vnni"}, _NoVnni, "AVX-VNNI (256-bit) kernels are not written yet"),
    ({"avx2", "avx512f", "avx512_vnni"}, _NoVnni, "this level's build has no AVX512-VNNI"),
    ({"avx2", "avx512f", "avx512_vnni", "amx_int8"}, "built", "AMX-INT8: its tiles are not used"),
    ({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "built", "int8 VNNI panels"),
], ids=["avx2-only", "avx-vnni", "avx512-no-vnni-build", "amx", "avx512-vnni"])
def test_the_int8_path_is_said_per_cpu(ops, monkeypatch, caplog, flags, ext, says):
    """The line naming the path and why, flags mocked; the op table logs it once, at its first
    int8 layer."""
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    line = int8_panels.int8_path(ops.ext if ext == "built" else ext)
    assert says in line
    if ext == "built" and "amx_int8" not in flags:
        assert "AMX" not in line
    monkeypatch.undo()
    fresh = CpuOps(isa=ops.isa)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        for _ in range(2):
            fresh.pack_quantized_linear("w8a16", int8_layer(64, 64, 0))
    assert caplog.text.count("per-channel int8 layers run int8 VNNI panels") == 1

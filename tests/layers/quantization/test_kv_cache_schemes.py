"""Checkpoints that carry a KV-cache scheme (layers/quantization/kv_cache.py): compressed-tensors
kv_cache_scheme (fp8 per tensor, int8 per tensor or per head) and msModelSlim C8 (int8 per channel
with offsets), built here from a tiny random checkpoint with scales calibrated on our own K and V
rows. They open, their scales reach the cache, and their logits stay within the stated tolerance of
transformers on the same weights; bad schemes and scales are refused at load, naming the field or
tensor."""
import logging

import pytest
import torch

from engine_checks import assert_block_pool_empty
from vlinfer import LLM, SamplingParams
from vlinfer.layers.quantization.kv_cache import StaticKVScales
from vlinfer.ops import reference
from vlinfer.ops.reference import kv_cache as kv_quant_reference
from vlinfer.ops.cpu import CpuOps
from kv_cache_dtype_cases import (STEP_TOLERANCE, TOLERANCE, path_logits, reference_logits,
                                  relative_gap, scheduling_path_gaps)
from text_parity_cases import PROMPTS
from kv_cache_schemes_cases import STATIC_INT8_TOLERANCE, c8_scales, kv_rows, write_variant

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def compressed_tensors_config(kind: str, strategy: str = "tensor", **overrides) -> dict:
    scheme = {
        "num_bits": 8, "type": kind, "strategy": strategy, "dynamic": False, "symmetric": True,
        **overrides
    }
    return {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": scheme, "quantization_status": "compressed"}


def calibrated(rows, granularity: str, limit: float) -> dict:
    """Symmetric scales per layer: max |x| / limit over the tensor, each KV head, or each channel.
    """
    tensors = {}
    for i, (k, v) in enumerate(rows):
        for side, x in (("k", k), ("v", v)):
            magnitude = x.abs()
            if granularity == "tensor":
                scale = magnitude.amax().reshape(1)
            elif granularity == "head":
                scale = magnitude.amax((0, 2))
            else:
                scale = magnitude.amax(0).flatten()
            tensors[f"model.layers.{i}.self_attn.{side}_scale"] = (scale / limit).float()
    return tensors


@pytest.fixture(scope="module")
def scheme_checkpoints(qwen3_checkpoint, tmp_path_factory):
    path, model = qwen3_checkpoint
    rows = kv_rows(path)
    root = tmp_path_factory.mktemp("kv-schemes")
    built = {
        "fp8": write_variant(path, str(root / "fp8"), calibrated(rows, "tensor", FP8_MAX),
                             compressed_tensors_config("float")),
        "int8-tensor": write_variant(path, str(root / "int8-tensor"),
                                     calibrated(rows, "tensor", 127),
                                     compressed_tensors_config("int")),
        "int8-head": write_variant(path, str(root / "int8-head"), calibrated(rows, "head", 127),
                                   compressed_tensors_config("int", "attn_head")),
        "c8": write_variant(
            path, str(root / "c8"), c8_scales(rows),
            description={"model_quant_type": "FLOAT", "kv_cache_type": "C8", "version": "1.0.0"}),
    }
    return built, rows, model, root


@pytest.mark.parametrize("kind, granularity", [("int8-tensor", "tensor"), ("int8-head", "head"),
                                               ("c8", "channel")])
def test_static_int8_checkpoints_open_and_match_transformers(scheme_checkpoints, kind, granularity,
                                                             caplog):
    built, _, model, _ = scheme_checkpoints
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(built[kind], dtype="float32", kv_cache_bytes=8 << 20)
    assert llm.engine.resolved.kv_cache_dtype == torch.int8
    assert f"static int8 KV cache, scales per {granularity}" in caplog.text
    assert "KV cache in torch.int8 with the checkpoint's static scales" in caplog.text
    layers = llm.engine.model_runner.cache_pool.layers
    assert all(layer.static_kv_scales is not None for layer in layers)
    # their scales move onto the query and the output, which the fused decode stack does not do
    assert llm.engine.model_runner.model.model.decode_stack is None
    for prompt, ours in zip(PROMPTS, path_logits(llm, PROMPTS)):
        assert relative_gap(ours, reference_logits(model, prompt)) < STATIC_INT8_TOLERANCE
    # The row scales stay 1.0: the static scales do the work.
    assert bool((llm.engine.model_runner.cache_pool.kv_scales == 1).all())


def test_fp8_checkpoint_scales_reach_the_cache_and_are_used(scheme_checkpoints, caplog):
    built, rows, model, root = scheme_checkpoints
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(built["fp8"], dtype="float32", kv_cache_bytes=8 << 20)
    assert llm.engine.resolved.kv_cache_dtype == torch.float8_e4m3fn
    assert "so both are 1.0" not in caplog.text
    runner = llm.engine.model_runner
    for i, (k, v) in enumerate(rows):
        torch.testing.assert_close(runner.cache_pool.kv_scales[0, i], k.abs().amax() / FP8_MAX)
        torch.testing.assert_close(runner.cache_pool.kv_scales[1, i], v.abs().amax() / FP8_MAX)
    for prompt, ours in zip(PROMPTS, path_logits(llm, PROMPTS)):
        assert relative_gap(ours, reference_logits(model, prompt)) < TOLERANCE["fp8"]
    # Scales a thousand times too small saturate every row: the outputs move, so the scales are
    # read.
    absurd = {name: t / 1000 for name, t in calibrated(rows, "tensor", FP8_MAX).items()}
    wrong = write_variant(built["fp8"], str(root / "fp8-absurd"), absurd)
    gaps = [
        relative_gap(ours, reference_logits(model, prompt)) for prompt, ours in zip(
            PROMPTS, path_logits(LLM(wrong, dtype="float32", kv_cache_bytes=8 << 20), PROMPTS))
    ]
    assert max(gaps) > TOLERANCE["fp8"]


@pytest.mark.parametrize("path_kind", ["chunked-prefix", "preemption"])
def test_fp8_scales_through_every_scheduling_path(scheme_checkpoints, path_kind, monkeypatch):
    """fp8 with the checkpoint's calibrated per-layer scales (non-unit: max |x| / 448): the
    chunked / prefix-hit or preempted run's own step logits within STEP_TOLERANCE["fp8"]
    of transformers at those positions of the same sequences."""
    built, rows, model, _ = scheme_checkpoints
    assert all(k.abs().amax() / FP8_MAX < 0.5 for k, _ in rows)  # far from 1.0
    gaps = scheduling_path_gaps(built["fp8"], model, path_kind, monkeypatch)
    assert max(gaps) < STEP_TOLERANCE["fp8"], gaps


def test_an_fp8_reader_ignoring_the_scale_fails_the_step_bound(scheme_checkpoints, monkeypatch):
    """Negative control: rows written with the checkpoint's scales and read back with scale 1.0
    (planted in the op table's call) put the step logits outside the bound the test above holds
    (measured 1.2-1.4 of the largest logit)."""
    built, _, model, _ = scheme_checkpoints
    read = CpuOps.quantized_paged_attention

    def misread(self, q, k_cache, v_cache, k_scale, v_scale, *rest):
        return read(self, q, k_cache, v_cache, torch.ones_like(k_scale), torch.ones_like(v_scale),
                    *rest)
    monkeypatch.setattr(CpuOps, "quantized_paged_attention", misread)
    gaps = scheduling_path_gaps(built["fp8"], model, "preemption", monkeypatch)
    assert min(gaps) > STEP_TOLERANCE["fp8"], gaps


def test_scheme_checkpoints_through_chunked_prefill_prefix_hits_and_preemption(scheme_checkpoints):
    """C8 through chunked prefill with prefix-cache hits, then preemption: greedy outputs equal the
    same engine's unchunked, unpreempted ones, and the pool ends empty."""
    built, _, _, _ = scheme_checkpoints
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [p for p in PROMPTS if len(p) <= 64]
    baseline = [
        o.outputs[0].token_ids
        for o in LLM(built["c8"], dtype="float32", kv_cache_bytes=8 << 20).generate(
            prompts, params, use_tqdm=False)
    ]
    chunked = LLM(built["c8"], dtype="float32", kv_cache_bytes=8 << 20, max_num_batched_tokens=16,
                  max_model_len=256)
    for round_ in range(2):
        outs = chunked.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == baseline
    # the second round hit
    assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 16)
    assert_block_pool_empty(chunked)
    block = chunked.engine.model_runner.cache_pool.bytes_per_block
    tight = LLM(built["c8"], dtype="float32", kv_cache_bytes=6 * block, max_model_len=96,
                max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids
            for o in tight.generate(prompts, params, use_tqdm=False)] == baseline
    assert tight.engine.scheduler.num_preemptions > 0
    assert_block_pool_empty(tight)


@pytest.mark.parametrize("ops", [reference.ReferenceOps, CpuOps])
def test_static_int8_reads_equal_attention_over_the_dequantized_cache(ops):
    """K's scales on the query and V's on the output (layers/attention.py) equal attending over
    (stored - offset) * scale, through the op table's int8 reader with row scales 1.0: the algebra
    kv_quant_reference states."""
    from vlinfer.layers import Attention, ForwardContext, ModelContext
    torch.manual_seed(3)
    kv_heads, heads, head_dim, block = 2, 4, 16, 4
    ctx = ModelContext(ops())
    attn = Attention(ctx, heads, head_dim, head_dim ** -0.5, kv_heads)
    attn.k_cache = torch.zeros(4, block, kv_heads, head_dim, dtype=torch.int8)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    attn.k_scale, attn.v_scale = torch.ones(4, block, kv_heads), torch.ones(4, block, kv_heads)
    scales = StaticKVScales(
        torch.rand(kv_heads, head_dim) / 20 + 0.01,
        torch.rand(kv_heads, head_dim) / 20 + 0.01,
        torch.randint(-20, 20, (kv_heads, head_dim)).float(),
        torch.randint(-20, 20, (kv_heads, head_dim)).float())
    attn.static_kv_scales = scales
    # One sequence: a 5-token prefill, then one decode token.
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    outputs, dense_k, dense_v = [], [], []
    for start, n in ((0, 5), (5, 1)):
        q, k, v = torch.randn(n, heads,
                              head_dim), torch.randn(n, kv_heads,
                                                     head_dim), torch.randn(n, kv_heads, head_dim)
        pos = torch.arange(start, start + n)
        step = ForwardContext(slot_mapping=(tables[0][pos // block].long() * block + pos % block),
                              cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                              seq_lens=torch.tensor([start + n], dtype=torch.int32),
                              block_tables=tables, decode_only=n == 1)
        with ctx.stepping(step):
            outputs.append(attn(q, k, v).view(n, heads, head_dim))
        k_cache = (attn.k_cache.float() - scales.k_offset) * scales.k_scale
        v_cache = (attn.v_cache.float() - scales.v_offset) * scales.v_scale
        expected = reference.paged_attention(q, k_cache, v_cache, step.cu_seqlens_q, step.seq_lens,
                                             tables, head_dim**-0.5)
        torch.testing.assert_close(outputs[-1], expected, rtol=1e-4, atol=1e-5)
        stored = kv_quant_reference.quantize_static(k, scales.k_scale, scales.k_offset)
        assert torch.equal(attn.k_cache.view(-1, kv_heads, head_dim)[step.slot_mapping], stored)


def test_an_explicit_other_cache_dtype_overrides_the_scheme_with_a_warning(
        scheme_checkpoints, caplog):
    built, _, _, _ = scheme_checkpoints
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = LLM(built["c8"], dtype="float32", kv_cache_bytes=8 << 20, kv_cache_dtype="bfloat16")
    assert llm.engine.resolved.kv_cache_dtype == torch.bfloat16
    assert "kv_cache_dtype=bfloat16 overrides the checkpoint's KV scheme" in caplog.text
    layers = llm.engine.model_runner.cache_pool.layers
    assert all(layer.static_kv_scales is None for layer in layers)
    # Asking for the scheme's own dtype by name uses its scales.
    llm = LLM(built["fp8"], dtype="float32", kv_cache_bytes=8 << 20, kv_cache_dtype="fp8")
    layers = llm.engine.model_runner.cache_pool.layers
    assert all(layer.static_kv_scales is not None for layer in layers)


def _refused(src, dst, tensors, config=None, description=None, match=""):
    path = write_variant(src, dst, tensors, config, description)
    with pytest.raises(ValueError, match=match):
        LLM(path, dtype="float32", kv_cache_bytes=8 << 20)


def test_schemes_and_scales_the_engine_cannot_run_are_refused_naming_them(
        qwen3_checkpoint, scheme_checkpoints):
    path, _ = qwen3_checkpoint
    _, rows, _, root = scheme_checkpoints
    fp8_scales = calibrated(rows, "tensor", FP8_MAX)
    _refused(
        path, str(root / "asym"), fp8_scales, compressed_tensors_config("float", symmetric=False),
        match=r"kv_cache_scheme: symmetric=false \(asymmetric float8 KV cache\) is not supported")
    _refused(path, str(root / "group"), fp8_scales,
             compressed_tensors_config("int", "group", group_size=8),
             match=r"kv_cache_scheme: strategy='group' is not supported for a int8 KV cache")
    _refused(path, str(root / "fp4"), fp8_scales, compressed_tensors_config("float", num_bits=4),
             match="float 4-bit KV caches are not supported")
    wrong_shape = {**fp8_scales, "model.layers.1.self_attn.v_scale": torch.ones(3)}
    _refused(path, str(root / "shape"), wrong_shape, compressed_tensors_config("float"),
             match=r"checkpoint tensor 'model.layers.1.self_attn.v_scale': shape \(3,\)")
    missing = {n: t for n, t in fp8_scales.items() if n != "model.layers.0.self_attn.k_scale"}
    _refused(
        path, str(root / "missing"), missing, compressed_tensors_config("float"), match=
        r"decoder layer 0: .* needs its K scale, tensor '...layers.0.self_attn.k_scale', which is "
        r"missing"
    )
    negative = {**fp8_scales, "model.layers.0.self_attn.k_scale": torch.tensor([-1.0])}
    _refused(path, str(root / "negative"), negative, compressed_tensors_config("float"),
             match="'model.layers.0.self_attn.k_scale': scales must be finite and positive")
    # C8 names its own tensors: a compressed-tensors scale in a C8 checkpoint is not one of them.
    _refused(
        path, str(root / "stray"), {**c8_scales(rows), **fp8_scales},
        description={"model_quant_type": "FLOAT", "kv_cache_type": "C8"},
        match=r"'model.layers.0.self_attn.k_scale' is not a scale of the checkpoint's KV scheme")

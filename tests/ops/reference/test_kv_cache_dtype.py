"""KV caches stored in another dtype than the compute dtype (kv_cache_dtype,
ops/reference/kv_cache.py): the rows written and read back, the capacity they buy, and the engine's
outputs against transformers on the same weights, through every scheduling path, within the
tolerance README's correctness table states."""
import logging

import pytest
import torch

from engine_checks import assert_block_pool_empty
from paged_batches import CUDA_ATTENTION_TOL, make_batch, rel_err_per_seq
from cpu_levels import kernel_levels
from vlinfer import LLM, SamplingParams
from vlinfer.config import KV_CACHE_DTYPES, EngineConfig
from vlinfer.ops import reference
from vlinfer.ops.reference import kv_cache as kv_quant_reference
from vlinfer.platform import cpu_features
from text_parity_cases import PROMPTS
from kv_cache_dtype_cases import (SCHEDULED_PROMPTS, STEP_TOLERANCE, TOLERANCE, path_logits,
                                  reference_logits, relative_gap, scheduling_path_gaps)

COMPRESSED = ["bfloat16", "float16", "fp8", "fp8_e5m2", "int8"]


def test_the_names_are_vllms_and_an_unknown_one_is_refused_before_loading(tmp_path):
    assert set(KV_CACHE_DTYPES) == {
        "auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"
    }
    assert KV_CACHE_DTYPES["fp8"] is KV_CACHE_DTYPES["fp8_e4m3"]
    with pytest.raises(
            ValueError,
            match=r"kv_cache_dtype='fp4' is not supported: expected one of auto, bfloat16"):
        EngineConfig(model="x", kv_cache_dtype="fp4")
    # no checkpoint needed: nothing is read first
    with pytest.raises(ValueError, match="kv_cache_dtype='q8_0'"):
        LLM(str(tmp_path / "missing"), kv_cache_dtype="q8_0")


def test_int8_rows_round_to_their_own_scale_and_padding_slots_are_skipped():
    torch.manual_seed(0)
    key, value = torch.randn(5, 2, 16) * torch.tensor([1.0, 50.0])[None, :, None], torch.randn(
        5, 2, 16)
    k_cache = torch.zeros(3, 4, 2, 16, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.ones(3, 4, 2), torch.ones(3, 4, 2)
    slots = torch.tensor([0, 5, -1, 11, 2])
    kv_quant_reference.store_quantized_kvcache(key, value, k_cache, v_cache, k_scale, v_scale,
                                               slots)
    flat_scale = k_scale.view(-1, 2)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        expected = key[row].abs().amax(-1) / 127
        torch.testing.assert_close(flat_scale[slot], expected)
        back = kv_quant_reference.dequantize(
            k_cache.view(-1, 2, 16)[slot], flat_scale[slot], torch.float32)
        # within half a step of its row
        assert ((back - key[row]).abs() <= expected[:, None] / 2 + 1e-6).all()
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert (k_cache.view(-1, 2, 16)[untouched] == 0).all() and (flat_scale[untouched] == 1).all()


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2", "bfloat16", "float16"])
def test_floating_caches_apply_the_per_tensor_scale_and_saturate(name):
    dtype = KV_CACHE_DTYPES[name]
    x = torch.tensor([[[0.5, -3.0, 1e6, -1e6]]])
    scale = torch.tensor(2.0)
    rows, row_scale = kv_quant_reference.quantize_rows(x, dtype, scale)
    assert rows.dtype == dtype and row_scale is None
    back = kv_quant_reference.dequantize(rows, scale, torch.float32)
    limit = torch.finfo(dtype).max
    torch.testing.assert_close(back[0, 0, :2], torch.tensor([0.5, -3.0]), rtol=0.13, atol=0)
    expected_big = min(5e5, limit) * 2
    torch.testing.assert_close(back[0, 0, 2:], torch.tensor([expected_big, -expected_big]),
                               rtol=0.13, atol=0)


@pytest.mark.parametrize("name", COMPRESSED)
def test_prompt_logits_within_the_stated_tolerance(tiny_checkpoint, name):
    path, model = tiny_checkpoint
    llm = LLM(path, dtype="float32", kv_cache_bytes=8 << 20, kv_cache_dtype=name)
    assert llm.engine.resolved.kv_cache_dtype == KV_CACHE_DTYPES[name]
    for prompt, ours in zip(PROMPTS, path_logits(llm, PROMPTS)):
        assert relative_gap(ours, reference_logits(model,
                                                   prompt)) < TOLERANCE[name], (name, len(prompt))


SCHEDULED_LENGTHS = [len(p) for p in SCHEDULED_PROMPTS]


@pytest.mark.parametrize("name", ["int8", "bfloat16", "fp8"])
@pytest.mark.parametrize("path_kind", ["chunked-prefix", "preemption"])
def test_every_scheduling_path_stays_within_the_tolerance(qwen3_checkpoint, name, path_kind,
                                                         monkeypatch):
    """The chunked / prefix-hit or preempted run's own logits, every step, within STEP_TOLERANCE
    of transformers' logits at that position of the same sequence."""
    path, model = qwen3_checkpoint
    gaps = scheduling_path_gaps(path, model, path_kind, monkeypatch, kv_cache_dtype=name)
    assert max(gaps) < STEP_TOLERANCE[name], (name, gaps)


def test_a_decode_reader_dropping_the_last_key_fails_the_step_bound(qwen3_checkpoint,
                                                                    monkeypatch):
    """Negative control: the fp8 cache's decode reader given one key fewer than each sequence
    holds (planted) puts the steps of the sequences past 16 tokens outside STEP_TOLERANCE. The
    fused decode stack calls the same reader from C++, out of the plant's reach: it is off here."""
    from vlinfer.ops.cpu import CpuOps
    from vlinfer.ops.cpu.loader import build_extension
    path, model = qwen3_checkpoint
    monkeypatch.setattr(CpuOps, "dense_decode_stack", lambda self, *args, **kwargs: None)
    ext = build_extension(cpu_features.cpu_isa())
    read = ext.paged_decode_attention_quantized
    monkeypatch.setattr(ext, "paged_decode_attention_quantized",
                        lambda q, k, v, ks, vs, tables, lens, scale: read(q, k, v, ks, vs, tables,
                                                                          lens - 1, scale))
    gaps = scheduling_path_gaps(path, model, "preemption", monkeypatch, kv_cache_dtype="fp8")
    long = [g for g, n in zip(gaps, SCHEDULED_LENGTHS) if n > 16]
    assert min(long) > STEP_TOLERANCE["fp8"], gaps


def test_a_cache_of_the_compute_dtype_is_todays_path(qwen3_checkpoint):
    """kv_cache_dtype naming the compute dtype stores it as "auto" does: no scales, bit-identical
    outputs, and the fused decode stack still runs."""
    path, _ = qwen3_checkpoint
    runs = []
    for name in ("auto", "bfloat16"):
        llm = LLM(path, dtype="bfloat16", kv_cache_bytes=8 << 20, kv_cache_dtype=name)
        assert llm.engine.model_runner.cache_pool.kv_scales is None
        assert all(layer.k_scale is None for layer in llm.engine.model_runner.cache_pool.layers)
        runs.append([o.outputs[0].logprobs for o in llm.generate(
            PROMPTS[:4], SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)])
    assert runs[0] == runs[1]


def test_capacity_counts_the_stored_bytes_and_scales(qwen3_checkpoint):
    path, _ = qwen3_checkpoint
    budget = 4 << 20
    blocks = {
        name: LLM(path, dtype="float32", kv_cache_bytes=budget, max_num_seqs=1024,
                  kv_cache_dtype=name).engine.resolved
        for name in ("auto", "bfloat16", "fp8", "int8")
    }
    head_dim = 16
    assert blocks["bfloat16"].bytes_per_block * 2 == blocks["auto"].bytes_per_block
    assert blocks["fp8"].bytes_per_block * 4 == blocks["auto"].bytes_per_block
    # int8: head_dim bytes and one float32 scale per row, against 4 * head_dim bytes.
    assert blocks["int8"].bytes_per_block * 4 * head_dim == blocks["auto"].bytes_per_block * (
        head_dim + 4)
    for resolved in blocks.values():
        assert resolved.num_blocks == budget // resolved.bytes_per_block
    llm = LLM(path, dtype="float32", kv_cache_bytes=budget, kv_cache_dtype="int8")
    described = llm.engine.model_runner.describe()
    assert described[
        "kv_cache_bytes"] == llm.engine.resolved.num_blocks * llm.engine.resolved.bytes_per_block


def test_the_log_names_the_cache_dtype_its_reader_and_the_decode_fusion(qwen3_checkpoint, caplog):
    path, _ = qwen3_checkpoint
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        LLM(path, dtype="float32", kv_cache_bytes=4 << 20, kv_cache_dtype="fp8", ops="reference")
    text = caplog.text
    assert ("KV cache in torch.float8_e4m3fn: the checkpoint has no k_scale / v_scale, so both "
            "are 1.0") in text
    assert (
        "KV cache in torch.float8_e4m3fn: reference has no kernel that reads it; its writes and "
        "attention run "
        "the pure-torch reference") in text
    assert "blocks of 16 tokens in float8_e4m3fn" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        LLM(path, dtype="float32", kv_cache_bytes=4 << 20, kv_cache_dtype="int8",
            ops="cpu-compiled")
    text = caplog.text
    assert "KV cache in torch.int8: cpu-compiled kernels write it and read it" in text
    from vlinfer.ops.cpu import CpuOps
    if torch.float32 in CpuOps().panel_dtypes:  # float32 panels (AVX-512): the fused stack reads it
        assert "decoder layers in one op call (cpu-compiled)" in text
    else:
        assert ("module by module (cpu-compiled has no fused form for them over a KV cache stored "
                "in torch.int8)") in text
    assert "no kernel that reads it" not in text


def test_quantized_attention_reads_only_the_named_blocks():
    """The reference reads back the blocks the tables name (renumbered), and equals attention over
    the dequantized cache; stale blocks elsewhere (NaN) never reach an output."""
    torch.manual_seed(1)
    k_cache = torch.randint(-127, 128, (6, 4, 2, 8), dtype=torch.int8)
    v_cache = torch.randint(-127, 128, (6, 4, 2, 8), dtype=torch.int8)
    k_scale, v_scale = torch.rand(6, 4, 2) / 100, torch.rand(6, 4, 2) / 100
    k_scale[3] = float("nan")  # a block no table names
    tables = torch.tensor([[5, 0, -1], [2, -1, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([7, 3], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)  # a 3-token chunk and a decode
    q = torch.randn(4, 4, 8)
    out = reference.quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens,
                                              tables, 0.3)
    dense_k = kv_quant_reference.dequantize(k_cache, k_scale, torch.float32)
    dense_v = kv_quant_reference.dequantize(v_cache, v_scale, torch.float32)
    expected = reference.paged_attention(q, dense_k, dense_v, cu, seq_lens, tables, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", ["int8", "bfloat16"])
def test_the_embedded_vl_model_captions_the_same_with_a_compressed_cache(name):
    """Image tokens in the cache: the trained toy's greedy captions (wide margins) are unchanged."""
    from vlinfer.toy import embedded, scenes
    items = scenes.generate(embedded.EVAL_SEED + 3, 4)
    chats = [[{"role": "user", "content": [{"type": "image", "image": image},
                                           {"type": "text", "text": "Describe this image."}]}]
             for _, image, _ in items]
    params = SamplingParams(temperature=0, max_tokens=32)
    texts = {}
    for kv in ("auto", name):
        llm = LLM("qwen3-vl-toy", dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20,
                  kv_cache_dtype=kv)
        texts[kv] = [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
        assert_block_pool_empty(llm)
    assert texts[name] == texts["auto"]


def test_readme_capacity_table():
    """docs/kv-cache.md's tokens per GiB, from the engine's own bytes per token."""
    import re

    from dependencies import REPO
    from vlinfer.engine.cache_pool import kv_bytes_per_token
    text = open(f"{REPO}/docs/kv-cache.md").read()
    shapes = {"Qwen3-VL-2B": (28, 8, 128), "SmolLM2-135M": (30, 3, 64)}
    for model, shape in shapes.items():
        row = re.search(rf"^\| {model} \(.*$", text, re.M).group(0)
        written = [int(cell.replace(",", "")) for cell in row.split("|")[2:6]]
        expected = [2 ** 30 // kv_bytes_per_token(*shape, dtype)
                    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)]
        assert written == expected, (model, written, expected)


def test_hybrid_capacity_table():
    """docs/kv-cache.md's Qwen3.5-2B rows: KV blocks and state slots per GiB, from the engine's
    own bytes per token (cache_pool.kv_bytes_per_token) and per slot (StateSlotSpec), for the
    published shape (bench/hybrid_common.py: 6 of 24 layers full attention with 2 KV heads of
    256; 18 Gated DeltaNet layers of 16 key heads of 128, 16 value heads of 128, kernel 4) in a
    bf16 model (the conv state in bf16)."""
    import re

    from dependencies import REPO
    from vlinfer.engine.cache_pool import StateSlotSpec, kv_bytes_per_token
    text = open(f"{REPO}/docs/kv-cache.md").read()
    kv_row = re.search(r"^\| Qwen3\.5-2B KV blocks .*$", text, re.M).group(0)
    state_row = re.search(r"^\| Qwen3\.5-2B state slots .*$", text, re.M).group(0)
    kv = [2 ** 30 // (16 * kv_bytes_per_token(6, 2, 256, d))
          for d in (torch.bfloat16, torch.int8, torch.float8_e4m3fn)]
    shapes = ((2 * 16 * 128 + 16 * 128, 3), (16, 128, 128))
    state = [2 ** 30 // StateSlotSpec(18, shapes, (torch.bfloat16, d), ()).bytes_per_slot
             for d in (torch.float32, torch.bfloat16)]
    assert [int(c.replace(",", "")) for c in kv_row.split("|")[2:5]] == kv, kv
    assert [int(c.replace(",", "")) for c in state_row.split("|")[2:4]] == state, state


@pytest.fixture(scope="module", params=kernel_levels())
def kernel_ops(request):
    from vlinfer.ops.cpu import CpuOps
    return CpuOps(isa=request.param)


@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
# the vector readers' two widths, and the plain loops'
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_cpu_kernels_write_and_read_as_the_reference(kernel_ops, name, dtype, head_dim):
    """The compiled cache write equals the reference's rows (int8 codes within one step where x /
    scale sits on a rounding edge) and scales; decode attention over the stored rows (GQA and not),
    and a mixed step, equal the reference within float32 summation order (bf16: one bf16 rounding).
    """
    torch.manual_seed(3)
    cache_dtype = KV_CACHE_DTYPES[name]
    blocks, block_size, kv_heads = 9, 16, 2
    shape = (blocks, block_size, kv_heads, head_dim)
    per_row = cache_dtype == torch.int8

    def empty_cache():
        scale_shape = shape[:3] if per_row else ()
        return (torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype),
                torch.ones(scale_shape) if per_row else torch.tensor(0.5),
                torch.ones(scale_shape) if per_row else torch.tensor(0.25))

    ours, theirs = empty_cache(), empty_cache()
    tokens = 100
    key, value = torch.randn(tokens, kv_heads,
                             head_dim).to(dtype), torch.randn(tokens, kv_heads, head_dim).to(dtype)
    slots = torch.randperm(blocks * block_size)[:tokens]
    slots[7] = -1
    kernel_ops.store_quantized_kvcache(key, value, *ours[:2], *ours[2:], slots)
    kv_quant_reference.store_quantized_kvcache(key, value, *theirs[:2], *theirs[2:], slots)
    for a, b in zip(ours, theirs):
        if a.dtype == torch.int8:
            assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() < 1e-3
        elif a.dtype.is_floating_point and a.dtype.itemsize == 1:
            assert (a.view(torch.uint8) != b.view(torch.uint8)).float().mean() < 1e-3
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=0)
    tables = torch.tensor([[0, 3, 5, -1], [8, -1, -1, -1], [1, 2, 4, 6]], dtype=torch.int32)
    # A group of 4 query heads per KV head (the AVX-512 reader converts each key row once for the
    # group) and of 1.
    for lens, q_lens, heads in (([40, 3, 64], [1, 1, 1], 8), ([40, 3,
                                                               64], [1, 1, 1], 2), ([40, 3,
                                                                                     64], [5, 1,
                                                                                           1], 8)):
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        q = torch.randn(int(cu[-1]), heads, head_dim).to(dtype)
        got = kernel_ops.quantized_paged_attention(q, *ours[:2], *ours[2:], cu, seq_lens, tables,
                                                   0.125)
        expected = reference.quantized_paged_attention(q, *ours[:2], *ours[2:], cu, seq_lens,
                                                       tables, 0.125)
        tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(
            rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("head_dim, gqa", [(64, 3), (128, 2), (72, 1)])
def test_int8_prefill_chunks_run_the_bf16_kernel_on_the_rows_read_back(head_dim, gqa):
    """Prefill chunks over an int8 cache with bf16 queries (csrc/attention_bf16.cpp
    prefill_attention_int8): from scratch, after a cached context, beside decodes. Their rows equal
    the bf16 cache's kernel on the reference's rows read back (dequantized_blocks), bit for bit;
    every sequence is within the bf16 attention tolerance of exact attention over those rows; a
    kernel reading the other KV head's scales, or a block's rows as zeros, is not."""
    from vlinfer.ops.cpu import CpuOps
    ops = CpuOps(bf16_prefill_kernels=True)
    if not ops.bf16_attention:
        pytest.skip("needs AVX512-BF16: below it int8 prefill chunks run SDPA on rows read back")
    q_lens, kv_lens, block_size = [300, 1, 70, 2, 1], [300, 40, 470, 9, 200], 16
    q, k, v, cu, lens, tables = make_batch(q_lens, kv_lens, 2 * gqa, 2, head_dim, block_size,
                                           torch.float32, seed=11)
    k[:, :, 1] *= 3  # heads of different magnitudes, so a head's scale read for the other shows
    caches = (torch.zeros(k.shape, dtype=torch.int8), torch.zeros(v.shape, dtype=torch.int8),
              torch.ones(k.shape[:3]), torch.ones(v.shape[:3]))
    kv_quant_reference.store_quantized_kvcache(k.flatten(0, 1), v.flatten(0, 1), *caches,
                                               torch.arange(k.shape[0] * block_size))
    q, scale = q.bfloat16(), head_dim ** -0.5
    ours = ops.quantized_paged_attention(q, *caches, cu, lens, tables, scale)
    k_read, v_read, local = kv_quant_reference.dequantized_blocks(*caches, tables, torch.bfloat16)
    bf16_cache = ops.paged_attention(q, k_read, v_read, cu, lens, local, scale)
    q_lens = cu[1:] - cu[:-1]
    chunk_rows = torch.repeat_interleave(q_lens > 1, q_lens)
    assert torch.equal(ours[chunk_rows], bf16_cache[chunk_rows])
    exact = reference.quantized_paged_attention(q.float(), *caches, cu, lens, tables, scale)
    tolerance = CUDA_ATTENTION_TOL[torch.bfloat16]
    assert rel_err_per_seq(ours, exact, cu) < tolerance
    k_cache, v_cache, k_scale, v_scale = caches
    dropped_k, dropped_v = k_scale.clone(), v_scale.clone()
    dropped_k[tables[0, 0]] = dropped_v[tables[0, 0]] = 0  # the first block of a fresh prompt
    for planted in ((k_cache, v_cache, k_scale.roll(1, dims=2), v_scale),
                    (k_cache, v_cache, dropped_k, dropped_v)):
        wrong = ops.quantized_paged_attention(q, *planted, cu, lens, tables, scale)
        assert rel_err_per_seq(wrong, exact, cu) > tolerance


def test_no_decode_graphs_over_a_cache_the_reference_reads(caplog):
    """CUDA / NPU graphs capture only host-sync-free steps: a KV cache that only the reference reads
    runs eager, and says so."""
    import types

    from vlinfer.engine import graph_runner
    from vlinfer.ops import ReferenceOps
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        assert graph_runner.select_backend(EngineConfig(model="m"),
                                           types.SimpleNamespace(type="cuda"), ReferenceOps("cuda"),
                                           torch.int8) is None
    assert ("graph mode: off, the KV cache in torch.int8 is read by the pure-torch reference"
            in caplog.text)

"""int8 KV caches on the NPU path (vlinfer/ops/npu/kv_cache.py behind vlinfer/ops/npu/backend.py,
docs/npu-ops.md §2.10 and §7.7) on CPU tensors, through the emulated torch_npu of
tests/fakes/fake_torch_npu.py: the quantizing cache write (npu_dynamic_quant + the cache scatter)
and attention (FIA antiquant mode 5 for decodes, the blocks read back for prefill chunks) against
vlinfer/ops/reference/kv_cache.py; the emulation refusing what the contracts forbid; the engine on a
tiny model with kv_cache_dtype="int8" and on an msModelSlim C8 checkpoint against the CPU engine and
transformers; ACL-graph decode over the int8 cache; and the logged reference path for what FIA
cannot read (fp8, a failed check).

Tolerances: the cache write must equal the reference's bit for bit (the emulation rounds as torch
does); attention against the reference on the same cache, docs/npu-ops.md §3's 2e-3 (fp16) / 1e-2
(bf16); the engine, the int8 bound docs/kv-cache.md states (3e-2 of the largest |logit|, static C8
5e-2) in float16, where the compute dtype adds little (bfloat16 alone moves logits by up to
BF16_LOGIT_TOLERANCE, so there the cache's own error is bounded: int8 against the same engine's
`auto` cache)."""
import logging

import pytest
import torch

from engine_checks import assert_block_pool_empty
from fake_torch_npu import FakeNpuError, FakeTorchNpu, fake_npu, loaded  # noqa: F401  (fixture)
from paged_batches import make_batch, rel_err_per_seq
from vlinfer import LLM, SamplingParams
from vlinfer.engine import graph_runner
from vlinfer.ops import reference
from vlinfer.ops.npu import NpuOps
from vlinfer.ops.npu import graph as npu_graph
from vlinfer.ops.npu.graph import GraphCapture
from vlinfer.ops.reference import kv_cache as kv_quant_reference
from graph_runner_cases import PROMPTS as GRAPH_PROMPTS, generate
from kv_cache_dtype_cases import TOLERANCE, path_logits, reference_logits, relative_gap
from kv_cache_schemes_cases import STATIC_INT8_TOLERANCE, c8_scales, kv_rows, write_variant
from npu_ops_cases import BATCHES, DTYPE_IDS, HALF, NUM_KV_HEADS, TOL
from text_parity_cases import PROMPTS, prompts_of_lengths

BLOCK = 128
FIA = "npu_fused_infer_attention_score"
KW = dict(kvcache_block_size=BLOCK, kv_cache_bytes=8 << 20)


def int8_cache(ops, num_blocks, num_kv_heads, head_dim, block_size=BLOCK):
    """An empty int8 cache pair and its row scales, laid out as the op table allocates them."""
    caches = [
        torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8)
        for _ in range(2)
    ]
    scales = [ops.int8_kv_scales((num_blocks, block_size, num_kv_heads), "cpu") for _ in range(2)]
    return caches, scales


def reference_cache(num_blocks, num_kv_heads, head_dim, block_size=BLOCK):
    caches = [
        torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.int8)
        for _ in range(2)
    ]
    return caches, [torch.ones(num_blocks, block_size, num_kv_heads) for _ in range(2)]


def filled(ops, batch, dtype):
    """The batch's half caches written into an int8 cache by the op table (every slot of the pool).
    """
    q, k_half, v_half, cu, seq_lens, tables = batch
    num_blocks, block_size, num_kv_heads, head_dim = k_half.shape
    (k_cache, v_cache), (k_scale, v_scale) = int8_cache(ops, num_blocks, num_kv_heads, head_dim,
                                                        block_size)
    ops.store_quantized_kvcache(k_half.view(-1, num_kv_heads, head_dim),
                                v_half.view(-1, num_kv_heads, head_dim), k_cache, v_cache, k_scale,
                                v_scale, torch.arange(num_blocks * block_size))
    return q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens, tables


def fia_calls(fake):
    return [kw for op, kw in fake.history if op == FIA]


# ---- the cache write ----

@pytest.mark.parametrize("op", ["npu_scatter_pa_kv_cache", "_npu_reshape_and_cache"])
@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 8])
def test_int8_cache_write_equals_the_reference(monkeypatch, op, dtype, head_dim, num_kv_heads):
    fake, ops = loaded(monkeypatch, scatter_pa=op == "npu_scatter_pa_kv_cache")
    assert ops.kv_cache_kernels == (torch.int8,) and ops.features["int8_kv"]
    g = torch.Generator().manual_seed(1)
    num_blocks, n = 6, 300
    slots = torch.randperm(num_blocks * BLOCK, generator=g)[:n]
    slots[[3, 77]] = -1  # padding
    # Strided key and value (views of the fused qkv projection), one row all zeros, rows of very
    # different sizes.
    qkv = torch.randn(n, 3, num_kv_heads, head_dim, generator=g) * torch.logspace(
        -2, 2, n)[:, None, None, None]
    qkv[5] = 0
    key, value = qkv.to(dtype)[:, 1], qkv.to(dtype)[:, 2]
    (k_cache, v_cache), (k_scale, v_scale) = int8_cache(ops, num_blocks, num_kv_heads, head_dim)
    before = fake.calls[op], fake.calls["npu_dynamic_quant"]
    ops.store_quantized_kvcache(key, value, k_cache, v_cache, k_scale, v_scale, slots)
    (k_ref, v_ref), (ks_ref, vs_ref) = reference_cache(num_blocks, num_kv_heads, head_dim)
    kv_quant_reference.store_quantized_kvcache(key, value, k_ref, v_ref, ks_ref, vs_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_scale, ks_ref) and torch.equal(v_scale, vs_ref)
    # One quantization per side, one scatter of int8 rows; the scales stay heads-major in memory
    # (§2.10).
    assert (fake.calls[op] - before[0], fake.calls["npu_dynamic_quant"] - before[1]) == (1, 2)
    if op == "npu_scatter_pa_kv_cache":
        assert fake.last[op] == {"cache_mode": "Norm"}
    assert k_scale.transpose(
        1, 2).is_contiguous() and k_scale.shape == (num_blocks, BLOCK, num_kv_heads)


def test_static_int8_rows_are_scattered_as_they_are(monkeypatch):
    """A static int8 checkpoint's layer quantizes itself (kv_quant_reference.quantize_static) and
    hands the op table int8 rows: the plain cache write scatters them unchanged, no quantization op,
    no reference."""
    fake, ops = loaded(monkeypatch)
    # the first-use check, as the model runner asks at start-up
    assert ops.kv_cache_kernels == (torch.int8,)
    rows = torch.randint(-128, 128, (5, 2, 64), dtype=torch.int8)
    k_cache, v_cache = torch.zeros(2, BLOCK, 2, 64,
                                   dtype=torch.int8), torch.zeros(2, BLOCK, 2, 64, dtype=torch.int8)
    slots = torch.tensor([3, -1, 130, 0, 255])
    before = fake.calls["npu_dynamic_quant"]
    ops.store_kvcache(rows, rows, k_cache, v_cache, slots)
    expected = torch.zeros_like(k_cache)
    reference.store_kvcache(rows, rows, expected, expected.clone(), slots)
    assert torch.equal(k_cache, expected) and torch.equal(v_cache, expected)
    assert fake.calls["npu_dynamic_quant"] == before
    assert fake.history[-1] == ("npu_scatter_pa_kv_cache", {"cache_mode": "Norm"})


# ---- attention ----

@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("tnd_paged", [True, False], ids=["tnd", "split"])
def test_int8_attention_matches_the_reference(monkeypatch, tnd_paged, gqa, head_dim, dtype):
    """Decodes at and across block edges, fresh prefills, and a mixed step with chunks after cached
    prefixes: the same whether the release reads TND over a paged cache or not (the int8 path never
    uses TND, §2.10)."""
    fake, ops = loaded(monkeypatch, tnd_paged=tnd_paged)
    scale = head_dim ** -0.5
    for seed, (q_lens, kv_lens) in enumerate(BATCHES):
        batch = make_batch(q_lens, kv_lens, NUM_KV_HEADS * gqa, NUM_KV_HEADS, head_dim, BLOCK,
                           dtype, seed)
        q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens, tables = filled(ops, batch, dtype)
        before = len(fake.history)
        out = ops.quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens,
                                            tables, scale)
        ref = reference.quantized_paged_attention(q.float(), k_cache, v_cache, k_scale, v_scale, cu,
                                                  seq_lens, tables, scale)
        assert out.dtype == dtype and out.shape == q.shape
        assert rel_err_per_seq(out, ref, cu) < TOL[dtype], (q_lens, kv_lens)
        # And the whole path against the reference's own write and read of the same half rows.
        (k_ref, v_ref), (ks_ref, vs_ref) = reference_cache(k_cache.shape[0], NUM_KV_HEADS, head_dim)
        kv_quant_reference.store_quantized_kvcache(batch[1].view(-1, NUM_KV_HEADS, head_dim),
                                                   batch[2].view(-1, NUM_KV_HEADS, head_dim), k_ref,
                                                   v_ref, ks_ref, vs_ref,
                                                   torch.arange(k_cache.shape[0] * BLOCK))
        assert rel_err_per_seq(
            out,
            reference.quantized_paged_attention(q.float(), k_ref, v_ref, ks_ref, vs_ref, cu,
                                                seq_lens, tables, scale), cu) < TOL[dtype]
        calls = [kw for op, kw in fake.history[before:] if op == FIA]
        decodes = [c for c in calls if c.get("key_antiquant_mode") == 5]
        prefills = [c for c in calls if "key_antiquant_mode" not in c]
        assert len(decodes) == (1 in q_lens) and len(prefills) == any(n > 1 for n in q_lens)
        assert all(c["input_layout"] == "BSH" for c in calls)
        # the pool's scales themselves, as FIA's pages: (blocks, kv heads, block size)
        for c in decodes:
            assert c["key_antiquant_scale"] == (k_cache.shape[0], NUM_KV_HEADS, BLOCK)


@pytest.mark.parametrize("dtype", HALF, ids=DTYPE_IDS.get)
def test_a_swapped_scale_or_short_read_fails_the_per_sequence_tolerance(monkeypatch, dtype):
    """Negative controls: the int8 decode reading the longest sequence's first two blocks with
    each other's key scales, or one key short, fails TOL per sequence."""
    _, ops = loaded(monkeypatch)
    batch = make_batch([1] * 4, [1, 40, 129, 1000], 4, NUM_KV_HEADS, 128, BLOCK, dtype)
    q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens, tables = filled(ops, batch, dtype)
    ref = reference.quantized_paged_attention(q.float(), k_cache, v_cache, k_scale, v_scale, cu,
                                              seq_lens, tables, 128 ** -0.5)
    swapped = k_scale.clone()
    first, second = tables[3, :2].long()
    swapped[first], swapped[second] = k_scale[second], k_scale[first]
    out = ops.quantized_paged_attention(q, k_cache, v_cache, swapped, v_scale, cu, seq_lens,
                                        tables, 128 ** -0.5)
    assert rel_err_per_seq(out, ref, cu) > TOL[dtype]
    short = seq_lens - torch.tensor([0, 0, 0, 1], dtype=torch.int32)
    out = ops.quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, short, tables,
                                        128 ** -0.5)
    assert rel_err_per_seq(out, ref, cu) > TOL[dtype]

def test_decode_reads_the_pool_in_place(monkeypatch):
    """The decode call gets the cache and its scales as they lie in the pool, not copies (no bytes
    moved per layer): the same memory the writer filled."""
    fake, ops = loaded(monkeypatch)
    batch = make_batch([1] * 4, [1, 127, 129, 300], 4, NUM_KV_HEADS, 64, BLOCK, torch.float16)
    q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens, tables = filled(ops, batch, torch.float16)
    seen = {}
    fia = fake.npu_fused_infer_attention_score

    def spy(query, key, value, **kwargs):
        seen.update(key=key, kscale=kwargs["key_antiquant_scale"],
                    vscale=kwargs["value_antiquant_scale"])
        return fia(query, key, value, **kwargs)
    monkeypatch.setattr(fake, FIA, spy)
    ops.quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens, tables,
                                  0.125)
    assert seen["key"].data_ptr() == k_cache.data_ptr() and seen["key"].dtype == torch.int8
    assert seen["kscale"].data_ptr() == k_scale.data_ptr() and seen["vscale"].data_ptr(
    ) == v_scale.data_ptr()


def test_int8_limits_are_named(monkeypatch):
    _, ops = loaded(monkeypatch)
    # int8 pages need 32-aligned blocks for a decode (§2.10): 16 serves a half cache, not an int8
    # one.
    batch = make_batch([1, 1], [15, 20], 4, NUM_KV_HEADS, 64, 16, torch.float16)
    args = filled(ops, batch, torch.float16)
    with pytest.raises(ValueError, match="32-aligned"):
        ops.quantized_paged_attention(*args, 0.125)
    # Row scales in another memory order than int8_kv_scales gives: refused, not copied per call.
    batch = make_batch([1, 1], [15, 20], 4, NUM_KV_HEADS, 64, BLOCK, torch.float16)
    q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens, tables = filled(ops, batch, torch.float16)
    with pytest.raises(ValueError, match="int8_kv_scales"):
        ops.quantized_paged_attention(q, k_cache, v_cache, k_scale.contiguous(),
                                      v_scale.contiguous(), cu, seq_lens, tables, 0.125)


def test_a_captured_int8_decode_replays_with_each_steps_lengths(monkeypatch):
    """The int8 decode as an ACL graph task (§5.4): the write and the antiquant FIA call captured,
    the call re-issued before each replay with the step's lengths, the replay equal to the eager
    call."""
    fake, ops = loaded(monkeypatch)
    captured, now = [3, 200, 1], [150, 7, 256]
    batch = make_batch([1, 1, 1], [150, 200, 256], 4, NUM_KV_HEADS, 64, BLOCK, torch.bfloat16,
                       extra_width=0)
    q, k_cache, v_cache, k_scale, v_scale, cu, _, tables = filled(ops, batch, torch.bfloat16)
    seq_lens = torch.tensor(now, dtype=torch.int32)
    new_k = torch.randn(3, NUM_KV_HEADS, 64).bfloat16()
    slots = tables[:, 0].long() * BLOCK + 2  # a row in each sequence's first block
    graph, capture = torch.npu.NPUGraph(), GraphCapture(captured)
    with ops._capturing(capture), torch.npu.graph(graph):
        ops.store_quantized_kvcache(new_k, new_k, k_cache, v_cache, k_scale, v_scale, slots)
        out = ops.quantized_paged_attention(q, k_cache, v_cache, k_scale, v_scale, cu, seq_lens,
                                            tables, 0.125)
    assert len(capture.tasks) == 1 and capture.tasks[0].kwargs["key_antiquant_mode"] == 5
    # the next step's keys, in the graph's buffer
    new_k.copy_(torch.randn(3, NUM_KV_HEADS, 64).bfloat16())
    ops._update_graph_attention(capture, now, torch.npu.Stream())
    graph.replay()
    ref = reference.quantized_paged_attention(q.float(), k_cache, v_cache, k_scale, v_scale, cu,
                                              seq_lens, tables, 0.125)
    assert rel_err_per_seq(out, ref, cu) < TOL[torch.bfloat16]
    rows, row_scale = kv_quant_reference.quantize_rows(new_k, torch.int8, None)
    # the replay wrote the new keys
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, 64)[slots], rows)
    assert torch.equal(k_scale[slots // BLOCK, slots % BLOCK], row_scale)
    assert fake.graph.updates == {"npu_fused_infer_attention_score.out": 1}


# ---- what FIA cannot read: the reference, logged ----

def test_other_compressed_caches_run_the_reference_with_a_warning(monkeypatch, caplog):
    """fp8 (no fp8 pages on Atlas A2/A3) and a half cache under another compute dtype are not in
    kv_cache_kernels: the reference writes and reads them, each op saying so once, and never inside
    a graph capture."""
    _, ops = loaded(monkeypatch)
    assert ops.kv_cache_kernels == (torch.int8,)
    q, k_half, v_half, cu, seq_lens, tables = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, BLOCK,
                                                         torch.bfloat16)
    key = k_half.view(-1, NUM_KV_HEADS, 64)[:10]
    slots = torch.arange(10)
    for cache_dtype in (torch.float8_e4m3fn, torch.float16):
        caches = [torch.zeros(k_half.shape, dtype=cache_dtype) for _ in range(4)]
        scales = [torch.tensor(1.0) for _ in range(4)]
        with caplog.at_level(logging.WARNING, logger="vlinfer"):
            ops.store_quantized_kvcache(key, key, caches[0], caches[1], *scales[:2], slots)
            out = ops.quantized_paged_attention(q, caches[0], caches[1], *scales[:2], cu, seq_lens,
                                                tables, 0.125)
        kv_quant_reference.store_quantized_kvcache(key, key, caches[2], caches[3], *scales[2:],
                                                   slots)
        assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
        assert torch.equal(
            out,
            reference.quantized_paged_attention(q, *caches[2:], *scales[2:], cu, seq_lens, tables,
                                                0.125))
        with pytest.raises(RuntimeError, match="cannot be captured"), \
                ops._capturing(GraphCapture([1])):
            ops.quantized_paged_attention(q[:1], caches[0], caches[1], *scales[:2],
                                          cu[:2].clamp(max=1), seq_lens[:1], tables[:1], 0.125)
    for op in ("store_quantized_kvcache", "quantized_paged_attention"):
        assert (f"{op} on torch.float8_e4m3fn runs the pure-torch reference: "
                "FIA reads int8 KV pages") in caplog.text
    # float32 compute: FIA takes fp16/bf16 queries whatever the cache holds.
    batch = make_batch([1, 3], [9, 3], 4, NUM_KV_HEADS, 64, BLOCK, torch.float32)
    args = filled(ops, batch, torch.float32)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        out = ops.quantized_paged_attention(*args, 0.125)
    assert torch.equal(out, reference.quantized_paged_attention(*args, 0.125))
    assert "quantized_paged_attention on torch.int8 runs the pure-torch reference: the torch_npu " \
           "kernel takes float16 or bfloat16 only" in caplog.text


def test_a_release_failing_the_int8_check_runs_the_reference_with_a_warning(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        fake, ops = loaded(monkeypatch, paged_antiquant=False)
        assert ops.kv_cache_kernels == () and ops.features["int8_kv"] is False
    assert "int8 KV cache check failed (FakeNpuError: key_antiquant_mode 5 (per token and head, " \
           "scales in pages) is not supported by this release): int8 caches are written and read " \
           "by the pure-torch reference" in caplog.text
    batch = make_batch(*BATCHES[2], 4, NUM_KV_HEADS, 64, BLOCK, torch.float16)
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        args = filled(ops, batch, torch.float16)
        out = ops.quantized_paged_attention(*args, 0.125)
        assert torch.equal(out, reference.quantized_paged_attention(*args, 0.125))
        rows = args[1][0, :2].clone()
        ops.store_kvcache(rows, rows, args[1], args[2], torch.tensor([0, 1]))
    for op in ("store_quantized_kvcache", "quantized_paged_attention", "store_kvcache"):
        assert f"{op} on torch.int8 runs the pure-torch reference: this torch_npu failed the " \
               "int8 KV cache check" in caplog.text


# ---- the emulation refuses what the contracts forbid ----

def int8_decode_call(**changes):
    """A valid BSH decode over int8 pages in antiquant mode 5, with changes applied."""
    fake = FakeTorchNpu()
    q, k_half, v_half, cu, seq_lens, tables = make_batch([1, 1, 1], [1, 130, 256], 4, NUM_KV_HEADS,
                                                         64, BLOCK, torch.float16)
    nb = k_half.shape[0]
    rows, scale = kv_quant_reference.quantize_rows(k_half.view(-1, NUM_KV_HEADS, 64), torch.int8,
                                                   None)
    pages = scale.view(nb, BLOCK, NUM_KV_HEADS).transpose(1, 2).contiguous()
    kwargs = dict(actual_seq_lengths_kv=seq_lens.tolist(), block_table=tables, num_heads=4,
                  num_key_value_heads=NUM_KV_HEADS, input_layout="BSH", block_size=BLOCK,
                  scale=0.125, key_antiquant_scale=pages, value_antiquant_scale=pages,
                  key_antiquant_mode=5, value_antiquant_mode=5)
    args = [q.view(3, 1, 256), rows.view(nb, BLOCK, -1), rows.view(nb, BLOCK, -1)]
    kwargs.update(changes)
    for i, name in enumerate(("query", "key", "value")):
        if name in kwargs:
            args[i] = kwargs.pop(name)
    return fake, args, kwargs, (q, rows.view(nb, BLOCK, NUM_KV_HEADS,
                                             64), pages.transpose(1, 2), cu, seq_lens, tables)


def test_valid_int8_decode_call_matches_the_reference():
    fake, args, kwargs, (q, rows, scale, cu, seq_lens, tables) = int8_decode_call()
    out, _ = fake.npu_fused_infer_attention_score(*args, **kwargs)
    ref = reference.quantized_paged_attention(q.float(), rows, rows, scale, scale, cu, seq_lens,
                                              tables, 0.125)
    assert rel_err_per_seq(out.view(q.shape), ref, cu) < TOL[torch.float16]


def _token_major(pages):
    return pages.transpose(1, 2).contiguous().transpose(1, 2)


WRONG_INT8_CALLS = {
    "no-scales": (dict(key_antiquant_scale=None, value_antiquant_scale=None, key_antiquant_mode=0,
                       value_antiquant_mode=0), "need key_antiquant_scale"),
    "modes-differ": (dict(value_antiquant_mode=3), "must match"),
    "tnd": ("tnd", "TND takes no antiquant"),
    "prefill": ("prefill", "Q_S > 1 over a paged cache takes no antiquant"),
    "no-block-table": (dict(block_table=None, actual_seq_lengths_kv=None), "needs the paged cache"),
    "scale-dtype": ("bf16-scale", "float32"),
    "scale-token-major": ("token-major", "not contiguous"),
    "scale-shape": ("per-token", r"\(blocknum, N=2, blocksize\)"),
    "block-size-16": ("bs16", "32-aligned"),
    "half-pages-with-scales": ("half", "antiquant arguments need int8 key/value"),
    "int8-query": ("int8-query", "query must be float16 or bfloat16"),
}


@pytest.mark.parametrize("case", list(WRONG_INT8_CALLS))
def test_int8_emulation_rejects(case):
    change, message = WRONG_INT8_CALLS[case]
    fake, args, kwargs, (q, rows, scale, cu, seq_lens, tables) = int8_decode_call(
        **(change if isinstance(change, dict) else {}))
    pages = kwargs["key_antiquant_scale"]
    if change == "tnd":
        args[0], kwargs["input_layout"], kwargs["actual_seq_lengths"] = q, "TND", [1, 2, 3]
    elif change == "prefill":
        args[0], kwargs["actual_seq_lengths"] = q.view(1, 3, 256), [3]
        kwargs.update(block_table=tables[:1], actual_seq_lengths_kv=[256], sparse_mode=3,
                      atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1))
    elif change == "bf16-scale":
        kwargs["key_antiquant_scale"] = kwargs["value_antiquant_scale"] = pages.bfloat16()
    elif change == "token-major":
        kwargs["key_antiquant_scale"] = kwargs["value_antiquant_scale"] = _token_major(pages)
    elif change == "per-token":
        kwargs["key_antiquant_scale"] = kwargs["value_antiquant_scale"] = pages[:, :1].contiguous()
    elif change == "bs16":
        nb = args[1].shape[0] * 8
        args[1] = args[2] = args[1].reshape(nb, 16, -1)
        kwargs.update(block_size=16, block_table=torch.arange(3 * 16,
                                                              dtype=torch.int32).view(3, 16),
                      key_antiquant_scale=torch.ones(nb, NUM_KV_HEADS, 16),
                      value_antiquant_scale=torch.ones(nb, NUM_KV_HEADS, 16))
    elif change == "half":
        args[1] = args[2] = args[1].half()
    elif change == "int8-query":
        args[0] = args[0].to(torch.int8)
    with pytest.raises(FakeNpuError, match=message):
        fake.npu_fused_infer_attention_score(*args, **kwargs)


def test_int8_scatter_emulation_rejects_mixed_dtypes():
    fake = FakeTorchNpu()
    rows = torch.zeros(4, 2, 64, dtype=torch.int8)
    cache = lambda dtype: torch.zeros(2, BLOCK, 2, 64, dtype=dtype)  # noqa: E731
    fake.npu_scatter_pa_kv_cache(rows, rows, cache(torch.int8), cache(torch.int8), torch.arange(4),
                                 cache_mode="Norm")
    with pytest.raises(FakeNpuError, match="of one dtype"):  # the scatter does not quantize
        fake.npu_scatter_pa_kv_cache(rows.half(), rows.half(), cache(torch.int8), cache(torch.int8),
                                     torch.arange(4), cache_mode="Norm")


# ---- the engine ----

@pytest.fixture(scope="module")
def cpu_int8_logits(qwen3_checkpoint):
    """The CPU engine's prompt logits with an int8 cache (float32 compute), before any fake
    torch_npu."""
    llm = LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=8 << 20, kv_cache_dtype="int8")
    return path_logits(llm, PROMPTS)


def test_engine_int8_float16_matches_the_cpu_engine_and_transformers(  # noqa: F811
        fake_npu, qwen3_checkpoint, cpu_int8_logits, caplog):
    path, model = qwen3_checkpoint
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(path, dtype="float16", kv_cache_dtype="int8", enforce_eager=True, **KW)
    assert llm.engine.ops_implementation == "npu"
    assert "KV cache in torch.int8: npu kernels write it and read it" in caplog.text
    assert "pure-torch reference" not in caplog.text
    runner = llm.engine.model_runner
    pool = runner.cache_pool
    assert pool.kv_cache.dtype == torch.int8
    assert pool.kv_scales[0, 0].transpose(1, 2).is_contiguous()
    for prompt, ours, cpu in zip(PROMPTS, path_logits(llm, PROMPTS), cpu_int8_logits):
        assert relative_gap(ours.float(), cpu) < TOLERANCE["int8"], len(prompt)
        assert relative_gap(ours.float(), reference_logits(model,
                                                           prompt)) < TOLERANCE["int8"], len(prompt)

    # Generation through chunked prefill, prefix-cache hits (the second round) and mixed steps:
    # every greedy token within twice the bound of transformers' arg-max along its sequence
    # (docs/kv-cache.md).
    shared = prompts_of_lengths([140], seed=7)[0]
    prompts = PROMPTS[:4] + [shared + tail for tail in prompts_of_lengths([3, 20], seed=8)]
    llm = LLM(path, dtype="float16", kv_cache_dtype="int8", enforce_eager=True,
              max_num_batched_tokens=64, max_model_len=512, **KW)
    start = len(fake_npu.history)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for round_ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_block_pool_empty(llm)
    assert [o.num_cached_tokens for o in outs][-2:] == [BLOCK, BLOCK]
    for out in outs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        ref = reference_logits(model, tokens)
        for position, token in enumerate(out.outputs[0].token_ids, len(out.prompt_token_ids) - 1):
            assert ref[position].max() - ref[position,
                                             token] <= 2 * TOLERANCE["int8"] * ref.abs().max()
    calls = [kw for op, kw in fake_npu.history[start:] if op == FIA]
    assert any(c.get("key_antiquant_mode") == 5 for c in calls), "no int8 decode call"
    assert any("key_antiquant_mode" not in c and c.get("sparse_mode") == 3
               for c in calls), "no prefill call"
    assert fake_npu.calls["npu_dynamic_quant"] > 0


def test_engine_int8_bfloat16_cache_error_within_the_bound(fake_npu,
                                                           qwen3_checkpoint):  # noqa: F811
    path, _ = qwen3_checkpoint
    auto = path_logits(LLM(path, dtype="bfloat16", enforce_eager=True, **KW), PROMPTS)
    int8 = path_logits(LLM(path, dtype="bfloat16", kv_cache_dtype="int8", enforce_eager=True, **KW),
                       PROMPTS)
    for prompt, ours, full in zip(PROMPTS, int8, auto):
        assert relative_gap(ours.float(), full.float()) < TOLERANCE["int8"], len(prompt)


def test_engine_fp8_cache_runs_the_reference_and_says_so(npu_graphs, qwen3_checkpoint, caplog):
    """A cache dtype FIA cannot read is not refused: as on any op table without its kernels, the
    engine says at start-up that the reference writes and reads it, and runs eager."""
    path, model = qwen3_checkpoint
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(path, dtype="float16", kv_cache_dtype="fp8", **KW)
    assert "KV cache in torch.float8_e4m3fn: npu has no kernel that reads it; its writes and " \
           "attention run the pure-torch reference" in caplog.text
    assert ("graph mode: off, the KV cache in torch.float8_e4m3fn is read by the pure-torch "
            "reference") in caplog.text
    assert llm.engine.model_runner.graphs is None
    for prompt, ours in zip(PROMPTS[:3], path_logits(llm, PROMPTS[:3])):
        assert relative_gap(ours.float(), reference_logits(model, prompt)) < TOLERANCE["fp8"]


@pytest.fixture(scope="module")
def c8_checkpoint(qwen3_checkpoint, tmp_path_factory):
    """The tiny Qwen3 with msModelSlim C8 scales calibrated on its own K and V rows
    (test_kv_cache_schemes)."""
    path, _ = qwen3_checkpoint
    return write_variant(
        path, str(tmp_path_factory.mktemp("npu-c8") / "c8"), c8_scales(kv_rows(path)),
        description={"model_quant_type": "FLOAT", "kv_cache_type": "C8", "version": "1.0.0"})


@pytest.fixture(scope="module")
def cpu_c8_logits(c8_checkpoint):
    return path_logits(LLM(c8_checkpoint, dtype="float32", kv_cache_bytes=8 << 20), PROMPTS)


def test_engine_c8_checkpoint_matches_the_cpu_engine_and_transformers(  # noqa: F811
        fake_npu, qwen3_checkpoint, c8_checkpoint, cpu_c8_logits, caplog):
    """msModelSlim C8: the layer quantizes with the static per-channel scales and offsets, the op
    table scatters the int8 rows and reads them with row scales 1.0 (K's channel scales on the
    query, V's on the output)."""
    _, model = qwen3_checkpoint
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(c8_checkpoint, dtype="float16", enforce_eager=True, **KW)
    assert llm.engine.resolved.kv_cache_dtype == torch.int8
    assert "KV cache in torch.int8 with the checkpoint's static scales" in caplog.text
    assert "pure-torch reference" not in caplog.text
    start = fake_npu.calls["npu_dynamic_quant"]
    for prompt, ours, cpu in zip(PROMPTS, path_logits(llm, PROMPTS), cpu_c8_logits):
        assert relative_gap(ours.float(), cpu) < STATIC_INT8_TOLERANCE, len(prompt)
        assert relative_gap(ours.float(),
                            reference_logits(model, prompt)) < STATIC_INT8_TOLERANCE, len(prompt)
    outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert fake_npu.calls["npu_dynamic_quant"] == start  # static rows: the layer quantized them
    assert any(kw.get("key_antiquant_mode") == 5 for kw in fia_calls(fake_npu))
    assert bool((llm.engine.model_runner.cache_pool.kv_scales == 1).all())
    assert_block_pool_empty(llm)


# ---- ACL graphs over the int8 cache ----

@pytest.fixture
def npu_graphs(monkeypatch):
    fake, _ = loaded(monkeypatch)
    monkeypatch.setattr(NpuOps, "graph_capture", lambda ops, device: npu_graph.backend(device, ops))
    return fake


@pytest.mark.parametrize("kind", ["int8", "c8"])
def test_graph_mode_over_the_int8_cache_equals_eager(npu_graphs, qwen3_checkpoint, c8_checkpoint,
                                                     kind, caplog):
    path = c8_checkpoint if kind == "c8" else qwen3_checkpoint[0]
    kw = dict(dtype="bfloat16", max_num_seqs=6, max_model_len=512, **KW)
    if kind == "int8":
        kw["kv_cache_dtype"] = "int8"
    expected = generate(LLM(path, enforce_eager=True, **kw), GRAPH_PROMPTS)
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(path, **kw)
    assert "graph mode: ACL graphs" in caplog.text and "capture failed" not in caplog.text
    graphs = llm.engine.model_runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 6]
    before = npu_graphs.graph.updates["npu_fused_infer_attention_score.out"]
    assert generate(llm, GRAPH_PROMPTS) == expected
    replays = sum(graphs.replays.values())
    layers = len(llm.engine.model_runner.cache_pool.layers)
    assert replays >= 10
    # Every replay re-issued every layer's int8 decode task (antiquant mode 5) with the step's
    # lengths.
    assert npu_graphs.graph.updates[
        "npu_fused_infer_attention_score.out"] - before == layers * replays
    assert npu_graphs.last["npu_fused_infer_attention_score.out"]["key_antiquant_mode"] == 5
    assert_block_pool_empty(llm)

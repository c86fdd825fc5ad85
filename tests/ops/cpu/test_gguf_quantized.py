"""GGUF Q8_0 / Q4_0 / Q4_1 weights kept in their blocks: our CPU kernels
(vlinfer/ops/cpu/csrc/gguf_blocks.cpp) against the pure-torch reference
(vlinfer/ops/reference/gguf.py) over shapes and every build this CPU runs (generic, AVX2, AVX-512
without and with VNNI); tiny GGUF files of each type, written with the `gguf` package, against
transformers loading the same file (it dequantizes); the real SmolLM2-135M Q4_1 file kept in blocks
against transformers; and quantization="int8" on it.

The op holds the activations as two int8 digits per element, per 32 along K
(gguf_reference.quantize_activations), then takes integer block products. The transformers
references run their linears on the same quantized activations (patched into every nn.Linear, as
tests/layers/quantization/test_quantized.py does for W8A8); the real SmolLM2 is also checked against
plain float activations. Tolerances: float32 results are within float32 rounding noise of a float64
matmul of the quantized activations and the dequantized weights (the kernel's integer block sums are
exact); bfloat16 within bf16 rounding of the reference (both compute in float32 and round the result
once).
"""
import gguf
import numpy as np
import pytest
import torch

from dependencies import SMOLLM2_GGUF, smollm2_dir

from engine_checks import assert_block_pool_empty
from gguf_checkpoints import write_tiny_llama_gguf
from vlinfer import LLM, SamplingParams, platform
from vlinfer.platform import cpu_features
from vlinfer.ops.cpu.gguf import GgufCpuKernels
from vlinfer.ops.reference import gguf as gguf_reference

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3}
THIS_CPU = cpu_features.cpu_isa()
# Every level up to this CPU's best (the engine's build): CI may be AVX2-only, or AVX-512 with VNNI.
# Each is a build of its own, so the levels below this CPU's are in the slow tier (as in
# tests/support/cpu_levels.py).
LEVELS = [pytest.param(level, id=level, marks=() if level == THIS_CPU else pytest.mark.slow)
          for level in cpu_features.CPU_ISAS[:cpu_features.CPU_ISAS.index(THIS_CPU) + 1]]
BUILD_NAMES = {
    "generic": "generic", "avx2": "avx2", "avx512": "avx512", "avx512bf16": "avx512-vnni"
}
# (M, K, N): decode rows, small batches, prefill sizes; N a whole number of 16-row groups, groups
# and tail rows, tail rows only
SHAPES = [(1, 32, 1), (1, 576, 193), (2, 64, 15), (3, 96, 37), (5, 64, 16), (8, 64, 65),
          (9, 160, 31), (77, 96, 129), (600, 64, 67)]


def blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name]).copy())


@pytest.fixture(scope="module", params=LEVELS)
def kernels(request):
    k = GgufCpuKernels(request.param)
    assert k.isa == BUILD_NAMES[request.param]
    return k


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_is_gguf_py_bit_for_bit(kernels, type_name):
    w = blocks(type_name, 37, 96)
    expected = torch.from_numpy(
        gguf.quants.dequantize(w.numpy(), gguf.GGMLQuantizationType[type_name]))
    assert torch.equal(gguf_reference.dequantize(w, TYPES[type_name]), expected)
    assert torch.equal(kernels.dequantize(w, TYPES[type_name]), expected)


@pytest.mark.parametrize("type_name", TYPES)
def test_linear_matches_the_reference(kernels, type_name):
    ggml_type = TYPES[type_name]
    gen = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        w = blocks(type_name, n, k, seed=m + k + n)
        packed = kernels.pack(w, ggml_type)
        assert packed.shape == (n, k // 32, w.shape[1] // (k // 32)) and packed.dtype == torch.uint8
        dense = gguf_reference.dequantize(w, ggml_type)
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        exact = (gguf_reference.quantize_activations(x).double() @ dense.double().T +
                 bias.double()).float()
        got = kernels.linear(x, packed, ggml_type, bias)
        assert got.shape == (m, n) and got.dtype == torch.float32
        err = ((got - exact).abs().max() / exact.abs().max()).item()
        assert err < 2e-6, (m, k, n, err)
        ref = gguf_reference.gguf_linear(x, w, ggml_type, bias)
        assert ((ref - exact).abs().max() / exact.abs().max()).item() < 2e-6
        # the activations' two digits keep the result within ~1e-5 of unquantized x
        unquantized = (x.double() @ dense.double().T + bias.double()).float()
        assert ((got - unquantized).abs().max() / unquantized.abs().max()).item() < 5e-5
        for dtype in (torch.bfloat16, torch.float16):
            xh = x.to(dtype)
            got_half = kernels.linear(xh, packed, ggml_type)
            ref_half = gguf_reference.gguf_linear(xh, w, ggml_type).float()
            assert got_half.dtype == dtype
            assert ((got_half.float() - ref_half).abs().max() /
                    ref_half.abs().max()).item() < 1e-2, (m, k, n)


# (M, K, N) for int8_linear_bf16: 8-row tiles and the rows after them, N as 16-row groups in pairs,
# an odd group count (one group on its own) and tail rows, tail rows only
INT8_BF16_SHAPES = [(1, 32, 16), (8, 64, 32), (9, 96, 48), (17, 160, 70), (100, 64, 56), (3, 32, 5)]


def test_int8_bf16_panels_exist_exactly_at_the_avx512_bf16_level(kernels):
    """bf16 activations against per-channel int8 weights (Q8_0 blocks of d = 1): widened to bf16
    panels, float32 sums, one rounding to bf16; equal to the exact product within that rounding.
    Built only where vdpbf16ps is."""
    # the AVX512-BF16 level's build name
    assert kernels.bf16_panels == (kernels.isa == "avx512-vnni")
    gen = torch.Generator().manual_seed(3)
    for m, k, n in INT8_BF16_SHAPES:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) * 0.02
        packed = kernels.pack(gguf_reference.q8_0_blocks(q), 8)
        x = torch.randn(m, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16()
        if not kernels.bf16_panels:
            with pytest.raises(RuntimeError, match="needs an AVX512-BF16 build"):
                kernels.int8_linear_bf16(x, packed, scale, bias)
            continue
        got = kernels.int8_linear_bf16(x, packed, scale, bias)
        exact = (x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()).float()
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # one bf16 rounding of each output: within half a unit, 2^-8 of itself (float32 sums add
        # ~1e-6)
        assert torch.all((got.float() - exact).abs() <= exact.abs() * 2**-8 +
                         1e-5 * exact.abs().max()), (m, k, n)
        # 3-D input
        assert torch.equal(kernels.int8_linear_bf16(x[None], packed, scale, bias), got[None])
    if kernels.bf16_panels:
        packed = kernels.pack(gguf_reference.q8_0_blocks(torch.ones(16, 64, dtype=torch.int8)), 8)
        with pytest.raises(RuntimeError, match="x must be bfloat16"):
            kernels.int8_linear_bf16(torch.randn(2, 64), packed, torch.ones(16))
        with pytest.raises(RuntimeError, match="row_scale must be float32"):
            kernels.int8_linear_bf16(torch.randn(2, 64).bfloat16(), packed, torch.ones(15))


def test_activation_quantization_rule():
    """Per 32 along K: d = max|x| / 127, x ~ (256 q1 + q2) * d / 256 with q1, q2 int8; an all-zero
    block stays zero. The error is at most half a unit (d / 512) and far below the one-digit rule's
    (d / 2)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None]
    x[2, 32:] = 0
    got = gguf_reference.quantize_activations(x)
    d = x.reshape(3, 2, 32).abs().amax(-1, keepdim=True) / 127
    units = got.reshape(3, 2, 32) / (d / 256)
    units = torch.where(d > 0, units, torch.zeros_like(units))
    assert torch.allclose(units, units.round(), atol=1e-3) and units.abs().max() <= 256 * 127 + 127
    err = (got - x).reshape(3, 2, 32).abs()
    assert torch.all(err <= d / 512 * 1.001 + 1e-30)
    assert err.max() > 0 and torch.all(got[2, 32:] == 0)
    one_digit = torch.round(x.reshape(3, 2, 32) / d) * d  # llama.cpp's single int8
    assert (one_digit - x.reshape(3, 2, 32))[:, 0].abs().max() > 50 * err.max()


def test_bad_blocks_are_refused_naming_the_problem(kernels):
    w = blocks("Q4_1", 4, 64)
    packed = kernels.pack(w, 3)
    with pytest.raises(RuntimeError, match="take ggml types Q4_0"):
        kernels.linear(torch.randn(1, 64), packed, 6)  # Q5_0
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear(torch.randn(1, 96), packed, 3)
    with pytest.raises(RuntimeError, match="packed by gguf_pack"):
        kernels.linear(torch.randn(1, 64), w, 3)  # the file's blocks, not packed
    with pytest.raises(RuntimeError, match="whole 20-byte blocks"):
        kernels.pack(w[:, :30], 3)


# ---- whole models ----

def quantize_linear_inputs(model):
    """The transformers reference with every nn.Linear on the GGUF op's quantized activations (every
    linear of these files, the LM head included, is in Q8_0 / Q4_0 / Q4_1 blocks)."""
    import torch.nn.functional as F
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:
        linear.forward = (lambda lin: lambda x: F.linear(
            gguf_reference.quantize_activations(x).to(x.dtype), lin.weight, lin.bias))(linear)
    assert linears
    return model


@pytest.fixture(scope="module")
def tiny_gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gguf")
    # Q4_0 with its own (untied) LM head in blocks; the others tie it to the embedding.
    return {
        t: write_tiny_llama_gguf(str(folder / f"tiny-{t}.gguf"), t, seed=i, tie_embeddings=t
                                 != "Q4_0")
        for i, t in enumerate(TYPES)
    }


@pytest.mark.parametrize("type_name", TYPES)
def test_tiny_gguf_kept_in_blocks_matches_transformers(tiny_gguf_files, type_name):
    import os

    from transformers import AutoModelForCausalLM
    path = tiny_gguf_files[type_name]
    llm = LLM(path, dtype="float32", kv_cache_bytes=8 * 2 ** 20, max_model_len=256)
    model = llm.engine.model_runner.model
    weights = dict(model.named_parameters())
    assert weights["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.uint8
    assert weights["model.layers.1.mlp.down_proj.weight"].dtype == torch.uint8
    assert model.model.embed_tokens.weight.dtype == torch.uint8 \
        and model.lm_head.gguf_type == TYPES[type_name]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (type_name != "Q4_0")
    # linears and the LM head run the kernel on their packed groups; embedding lookups read the
    # file's rows
    assert weights["model.layers.0.self_attn.qkv_proj.weight"].dim() == 3
    head = model.lm_head.packed_weight if type_name != "Q4_0" else model.lm_head.weight
    assert head.dim() == 3 and model.model.embed_tokens.weight.dim() == 2
    ref = quantize_linear_inputs(AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32))
    # a short prompt and a longer prefill
    prompts = [[5, 17, 99, 200, 3, 44, 120], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                                    do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected, type_name
    assert_block_pool_empty(llm)


def test_an_engine_indexes_a_gguf_file_once_through_the_array_reader(tiny_gguf_files, monkeypatch):
    """A GGUF header takes seconds to parse (SmolLM2's vocabulary): a build indexes the file once
    and hands the index on, and vlinfer's own reads (the index, the weights) see the file as a plain
    ndarray, not np.memmap, whose Python-level slicing made every header field's read 3x slower."""
    import numpy as np

    from vlinfer import loading
    from vlinfer.loading import gguf as gguf_loading
    indexed, readers = [], []
    index, array_reader = loading.checkpoint_tensor_index, gguf_loading._array_reader
    monkeypatch.setattr(loading, "checkpoint_tensor_index",
                        lambda *a: indexed.append(a) or index(*a))
    monkeypatch.setattr(gguf_loading, "_array_reader",
                        lambda path: readers.append(array_reader(path)) or readers[-1])
    LLM(tiny_gguf_files["Q8_0"], dtype="float32", kv_cache_bytes=8 * 2 ** 20, max_model_len=256)
    assert len(indexed) == 1, "the tensor index was built more than once"
    assert len(readers) == 2  # the index's read and the weights'
    assert all(type(reader.data) is np.ndarray for reader in readers)
    assert all(type(tensor.data) is not np.memmap for tensor in readers[0].tensors)


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colours."}],
]


@pytest.mark.slow  # the real SmolLM2 and transformers, twice
def test_smollm2_q4_1_kept_in_blocks_matches_transformers():
    """The real file: 120 Q4_1 linears and the Q8_0 embedding / tied LM head stay in blocks (about
    96 MB against 538 MB of float32), and greedy decoding gives transformers' tokens on the
    dequantized weights, both with the op's quantized activations and with plain float ones."""
    from transformers import AutoModelForCausalLM
    llm = LLM("smollm2", dtype="float32", kv_cache_bytes=64 * 2 ** 20, max_model_len=512)
    model = llm.engine.model_runner.model
    block_params = [p for p in model.parameters() if p.dtype == torch.uint8]
    assert len(block_params) == 30 * 4 + 1  # qkv, o, gate_up, down per layer + the embedding table
    assert sum(p.dim() == 3
               for p in block_params) == 30 * 4 and model.lm_head.packed_weight.dim() == 3
    assert llm.engine.model_context.ops.gguf_kernels is not None
    plain = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF,
                                                 dtype=torch.float32)
    quantized = quantize_linear_inputs(
        AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF,
                                             dtype=torch.float32))
    tok = llm.tokenizer
    outs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    for chat, out in zip(CHATS, outs):
        prompt = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
        # the op's activations, and plain float ones: the two digits keep even these near ties
        for ref in (quantized, plain):
            with torch.no_grad():
                expected = ref.generate(torch.tensor([prompt]), max_new_tokens=48,
                                        do_sample=False)[0, len(prompt):]
            assert out.outputs[0].token_ids == expected.tolist(), (out.outputs[0].text,
                                                                   tok.decode(expected))
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow  # the real SmolLM2 and transformers, twice
def test_smollm2_int8_on_load_answers_sensibly():
    """quantization="int8": the GGUF is dequantized on load, then every linear is quantized to int8
    per channel."""
    llm = LLM("smollm2", dtype="float32", quantization="int8", kv_cache_bytes=64 * 2**20,
              max_model_len=512)
    model = llm.engine.model_runner.model
    assert not any(p.dtype == torch.uint8 for p in model.parameters())
    out = llm.chat([CHATS[0]], SamplingParams(temperature=0, max_tokens=24),
                   use_tqdm=False)[0].outputs[0].text
    print(f"\nSmolLM2-135M int8 on load: {CHATS[0][0]['content']!r} -> {out!r}")
    assert "Paris" in out

"""A dense decoder layer's decode step in one op call (vlinfer/ops/cpu/csrc/decode_layer.cpp,
CpuOps.dense_decode_layer): taken where this CPU runs the layer's projections on panels, and then
bit for bit the layer its modules run."""
import logging

import pytest
import torch

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, SamplingParams, platform
from vlinfer.platform import cpu_features
from vlinfer.platform.cpu_features import CPU_ISAS
from vlinfer.ops.cpu import int8_panels
from vlinfer.ops.cpu import panels as cpu_panels
from vlinfer.ops.cpu import CpuOps

# three lengths: mixed and decode-only steps
PROMPTS = [[5, 17, 33, 9], list(range(40, 77)), [300, 301]]


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """A tiny Llama with biases on every projection (attention_bias, mlp_bias): the fused op's bias
    epilogues."""
    config = tiny_text_config("llama", False)
    config.attention_bias = config.mlp_bias = True
    path = tmp_path_factory.mktemp("llama-biased")
    build_checkpoint(str(path), config, seed=3)
    return str(path)


def run(folder, dtype, fused: bool, monkeypatch, kv_cache_dtype="auto", quantization=None):
    """Greedy tokens and their top-5 logprobs, the decoder, and how many decode steps ran the fused
    stack (fusion switched off on request). Chunks of 16 tokens: steps with prefill rows take the
    modules, decode-only steps the fused stack."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(CpuOps, "dense_decode_stack", lambda self, layers, **attention: None)
        llm = LLM(folder, dtype=dtype, kv_cache_bytes=1 << 22, max_num_batched_tokens=16,
                  kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    decoder = llm.engine.model_runner.model.model
    calls = []
    if decoder.decode_stack is not None:
        stack = decoder.decode_stack
        decoder.decode_stack = CountingStack(stack, calls)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.close()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(calls), decoder


class CountingStack:
    def __init__(self, stack, calls):
        self.stack, self.calls = stack, calls

    def forward(self, *args):
        self.calls.append(1)
        return self.stack.forward(*args)


def this_cpu_fuses(dtype) -> bool:
    """Panels for this dtype on this CPU (float32 on AVX-512, bf16 on AVX512-BF16 without AMX): the
    fused op."""
    return dtype in CpuOps().panel_dtypes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_layers_equal_the_modules(tiny_checkpoint, biased_llama, dtype, monkeypatch,
                                               caplog):
    """Llama (untied / tied, GQA / MQA, biased) and Qwen3 (q/k norms): the same greedy tokens and
    the same top-5 logprobs, bit for bit, with the decode layers fused and run module by module; the
    fused op runs exactly where this CPU's kernels take panels, and the start-up log says how many
    layers it fuses."""
    for folder in (tiny_checkpoint[0], biased_llama):
        with caplog.at_level(logging.INFO, logger="vlinfer"):
            caplog.clear()
            fused, calls, decoder = run(folder, dtype, True, monkeypatch)
        modules, no_calls, unfused = run(folder, dtype, False, monkeypatch)
        assert fused == modules
        assert no_calls == 0 and unfused.decode_stack is None
        if this_cpu_fuses(getattr(torch, dtype)):
            assert decoder.decode_stack.stack.num_layers == 2
            assert ("decode steps run all 2 decoder layers in one op call (cpu-compiled)"
                    in caplog.text)
            assert calls >= 15  # the decode-only steps: at least the last request's last 15 tokens
        else:
            assert decoder.decode_stack is None and calls == 0
            assert ("decode steps run the 2 decoder layers module by module (cpu-compiled has no "
                    "fused form") in caplog.text
    if not this_cpu_fuses(getattr(torch, dtype)):  # both runs were the modules: nothing compared
        feature = "AVX-512" if dtype == "float32" else "AVX512-BF16 without AMX"
        pytest.skip(f"needs {feature}: no fused {dtype} decode op on this CPU")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_over_a_compressed_cache_equals_the_modules(tiny_checkpoint, dtype,
                                                                 kv_cache_dtype, monkeypatch):
    """A KV cache stored in another dtype (kv_cache_dtype): the fused stack runs the quantizing
    write and the decode kernel over the stored rows with each layer's scales, bit for bit the
    modules' tokens and top-5 logprobs. A stack handed another layer's int8 scales is not."""
    if not this_cpu_fuses(getattr(torch, dtype)):
        feature = "AVX-512" if dtype == "float32" else "AVX512-BF16 without AMX"
        pytest.skip(f"needs {feature}: no fused {dtype} decode op on this CPU")
    folder = tiny_checkpoint[0]
    fused, calls, decoder = run(folder, dtype, True, monkeypatch, kv_cache_dtype)
    modules, no_calls, _ = run(folder, dtype, False, monkeypatch, kv_cache_dtype)
    assert decoder.decode_stack is not None and calls >= 15 and no_calls == 0
    assert fused == modules
    if kv_cache_dtype != "int8":  # fp8's scales are 1.0 in every layer: nothing to misread
        return
    # planted: every layer reads the first layer's int8 row scales
    monkeypatch.setattr(CountingStack, "forward", lambda self, *args: self.stack.forward(
        *args[:8], [args[8][0]] * len(args[8]), [args[9][0]] * len(args[9])))
    planted, _, _ = run(folder, dtype, True, monkeypatch, kv_cache_dtype)
    assert [lp for _, lp in planted] != [lp for _, lp in modules]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_with_int8_weights_equals_the_modules(tiny_checkpoint, dtype, monkeypatch,
                                                           caplog):
    """int8 weights on load (W8A16 on the VNNI panels): the fused stack calls the op's kernel
    (int8_vnni_linear, the same row rule) per projection, so bit for bit the int8 modules' tokens
    and top-5 logprobs, and the start-up log says the layers fused. A stack whose layers read
    the first layer's channel scales is not."""
    if not this_cpu_fuses(getattr(torch, dtype)):
        feature = "AVX-512" if dtype == "float32" else "AVX512-BF16 without AMX"
        pytest.skip(f"needs {feature}: no fused {dtype} decode op on this CPU")
    if not CpuOps().ext.int8_vnni_available():
        pytest.skip("needs AVX512-VNNI (and its build): no int8 VNNI panels on this CPU")
    folder = tiny_checkpoint[0]
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        fused, calls, decoder = run(folder, dtype, True, monkeypatch, quantization="int8")
    assert "decode steps run all 2 decoder layers in one op call (cpu-compiled)" in caplog.text
    assert decoder.decode_stack.stack.num_layers == 2 and calls >= 15
    modules, no_calls, unfused = run(folder, dtype, False, monkeypatch, quantization="int8")
    assert no_calls == 0 and unfused.decode_stack is None
    assert fused == modules
    # planted: every layer's projection reads the first layer's channel scales of its shape
    first, decode_kernel = {}, int8_panels.decode_kernel

    def first_layers_scales(weight):
        kernel = decode_kernel(weight)
        shape = tuple(kernel["weight"].shape)
        return dict(kernel, scale=first.setdefault(shape, kernel["scale"]))

    monkeypatch.setattr(int8_panels, "decode_kernel", first_layers_scales)
    planted, planted_calls, _ = run(folder, dtype, True, monkeypatch, quantization="int8")
    assert planted_calls >= 15
    assert [lp for _, lp in planted] != [lp for _, lp in modules]


def test_int8_weights_without_vnni_panels_decode_module_by_module(qwen3_checkpoint, monkeypatch,
                                                                  caplog):
    """A build without the VNNI panels (AVX2, plain AVX-512; mocked) runs int8 layers on the GGUF
    block kernel, which the stack does not call: the modules run, and the log says why."""
    ext = CpuOps().ext
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="vlinfer"):
        m.setattr(ext, "int8_vnni_available", lambda: False)
        outs, calls, decoder = run(qwen3_checkpoint[0], "float32", True, monkeypatch,
                                   quantization="int8")
    assert calls == 0 and decoder.decode_stack is None
    assert ("the fused decode layers take int8 weights on the VNNI panels only; these layers' "
            "int8 weights run the GGUF block kernel") in caplog.text
    assert "decode steps run the 2 decoder layers module by module" in caplog.text
    assert all(len(tokens) == 20 for tokens, _ in outs)


# The level a CPU without AVX-512 runs: AVX2 where this CPU has it (this CPU's own build on an AVX2
# machine; one more build, so the slow tier, above it), else the generic one.
WITHOUT_AVX512 = "avx2" if CPU_ISAS.index(
    cpu_features.cpu_isa()) >= CPU_ISAS.index("avx2") else "generic"
FLAGS = {"avx2": frozenset({"sse2", "avx", "avx2", "fma", "f16c"}), "generic": frozenset({"sse2"})}


@pytest.mark.parametrize("level", [
    pytest.param(WITHOUT_AVX512,
                 marks=() if WITHOUT_AVX512 == cpu_features.cpu_isa() else pytest.mark.slow)
])
def test_without_avx512_the_modules_run(qwen3_checkpoint, monkeypatch, caplog, level):
    """A CPU without AVX-512 has no panels, so no fused layer: the modules run, logged, and the
    greedy tokens are the fused AVX-512 engine's (float32). Flags mocked down to AVX2 (or the
    generic level, which has no panels either: test_cpu_kernels.py _expected_layout)."""
    folder = qwen3_checkpoint[0]
    reference, _, _ = run(folder, "float32", True, monkeypatch)
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="vlinfer"):
        m.setattr(cpu_features, "cpu_flags", lambda: FLAGS[level])
        assert cpu_features.cpu_isa() == level
        outs, calls, decoder = run(folder, "float32", True, monkeypatch)
    assert calls == 0 and decoder.decode_stack is None
    assert ("decode steps run the 2 decoder layers module by module (cpu-compiled has no fused form"
            in caplog.text)
    assert [tokens for tokens, _ in outs] == [tokens for tokens, _ in reference]


def test_fused_stack_refuses_a_prefill_row(cpu_ops):
    """The stack serves one query token per sequence, one cache pair per layer: anything else is
    refused by name rather than read as decode rows."""
    panels = cpu_panels.to_panels(torch.randn(64, 64))
    stack = cpu_ops.ext.DenseDecodeStack(num_heads=2, num_kv_heads=1, head_dim=16, scale=0.25,
                                         eps=1e-6, qk_eps=0.0)
    stack.add_layer(input_norm=torch.ones(64), post_norm=torch.ones(64), qkv=panels, qkv_bias=None,
                    q_norm=None, k_norm=None, o=panels, o_bias=None, gate_up=panels,
                    gate_up_bias=None, down=panels, down_bias=None)
    cache = torch.zeros(4, 16, 1, 16)
    step = (torch.zeros(3, dtype=torch.long), torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="one query token per sequence: 3 rows for 2 sequences"):
        stack.forward(torch.randn(3, 64), torch.ones(3, 16), torch.zeros(3, 16), [cache], [cache],
                      *step)
    with pytest.raises(RuntimeError, match="1 layers, 2 key and 2 value caches"):
        stack.forward(torch.randn(2, 64), torch.ones(2, 16), torch.zeros(2, 16), [cache] * 2,
                      [cache] * 2, step[0][:2], *step[1:])

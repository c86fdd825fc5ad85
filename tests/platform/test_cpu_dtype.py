"""dtype="auto" and the kernel level on each class of x86 CPU, with the CPU's flags mocked: a bf16
checkpoint computes in bf16 only where the CPU has native bf16 (AVX512-BF16 or AMX-BF16), float32
elsewhere (an AVX2-only EPYC runs torch's bf16 matmul at 0.3 GFLOP/s against 140 in float32), logged
once; an explicit dtype is obeyed."""
import json
import logging

import pytest
import torch
from transformers import Qwen3Config

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, platform
from vlinfer.platform import cpu_features

BASE = {"sse2", "sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = BASE | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
CPUS = {  # flags as /proc/cpuinfo names them -> (kernel level, bf16 native, fp16 native)
    "avx2-only (AMD EPYC Zen 2/3)": (BASE, "avx2", False, False),
    "avx512 without bf16 (Skylake-SP)": (AVX512, "avx512", False, False),
    "avx512-bf16 (AMD EPYC Zen 4)": (AVX512 | {"avx512_vnni", "avx512_bf16"}, "avx512bf16", True,
                                     False),
    "amx (Sapphire / Emerald Rapids)": (AVX512 | {"avx512_vnni", "avx512_bf16", "avx512_fp16",
                                                  "amx_tile", "amx_bf16", "amx_int8"},
                                        "avx512bf16", True, True),
    "no x86 flags (another architecture)": (set(), "generic", False, False),
}


def _config(dtype: str):
    return Qwen3Config(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=8, intermediate_size=32, dtype=dtype)


@pytest.mark.parametrize("cpu", list(CPUS))
def test_auto_dtype_and_kernel_level_per_cpu_class(cpu, monkeypatch, caplog):
    flags, level, bf16, fp16 = CPUS[cpu]
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    assert cpu_features.cpu_isa() == level
    cpu_device = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        chosen = platform.resolve_dtype("auto", _config("bfloat16"), cpu_device)
    assert chosen == (torch.bfloat16 if bf16 else torch.float32)
    if bf16:
        assert "dtype: bfloat16, the checkpoint's" in caplog.text
    else:
        assert f"dtype: float32, this CPU has no native bfloat16 ({level})" in caplog.text
    assert platform.resolve_dtype("auto", _config("float16"),
                                  cpu_device) == (torch.float16 if fp16 else torch.float32)
    # float32 checkpoints stay float32; an explicit dtype is always obeyed, whatever the CPU.
    assert platform.resolve_dtype("auto", _config("float32"), cpu_device) == torch.float32
    assert platform.resolve_dtype("bfloat16", _config("float32"), cpu_device) == torch.bfloat16
    assert platform.resolve_dtype(torch.bfloat16, _config("float32"), cpu_device) == torch.bfloat16
    # Accelerators take the checkpoint's dtype: the rule is about this CPU's arithmetic.
    assert platform.resolve_dtype("auto", _config("bfloat16"),
                                  torch.device("cuda")) == torch.bfloat16


def test_cpu_flags_reads_this_machine():
    flags = cpu_features.cpu_flags()
    with open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith("flags")), None)
    assert flags == (frozenset(line.split(":", 1)[1].split()) if line else frozenset())


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16-ckpt")
    build_checkpoint(str(path), tiny_text_config("qwen3", True))
    # Declared bf16, as hub checkpoints are (the float32 tensors are converted on load like any
    # others).
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("has_bf16", [False, True], ids=["avx2-only", "avx512-bf16"])
def test_engine_on_a_bf16_checkpoint_follows_the_cpu(bf16_checkpoint, has_bf16, monkeypatch,
                                                     caplog):
    """The engine's KV pool and weights take the chosen dtype; the log names the reason once. The
    reference ops keep the test from compiling another kernel level for the mocked CPU."""
    flags = BASE | ({"avx512_bf16"} if has_bf16 else set())
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    with caplog.at_level(logging.INFO, logger="vlinfer"):
        llm = LLM(bf16_checkpoint, kv_cache_bytes=1 << 20, ops="reference")
    expected = torch.bfloat16 if has_bf16 else torch.float32
    assert llm.engine.dtype == expected
    assert llm.engine.model_runner.cache_pool.kv_cache.dtype == expected
    assert llm.engine.model_runner.model.lm_head.weight.dtype == expected
    assert caplog.text.count("dtype: ") == 1
    # An explicit dtype wins over the CPU rule.
    explicit = LLM(bf16_checkpoint, kv_cache_bytes=1 << 20, ops="reference", dtype="bfloat16")
    assert explicit.engine.dtype == torch.bfloat16

"""A hybrid model (Qwen3.5 text: Gated DeltaNet layers beside gated full attention) through the
whole engine on the NPU code path (VLINFER_OPS=npu) on CPU tensors, torch_npu emulated by
tests/fakes/fake_torch_npu.py and fake_torch_npu_gdn.py, block size 128, against transformers.

float32: torch_npu's Gated DeltaNet ops take bf16 only (docs/npu-ops.md §2.12, §2.13), so the delta
rule runs the reference, as the causal conv1d always does (no op fits, §2.14), both logged, beside
the NPU norms and rotary: greedy tokens equal transformers' and every generated token's logprob
within 1e-4. bfloat16 with mamba_ssm_cache_dtype=bfloat16: decode steps on
npu_recurrent_gated_delta_rule and prefill chunks (mixed with decodes under a 64-token budget) on
npu_chunk_gated_delta_rule, in place on a value-major state pool; each generated token within the
documented BF16_LOGIT_TOLERANCE of transformers' best logit (bf16, same prefix), and every
prompt's token logprobs within HYBRID_BF16_LOGPROB of transformers' float32 on the same bf16
weights (the stated bound, docs/npu-ops.md §2.13)."""
import copy
import logging
import math

import pytest
import torch

from engine_checks import assert_block_pool_empty
from fake_torch_npu import fake_npu  # noqa: F401  (fixture)
from npu_engine_cases import assert_tokens_within_tolerance
from qwen3_5_text_cases import save, text_config
from vlinfer import LLM, SamplingParams
from vlinfer.ops.npu import linear_attention as npu_la
from vlinfer.platform.device import holds_dtype
from vlinfer.toy.tiny_checkpoints import _rescale

NUM_NEW = 8
BLOCK = 128
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0)
# Lengths below, at and across the 128-token block; the 64-token budget chunks the longer ones.
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (5, 37, 1, 130)]
# The stated bound of the bf16 path: the largest prompt-token logprob gap to transformers' float32
# (bf16 weights, activations and state), set from transformers' own bf16 gap on these prompts and
# the reference table's in bf16 (the same size: bf16 arithmetic, not the ops); npu-ops.md §2.13.
HYBRID_BF16_LOGPROB = 0.3
# Decays e^g with g in [-1, 0], the range npu_chunk_gated_delta_rule takes (§2.13): A_log set so
# that -e^A_log softplus(a + dt_bias) stays above -1 for these activations.
A_LOG = math.log(0.05)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(folder, transformers model in float32, its greedy tokens and their logprobs)."""
    from transformers import Qwen3_5ForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = Qwen3_5ForCausalLM(text_config()).eval()
    _rescale(model, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(A_LOG)
    folder = save(model, str(tmp_path_factory.mktemp("npu-qwen3_5")))
    model.generation_config.eos_token_id = None
    refs = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=NUM_NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        steps = torch.cat(out.logits).float().log_softmax(-1)
        refs.append((tokens, steps[range(NUM_NEW), tokens]))
    return folder, model, refs


def make_llm(folder, **kw):
    return LLM(folder, kvcache_block_size=BLOCK, kv_cache_bytes=8 * 2**20, max_model_len=256,
               max_num_seqs=8, **kw)


def test_hybrid_float32_greedy_equals_transformers(fake_npu, hybrid, caplog):  # noqa: F811
    folder, _, refs = hybrid
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = make_llm(folder, dtype="float32")
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.engine.ops_implementation == "npu"
    for out, (tokens, logprobs) in zip(outs, refs):
        assert out.outputs[0].token_ids == tokens
        ours = torch.tensor([d[t].logprob for d, t in zip(out.outputs[0].logprobs, tokens)])
        assert (ours - logprobs).abs().max().item() < 1e-4
    for op in ("gated_delta_rule (prefill)", "gated_delta_rule (decode)", "causal_conv1d"):
        assert f"{op} on torch.float32 runs the pure-torch reference" in caplog.text, op
    assert "recurrent state in float32" in caplog.text  # the cache pool's load-time line
    assert fake_npu.calls[npu_la.RECURRENT] == fake_npu.calls[npu_la.CHUNK] == 0
    for op in ("npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu"):
        assert fake_npu.calls[op] > 0, op
    assert_block_pool_empty(llm)


def test_hybrid_bfloat16_on_the_gated_delta_rule_ops(fake_npu, hybrid, caplog):  # noqa: F811
    if not holds_dtype(torch.bfloat16, torch.device("cpu")):
        pytest.skip("a bf16 state on a CPU needs AVX512-BF16 or AMX (platform.holds_dtype)")
    folder, model, _ = hybrid
    lengths, chunk = [], fake_npu.npu_chunk_gated_delta_rule

    def recorded(*args, **kw):  # each chunk call's sequence lengths
        lengths.append(kw["actual_seq_lengths"].tolist())
        return chunk(*args, **kw)
    fake_npu.npu_chunk_gated_delta_rule = recorded
    with caplog.at_level(logging.WARNING, logger="vlinfer"):
        llm = make_llm(folder, dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16",
                       max_num_batched_tokens=64)
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert "gated_delta_rule (" not in caplog.text  # no call fell back
    conv, recurrent = llm.engine.model_runner.cache_pool.state_tensors[0]
    assert recurrent.dtype == torch.bfloat16 and recurrent.transpose(-1, -2).is_contiguous()
    assert fake_npu.calls[npu_la.RECURRENT] > 0 and fake_npu.calls[npu_la.CHUNK] > 0
    assert any(1 in n and max(n) > 1 for n in lengths), "no chunk call mixing decodes and prefill"
    ref_bf16 = type(model).from_pretrained(folder, dtype=torch.bfloat16).eval()
    rounded = copy.deepcopy(ref_bf16).float()  # float32 on the weights we run
    gaps = []
    for prompt, out in zip(PROMPTS, outs):
        assert_tokens_within_tolerance(ref_bf16, prompt, out.outputs[0].token_ids)
        if len(prompt) > 1:
            with torch.no_grad():
                want = rounded(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
            want = want[range(len(prompt) - 1), prompt[1:]]
            ours = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:],
                                                               prompt[1:])])
            gaps.append((ours - want).abs().max().item())
    print(f"bf16 hybrid on the NPU ops: prompt logprob gap per sequence "
          f"{[f'{g:.2e}' for g in gaps]}")
    assert 0 < max(gaps) < HYBRID_BF16_LOGPROB
    assert_block_pool_empty(llm)

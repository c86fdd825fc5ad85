"""Builders and constants of tests/layers/quantization/test_quantized.py that other test modules use
too (NEW_TOKENS, PROMPT, _methods, _per_token, _reference_tokens, _vlinfer_tokens, greedy_tokens):
imported from here by every one of them, that module included."""
import torch
import torch.nn.functional as F
from vlinfer import LLM, SamplingParams

PROMPT = [3, 17, 92, 44, 5, 8, 250, 31]
NEW_TOKENS = 8


def _reference_tokens(dense_path: str, dequantized: dict, activations=None,
                      vl: bool = False) -> list[int]:
    """Greedy tokens of transformers on the dense model with `dequantized` weights substituted.
    activations: {module name: fn(x) -> x as the quantized op sees it} (W8A8's activation
    quantization)."""
    from transformers import AutoModelForCausalLM, Qwen3VLForConditionalGeneration
    cls = Qwen3VLForConditionalGeneration if vl else AutoModelForCausalLM
    model = cls.from_pretrained(dense_path, dtype=torch.float32).eval()
    missing = set(dequantized) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(dequantized, strict=False)
    return greedy_tokens(model, activations)


def greedy_tokens(model, activations=None) -> list[int]:
    """transformers' greedy NEW_TOKENS after PROMPT, its linears named in activations fed
    fn(x) (the quantized op's view of their inputs)."""
    for name, fn in (activations or {}).items():
        linear = model.get_submodule(name)
        linear.forward = (lambda lin, f: lambda x: F.linear(f(x), lin.weight, lin.bias))(linear, fn)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, len(PROMPT):].tolist()


def _vlinfer_tokens(path: str, **options) -> tuple[list[int], LLM]:
    llm = LLM(path, dtype="float32", kv_cache_bytes=4 << 20, **options)
    out = llm.generate([PROMPT],
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids, llm


def _per_token(x):
    """W8A8 dynamic activations as the format's runtime defines them (compressed-tensors'
    `dynamic: true, strategy: token` as vLLM's scaled_int8_quant runs it): per token, scale =
    max |x| / 127, x / scale rounded half to even and saturated to [-128, 127]. Written here, not
    imported from ops/reference/quant.py (the code under test)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    scale = rows.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(rows / torch.where(scale > 0, scale, 1.0)).clamp(-128, 127)
    return (codes * scale).reshape(x.shape)


def _methods(llm) -> set[str]:
    from vlinfer.layers.linear import LinearBase
    return {m.method.describe() if m.method is not None else "dense"
            for m in llm.engine.model_runner.model.modules() if isinstance(m, LinearBase)}

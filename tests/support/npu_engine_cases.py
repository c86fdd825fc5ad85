"""Checks of tests/ops/npu/test_npu_engine.py that other test modules use too
(assert_tokens_within_tolerance, IMAGE_TOKEN): imported from here by every one of them."""
import torch

from text_parity_cases import BF16_LOGIT_TOLERANCE

IMAGE_TOKEN = 151655


def assert_tokens_within_tolerance(ref_model, prompt_ids, tokens, **inputs):
    """Each generated token's transformers logit (same prefix, one forward) within the tolerance of
    the best one."""
    ids = torch.tensor([prompt_ids + tokens])
    if "pixel_values" in inputs:
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    with torch.no_grad():
        logits = ref_model(input_ids=ids, **inputs).logits[0, len(prompt_ids) - 1:-1].float()
    best = logits.max(-1).values
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    gap = ((best - chosen) / logits.abs().max()).max().item()
    assert gap <= BF16_LOGIT_TOLERANCE, (gap, tokens)

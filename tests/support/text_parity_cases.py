"""Builders and constants of tests/models/test_text_parity.py that other test modules use too
(BF16_LOGIT_TOLERANCE, PROMPTS, prompts_of_lengths, reference_greedy): imported from here by
every one of them, that module included."""
import random

import torch

NUM_NEW = 32


def prompts_of_lengths(lengths, seed=0, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# 8 prompts, lengths crossing block edges
PROMPTS = prompts_of_lengths([1, 5, 16, 17, 31, 48, 70, 129])


def reference_greedy(model, prompt, num_new=NUM_NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# bfloat16 tolerance, documented in the README: prompt logits within 3e-2 of the largest |logit| of
# transformers in bfloat16 on the same weights, and the same arg-max at >= 95% of positions. (Both
# round differently: we rotate q/k and normalize in float32, transformers partly in bfloat16.)
BF16_LOGIT_TOLERANCE = 3e-2

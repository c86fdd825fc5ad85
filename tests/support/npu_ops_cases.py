"""Builders and constants of tests/ops/npu/test_npu_ops.py that other test modules use too (BATCHES,
DTYPE_IDS, HALF, NUM_KV_HEADS, TOL): imported from here by every one of them, that module
included."""
import torch

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}
HALF = [torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
NUM_KV_HEADS = 2
# (q_lens, kv_lens) with block size 128: decodes at and across block edges; fresh prefills; and a
# mixed batch of a fresh prefill, decodes, a prefill crossing a block edge, a chunk after a
# 260-token cached prefix and a 3-token prefix hit on one full block.
BATCHES = [([1] * 6, [1, 127, 128, 129, 256, 300]),
           ([5, 128, 129], [5, 128, 129]),
           ([7, 1, 130, 1, 40, 3], [7, 200, 130, 129, 300, 131])]

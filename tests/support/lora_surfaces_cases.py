"""Builders and constants of tests/test_lora_surfaces.py that other test modules use too (ATTENTION,
EVERY_LINEAR, make_vl_adapter): imported from here by every one of them, that module included."""
import pytest
import torch
from lora_cases import make_adapter

# The language model's attention only: peft must not reach the vision tower's linears.
ATTENTION = r".*language_model.*\.(q_proj|v_proj)"
EVERY_LINEAR = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def make_vl_adapter(checkpoint: str, folder: str, rank: int, targets: str, seed: int) -> str:
    """A PEFT adapter (random non-zero B: it changes the answers) on a Qwen3-VL checkpoint's
    language model."""
    from transformers import Qwen3VLForConditionalGeneration
    base = Qwen3VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    return make_adapter(base, folder, rank, 2 * rank, False, targets, seed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
    return build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("vl")), seed=0,
                               tie_word_embeddings=False)

"""Qwen3 dense: the Llama decoder with RMSNorm on each head's q and k."""
from vlinfer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

"""Model building blocks. Linear and embedding layers load their own tensor-parallel shard; attention reads
per-step metadata from the forward context the model runner sets."""
from vlinfer.layers.activation import SiluAndMul
from vlinfer.layers.attention import Attention
from vlinfer.layers.context import ForwardContext, forward_context, get_forward_context
from vlinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlinfer.layers.layernorm import RMSNorm
from vlinfer.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                   ReplicatedLinear, RowParallelLinear, default_weight_loader)
from vlinfer.layers.rotary import RotaryEmbedding, rope_inv_freq
from vlinfer.layers.sampler import sample

__all__ = ["Attention", "ColumnParallelLinear", "ForwardContext", "MergedColumnParallelLinear", "ParallelLMHead",
           "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "VocabParallelEmbedding", "default_weight_loader", "forward_context", "get_forward_context",
           "rope_inv_freq", "sample"]

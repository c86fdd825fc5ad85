"""Model building blocks. Every layer takes its engine's ModelContext (op table, tensor-parallel
group, step metadata) when it is built. Linear and embedding layers load their own tensor-parallel
shard; attention reads the step's metadata from the context the model runner sets for each forward.
"""
from vlinfer.layers.activation import SiluAndMul
from vlinfer.layers.attention import Attention
from vlinfer.layers.context import ForwardContext, ModelContext
from vlinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlinfer.layers.layernorm import RMSNorm
from vlinfer.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
                                   default_weight_loader)
from vlinfer.layers.rotary import RotaryEmbedding, rope_inv_freq

__all__ = [
    "Attention", "ColumnParallelLinear", "ForwardContext", "MergedColumnParallelLinear",
    "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding",
    "RowParallelLinear", "SiluAndMul", "VocabParallelEmbedding", "ModelContext",
    "default_weight_loader", "rope_inv_freq"
]

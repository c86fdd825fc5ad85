"""Token embedding and LM head, split by vocabulary across tensor-parallel ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.layers.context import ModelContext
from vlinfer.layers.linear import check_full_size, default_weight_loader


class VocabParallelEmbedding(nn.Module):
    # A GGUF table kept in its blocks (layers/quantization/gguf.py): `weight` is uint8 block rows of
    # this ggml type, looked up through the op table's gguf_embedding into embedding_dtype.
    gguf_type: int | None = None
    embedding_dtype: torch.dtype | None = None

    def __init__(self, ctx: ModelContext, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.ops = ctx.ops
        self.tp = ctx.tp
        world = self.tp.size
        self.num_embeddings = num_embeddings
        self.shard_size = (num_embeddings + world - 1) // world
        self.vocab_start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim, dtype=ctx.dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        check_full_size(loaded, 0, self.num_embeddings)
        rows = max(0, min(self.shard_size, loaded.shape[0] - self.vocab_start))
        if rows < self.shard_size:  # the last rank's shard is padded when vocab % world != 0
            param.data.zero_()
            if rows:
                default_weight_loader(param.data[:rows], loaded.narrow(0, self.vocab_start, rows))
        else:  # narrow on a lazy slice reads only this rank's rows
            default_weight_loader(param, loaded.narrow(0, self.vocab_start, rows))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_type is not None:
            return self.ops.gguf_embedding(ids, self.weight, self.gguf_type, self.embedding_dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = self.lookup(local.clamp(0, self.shard_size - 1)) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    # The weight in the op table's layout (pack_weight), when it cannot replace `weight` itself: a
    # tied head shares `weight` with the embedding, whose lookups need the plain rows.
    packed_weight: torch.Tensor | None = None

    def pack_weight(self, tied: bool) -> bool:
        """The logits matmul on the op table's weight layout (Qwen3-VL-2B's 151936-token head,
        32-row decode steps: 59 -> 43 ms per step on oneDNN; GGUF blocks regrouped for the CPU's
        integer kernel). Tied to the embedding: a packed copy (its size is logged by the caller);
        untied: the weight is replaced. False when the op table has no such layout."""
        if self.packed_weight is not None or self.weight.is_mkldnn or self.weight.dim() != 2:
            return False
        if self.gguf_type is not None:
            packed = self.ops.pack_gguf_weight(self.weight.data, self.gguf_type)
        else:
            packed = self.ops.pack_linear_weight(self.weight)
        if packed is None:
            return False
        if tied:
            self.packed_weight = packed
        else:
            self.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.packed_weight if self.packed_weight is not None else self.weight
        if self.gguf_type is not None:
            logits = self.tp.all_gather(self.ops.gguf_linear(hidden_states, weight, self.gguf_type))
            return logits[..., :self.num_embeddings]
        logits = self.tp.all_gather(self.ops.linear(hidden_states, weight))
        return logits[..., :self.num_embeddings]

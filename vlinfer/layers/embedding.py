"""Token embedding and LM head, split by vocabulary across tensor-parallel ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from vlinfer import ops
from vlinfer.layers.distributed import tp_group
from vlinfer.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = tp_group()
        world = self.tp.size
        self.num_embeddings = num_embeddings
        self.shard_size = (num_embeddings + world - 1) // world
        self.vocab_start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = max(0, min(self.shard_size, loaded.shape[0] - self.vocab_start))
        if rows < self.shard_size:  # the last rank's shard is padded when vocab % world != 0
            param.data.zero_()
            if rows:
                default_weight_loader(param.data[:rows], loaded.narrow(0, self.vocab_start, rows))
        else:  # narrow on a lazy slice reads only this rank's rows
            default_weight_loader(param, loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    # The weight in the selected kernels' layout (ops.prepare_weights), when it cannot replace `weight` itself: a
    # tied head shares `weight` with the embedding, whose lookups need the plain rows.
    packed_weight: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.packed_weight if self.packed_weight is not None else self.weight
        logits = self.tp.all_gather(ops.linear(hidden_states, weight))
        return logits[..., :self.num_embeddings]

"""Token embedding and LM head, split by vocabulary across tensor-parallel ranks."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vlinfer.layers.distributed import all_reduce, tp_rank, tp_size
from vlinfer.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        world = tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = (num_embeddings + world - 1) // world
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        if shard.shape[0] < self.shard_size:  # the last rank's shard is padded when vocab % world != 0
            param.data.zero_()
            param.data[:shard.shape[0]].copy_(shard)
        else:
            default_weight_loader(param, shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        if tp_size() > 1:
            parts = [torch.empty_like(logits) for _ in range(tp_size())]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, -1)
        return logits[..., :self.num_embeddings]

"""A pooling model's head: a few rows of the LM head, so a reranker scores without the vocabulary's
matmul."""
import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.layers.context import ModelContext


class TokenRowsHead(nn.Module):
    """The LM head rows of `token_ids`, whole on every rank (a few rows: nothing to split).
    forward(hidden) gives those tokens' logits, [N, len(token_ids)]."""

    def __init__(self, ctx: ModelContext, token_ids: list[int], hidden_size: int):
        super().__init__()
        self.token_ids = list(token_ids)
        self.weight = nn.Parameter(torch.empty(len(token_ids), hidden_size, dtype=ctx.dtype),
                                   requires_grad=False)

    def load_rows(self, table) -> None:
        """Copy the rows from the checkpoint's [vocab, hidden] table (lm_head.weight, or the
        embedding a tied head shares); a lazy checkpoint slice reads those rows only."""
        if table.shape[1] != self.weight.shape[1]:
            raise ValueError(f"the LM head table is {tuple(table.shape)}, the model's hidden size "
                             f"{self.weight.shape[1]}")
        for i, token in enumerate(self.token_ids):
            self.weight.data[i].copy_(table.narrow(0, token, 1)[0])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.to(self.weight.dtype), self.weight)

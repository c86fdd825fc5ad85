"""MTP heads (`mtp.*`) for the tiny Qwen3.5 / Qwen3-Next checkpoints transformers saves without
one: the published layout, built from transformers' own decoder layer and norm classes, written
beside the checkpoint's files, and trained on the target's own greedy outputs (the target frozen)
so that a bench can see the acceptance a real head gives (bench/mtp_acceptance.py) and a test
both accepted and rejected proposals."""
import json
import os

import torch
from torch import nn


def text_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a transformers Qwen3.5 / Qwen3-Next model (text or with vision)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def mtp_layer_index(config) -> int:
    """A full-attention layer index of the config (transformers builds a layer from its index)
    whose MLP is the MTP layer's: sparse on MoE configs, as layer 0 of the MTP stack is."""
    dense = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", None) or 1
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention" and i not in dense and (i + 1) % step == 0:
            return i
    raise ValueError("the config has no full-attention layer for an MTP head")


class TorchMTP(nn.Module):
    """The head in the checkpoint's names (fc, pre_fc_norm_embedding, pre_fc_norm_hidden,
    layers.0, norm), its layer and norms transformers' own classes."""

    def __init__(self, model: nn.Module):
        super().__init__()
        lm = text_model(model)
        config = lm.config
        h = config.hidden_size
        norm = type(lm.norm)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = norm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([type(lm.layers[0])(config, mtp_layer_index(config))])
        self.norm = norm(h, eps=config.rms_norm_eps)
        # transformers fills weights in post_init, which a bare layer never runs (its experts
        # would stay uninitialised memory); the norms keep their own start
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.05)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings) -> torch.Tensor:
        """embeds, hidden [B, N, H] -> [B, N, H]; causal attention over the N positions."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds),
                               self.pre_fc_norm_hidden(hidden)], -1))
        out = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        x = out[0] if isinstance(out, tuple) else out
        return self.norm(x)


def save_mtp(folder: str, head: TorchMTP) -> None:
    """Write the head as `mtp.*` tensors in their own safetensors file of the checkpoint folder,
    and mtp_num_hidden_layers = 1 into its config (the text config of a vision model)."""
    from safetensors.torch import save_file
    tensors = {f"mtp.{name}": t.detach().contiguous().clone()
               for name, t in head.state_dict().items()}
    save_file(tensors, os.path.join(folder, "mtp.safetensors"))
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def head_logits(model: nn.Module, head: TorchMTP, ids: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
    """[B, T - 1, vocab]: the head's logits at positions 0 .. T - 2 of token rows ids [B, T] (each
    the prediction of the token two on), from the target's final hidden states [B, T, H]; text."""
    lm = text_model(model)
    embeds = lm.embed_tokens(ids[:, 1:])
    positions = torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1)
    rope = lm.rotary_emb(embeds, positions)
    return model.lm_head(head(embeds, hidden[:, :-1], rope))


def train_mtp(model: nn.Module, head: TorchMTP, rows: list[list[int]], steps: int,
              lr: float = 3e-3, batch: int = 64, log=None) -> None:
    """Train the head (the target frozen) on token rows the target generated greedily (its own
    outputs, all of one length): at each position, the token two on; minibatches of `batch` rows
    drawn at random."""
    data = torch.tensor(rows)
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        hidden = torch.cat([text_model(model)(input_ids=data[i:i + batch]).last_hidden_state
                            for i in range(0, len(data), batch)])
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        pick = torch.randperm(len(data), generator=generator)[:batch]
        logits = head_logits(model, head, data[pick], hidden[pick])[:, :-1]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           data[pick, 2:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if log is not None and step % 50 == 0:
            log(f"step {step}: loss {loss.item():.3f}")

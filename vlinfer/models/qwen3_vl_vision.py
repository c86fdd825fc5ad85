"""Qwen3-VL vision tower: patch embed + interpolated learned pos embed + 2-D rotary ViT +
patch/DeepStack mergers.

All images of a request batch are packed along one token axis with no padding; attention is
bidirectional within each frame (cu_seqlens), exactly like HF's varlen path. Patches arrive from the
processor already ordered by 2x2 spatial-merge block (block_row, block_col, in_row, in_col), so the
mergers are plain reshapes; the position embedding and rotary positions must be generated in that
same order.
"""
from collections.abc import Iterable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from vlinfer.layers import ModelContext, ReplicatedLinear
from vlinfer.models.interfaces import PrefillOnly


def _act(ctx: ModelContext, name: str):
    # Qwen3-VL ships gelu_pytorch_tanh; the others are here so a config typo fails loudly rather
    # than silently.
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return ctx.ops.gelu_tanh  # may overwrite its input: the fc1 output, used nowhere else
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    raise ValueError(f"unsupported vision hidden_act {name!r}")


def _block_order_rows_cols(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of one h x w frame in spatial-merge-block order."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge,
                                                                merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge,
                                                                merge)
    # (block_row, in_row, block_col, in_col) -> (block_row, block_col, in_row, in_col)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_corners=True bilinear taps [n, 2] (floor, floor + 1) and weights [n, 2] along one axis.

    Mirrors HF's closed form (index * (side - 1) / (size - 1)) op for op rather than torch.linspace:
    the two can differ in the last ulp, and the weights feed every patch's embedding."""
    src = index.to(torch.float32) * (side - 1) / torch.tensor(max(size - 1, 1))
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


@lru_cache(maxsize=256)
def _frame_geometry(h: int, w: int, merge: int, side: int):
    """Per-frame, size-dependent index tensors (CPU), cached by grid size since real traffic repeats
    a few sizes.

    Returns rotary positions [h*w, 2] (row, col) and pos-embed gather indices / weights [h*w, 4]."""
    rows, cols = _block_order_rows_cols(h, w, merge)
    h_taps, h_weights = _bilinear_taps(rows, h, side)
    w_taps, w_weights = _bilinear_taps(cols, w, side)
    # Tap order (h0,w0), (h0,w1), (h1,w0), (h1,w1), same as HF, so the 4-term sum rounds
    # identically.
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return torch.stack([rows, cols], dim=-1), indices, weights


def split_image_embeds(embeds: torch.Tensor, grid_thw,
                       spatial_merge_size: int) -> list[torch.Tensor]:
    """Split packed merged embeddings [sum(t*h*w/merge^2), D] into one tensor per image, in grid_thw
    order."""
    grid = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    sizes = [t * h * w // (spatial_merge_size * spatial_merge_size) for t, h, w in grid]
    return list(torch.split(embeds, sizes))


class Qwen3VLVisionPatchEmbed(nn.Module):
    """Conv3d with kernel == stride is a matmul over the flattened patch; the checkpoint's 5-D conv
    weight is flattened on load (same C, T, P, P element order as the processor's flattening)."""

    def __init__(self, ctx: ModelContext, in_dim: int, embed_dim: int):
        super().__init__()
        self.proj = ReplicatedLinear(ctx, in_dim, embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class Qwen3VLVisionAttention(nn.Module):
    def __init__(self, ctx: ModelContext, dim: int, num_heads: int):
        super().__init__()
        self.ops = ctx.ops
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = ReplicatedLinear(ctx, dim, dim * 3, bias=True)
        self.proj = ReplicatedLinear(ctx, dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor):
        # qkv output is laid out [3, heads, head_dim] per token.
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.ops.apply_rotary(q, k, cos, sin)
        o = self.ops.varlen_attention(q, k, v, cu_seqlens, self.scale)
        return self.proj(o.reshape(x.shape[0], -1))


class Qwen3VLVisionMLP(nn.Module):
    def __init__(self, ctx: ModelContext, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = ReplicatedLinear(ctx, dim, hidden, bias=True)
        self.linear_fc2 = ReplicatedLinear(ctx, hidden, dim, bias=True)
        self.act = _act(ctx, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLVisionBlock(nn.Module):
    def __init__(self, ctx: ModelContext, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6, dtype=ctx.dtype)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6, dtype=ctx.dtype)
        self.attn = Qwen3VLVisionAttention(ctx, config.hidden_size, config.num_heads)
        self.mlp = Qwen3VLVisionMLP(ctx, config.hidden_size, config.intermediate_size,
                                    config.hidden_act)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3VLVisionPatchMerger(nn.Module):
    """Concatenates each merge x merge block (adjacent rows, by input order) and projects to the LLM
    width.

    The final merger normalizes per patch before the concat; the DeepStack mergers (postshuffle)
    normalize the concatenated vector. Its linears see merged rows, so a vision pass's LoRA rows are
    merged for them too."""

    def __init__(self, ctx: ModelContext, config, postshuffle_norm: bool):
        super().__init__()
        self.ctx = ctx
        self.merge_unit = config.spatial_merge_size ** 2
        self.merged_dim = config.hidden_size * self.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else config.hidden_size,
                                 eps=1e-6, dtype=ctx.dtype)
        self.linear_fc1 = ReplicatedLinear(ctx, self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = ReplicatedLinear(ctx, self.merged_dim, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.merged_dim))
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        # Exact (erf) GELU here, unlike the blocks' tanh GELU.
        with self.ctx.merging_rows(self.merge_unit):
            return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVisionModel(nn.Module, PrefillOnly):  # whole images' patches, never a decode step

    def __init__(self, config, ctx: ModelContext):
        super().__init__()
        config = getattr(config, "vision_config", config)
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.temporal_patch_size = config.temporal_patch_size
        self.in_channels = config.in_channels
        self.hidden_size = config.hidden_size
        # Qwen3.5's tower has no DeepStack: its config has no deepstack_visual_indexes
        self.deepstack_visual_indexes = list(getattr(config, "deepstack_visual_indexes", None)
                                             or [])

        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = Qwen3VLVisionPatchEmbed(ctx, patch_dim, config.hidden_size)
        # _weight: left uninitialized like every other parameter (the checkpoint fills it), so
        # building the model draws nothing from torch's global RNG, which belongs to the caller.
        self.pos_embed = nn.Embedding(
            config.num_position_embeddings, config.hidden_size,
            _weight=torch.empty(config.num_position_embeddings, config.hidden_size,
                                dtype=ctx.dtype))
        self.num_grid_per_side = int(config.num_position_embeddings ** 0.5)

        # Axial rotary: head_dim/4 frequencies, used once for the row and once for the column
        # coordinate.
        head_dim = config.hidden_size // config.num_heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", 10000.0)
        spatial_dim = head_dim // 2
        # A plain attribute, not a buffer: Module.to(bfloat16) would round the frequencies, while
        # HF's from_pretrained(dtype=bf16) keeps them float32 (explicit dtype at construction).
        # Moved to device lazily.
        self.inv_freq = 1.0 / (theta
                               **(torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))

        self.blocks = nn.ModuleList([Qwen3VLVisionBlock(ctx, config) for _ in range(config.depth)])
        self.merger = Qwen3VLVisionPatchMerger(ctx, config, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList([
            Qwen3VLVisionPatchMerger(ctx, config, postshuffle_norm=True)
            for _ in self.deepstack_visual_indexes
        ])

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF `model.visual.*` tensors (prefix stripped). Returns the names loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"unexpected vision weight {name!r}")
            param = params[name]
            # a quantized linear's parameter (layers/quantization): its layer loads it
            if hasattr(param, "quant_layout"):
                try:
                    param.weight_loader(param, tensor)
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor 'model.visual.{name}': {e}") from None
                loaded.add(name)
                continue
            if name == "patch_embed.proj.weight":
                # Conv3d [E, C, T, P, P] -> Linear [E, C*T*P*P]
                tensor = tensor.reshape(param.shape)
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        return loaded

    def _geometry(self, grid_thw: list[list[int]], device: torch.device):
        """Rotary positions [N, 2], pos-embed gather indices/weights [N, 4] and cu_seqlens for the
        packed batch."""
        positions, indices, weights, seqlens = [], [], [], []
        for t, h, w in grid_thw:
            pos, idx, wt = _frame_geometry(h, w, self.spatial_merge_size, self.num_grid_per_side)
            # Every frame of a clip reuses the frame's spatial geometry and is its own attention
            # segment.
            positions.append(pos.repeat(t, 1))
            indices.append(idx.repeat(t, 1))
            weights.append(wt.repeat(t, 1))
            seqlens.extend([h * w] * t)
        cu_seqlens = F.pad(torch.tensor(seqlens).cumsum(0, dtype=torch.int32), (1, 0))
        return (torch.cat(positions).to(device, non_blocking=True),
                torch.cat(indices).to(device, non_blocking=True),
                torch.cat(weights).to(device,
                                      non_blocking=True), cu_seqlens.to(device, non_blocking=True))

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, 2, head_dim/4] -> [N, head_dim/2] as (rows | cols) -> duplicated to [N, head_dim] for
        # neox rotation. Kept float32 whatever the model dtype: HF rotates q/k in float32 with
        # float32 cos/sin.
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        freqs = freqs.flatten(1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()

    def forward(self, pixel_values: torch.Tensor,
                grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N_patches, C*T*P*P] (processor order), grid_thw [num_images, 3] (patch
        units).

        Returns (image_embeds [N_patches / merge^2, out_hidden], one deepstack tensor of the same
        shape per deepstack_visual_indexes entry)."""
        grid = grid_thw.tolist() if isinstance(grid_thw,
                                               torch.Tensor) else [list(g) for g in grid_thw]
        positions, interp_idx, interp_w, cu_seqlens = self._geometry(grid, pixel_values.device)

        x = self.patch_embed(pixel_values)
        # Weights stay float32, so the 4-tap blend is computed in float32 (bf16 table * fp32 weight
        # promotes) and only the result is cast to the activation dtype, as in HF.
        pos = (self.pos_embed(interp_idx) * interp_w[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self._rotary(positions)

        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, cos, sin)
            if i in self.deepstack_visual_indexes:
                deepstack.append(
                    self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack

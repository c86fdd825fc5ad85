"""Qwen3-VL end to end against transformers (float32, tiny random config): checkpoint loading
through our load_weights, prefill with images (whole and chunked inside an image), text-only
prefill, and a decode step."""
import math

import pytest
import torch
from transformers import Qwen3VLConfig
from transformers import Qwen3VLForConditionalGeneration as HFQwen3VL

from vlinfer.layers import Attention, ForwardContext, ModelContext
from vlinfer.loading import ModelSource, iterate_weights
from vlinfer.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vlinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration
from vlinfer.multimodal.mrope import mrope_positions  # noqa: E402
from vlinfer.ops.cpu import CpuOps  # noqa: E402

VOCAB = 1000
IMAGE, VIDEO, VSTART, VEND = 990, 991, 992, 993
MERGE = 2
BLOCK = 16
GRIDS = [[1, 4, 6], [1, 6, 6]]


def _config(tie: bool = False) -> Qwen3VLConfig:
    return Qwen3VLConfig(
        vision_config=dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=128,
                           patch_size=16, temporal_patch_size=2, in_channels=3,
                           spatial_merge_size=MERGE, out_hidden_size=64, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        # head_dim/2 = 16 = 6 + 5 + 5; the interleave leaves slot 15 temporal-only.
        text_config=dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_hidden_layers=3, intermediate_size=128, vocab_size=VOCAB, rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 5, 5],
                "mrope_interleaved": True
            }),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def _rescale(hf: torch.nn.Module) -> None:
    """HF's init (std 0.02, zero biases, unit norms) makes attention ~uniform and hides
    position/offset bugs; use O(1) activations instead."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm1.weight") \
                    or name.endswith("norm2.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight") or name.endswith("pos_embed.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)


def _build(tmp_path_factory, tie: bool):
    torch.manual_seed(0)
    config = _config(tie)
    hf = HFQwen3VL(config).eval()
    _rescale(hf)
    path = tmp_path_factory.mktemp("qwen3vl_tied" if tie else "qwen3vl")
    hf.save_pretrained(path, safe_serialization=True)
    # The model runs on CPU tensors without an engine: on a context of its own, with the compiled
    # CPU ops.
    ours = Qwen3VLForConditionalGeneration(config, ModelContext(CpuOps())).eval()
    names = []

    def stream():
        for name, tensor in iterate_weights(ModelSource("tiny", str(path)), config):
            names.append(name)
            yield name, tensor

    ours.load_weights(stream())
    return config, hf, ours, names


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _build(tmp_path_factory, tie=False)


def _image_tokens(grid) -> list[int]:
    t, h, w = grid
    return [VSTART] + [IMAGE] * (t * h * w // MERGE ** 2) + [VEND]


def _prompt() -> list[int]:
    return [1, 2, 3] + _image_tokens(GRIDS[0]) + [7, 8] + _image_tokens(GRIDS[1]) + [9, 10, 11]


def _pixels(grid: torch.Tensor, config) -> torch.Tensor:
    v = config.vision_config
    return torch.randn(int(grid.prod(-1).sum()),
                       v.in_channels * v.temporal_patch_size * v.patch_size**2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _alloc_cache(model, num_tokens: int) -> int:
    num_blocks = math.ceil(num_tokens / BLOCK)
    for m in model.modules():
        if isinstance(m, Attention):
            m.k_cache = torch.zeros(num_blocks, BLOCK, m.num_kv_heads, m.head_dim)
            m.v_cache = torch.zeros(num_blocks, BLOCK, m.num_kv_heads, m.head_dim)
    return num_blocks


def _step(model, num_blocks: int, start: int, end: int, ids, positions, **mm) -> torch.Tensor:
    """Logits of tokens start..end-1 of one sequence whose first `start` tokens are already in the
    cache."""
    step = ForwardContext(slot_mapping=torch.arange(start, end),
                          cu_seqlens_q=torch.tensor([0, end - start]), seq_lens=torch.tensor([end]),
                          block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
                          decode_only=end - start == 1)
    ctx = next(m.ctx for m in model.modules() if isinstance(m, Attention))
    with ctx.stepping(step):
        hidden = model(torch.as_tensor(ids), positions, **mm)
    return model.compute_logits(hidden)


def _hf_logits(hf, ids, grid=None, pixel_values=None) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    kwargs = {}
    if grid is not None:
        kwargs = dict(pixel_values=pixel_values, image_grid_thw=grid,
                      mm_token_type_ids=(input_ids == IMAGE).int())
    return hf(input_ids=input_ids, use_cache=False, **kwargs).logits[0]


def _mm_inputs(ours, ids, grid, pixel_values):
    images = ours.encode_images(pixel_values, grid)
    embeds = torch.cat([e for e, _ in images])
    deepstack = torch.cat([d for _, d in images], dim=1)
    mask = torch.tensor(ids) == IMAGE
    positions, delta = mrope_positions(ids, grid, IMAGE, VSTART, MERGE)
    return embeds, deepstack, mask, positions, delta


def test_checkpoint_names(models):
    config, hf, ours, names = models
    assert any(n.startswith("model.language_model.layers.0.self_attn.q_proj") for n in names)
    assert any(n.startswith("model.visual.blocks.0.") for n in names)
    assert "lm_head.weight" in names
    assert isinstance(ours, SupportsMRoPE) and isinstance(ours, SupportsMultiModal)
    # Same values as HF after loading (spot checks across the three groups).
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(ours.model.visual.merger.linear_fc2.weight,
                               hf.model.visual.merger.linear_fc2.weight, rtol=0, atol=0)


@torch.no_grad()
def test_encode_images_shapes(models):
    config, hf, ours, _ = models
    torch.manual_seed(1)
    grid = torch.tensor(GRIDS)
    images = ours.encode_images(_pixels(grid, config), grid)
    assert [tuple(e.shape) for e, _ in images] == [(6, 64), (9, 64)]
    assert [tuple(d.shape) for _, d in images] == [(2, 6, 64), (2, 9, 64)]


@torch.no_grad()
def test_prefill_with_images_matches_hf(models):
    config, hf, ours, _ = models
    torch.manual_seed(2)
    ids = _prompt()
    grid = torch.tensor(GRIDS)
    pixel_values = _pixels(grid, config)
    ref = _hf_logits(hf, ids, grid, pixel_values)
    assert torch.isfinite(ref).all()
    embeds, deepstack, mask, positions, _ = _mm_inputs(ours, ids, grid, pixel_values)
    T = len(ids)
    nb = _alloc_cache(ours, T)
    logits = _step(ours, nb, 0, T, ids, positions, mm_embeds=embeds, mm_mask=mask,
                   deepstack_embeds=deepstack)
    assert _rel(logits, ref) <= 1e-4

    # The checks above must be sensitive to DeepStack and to the h/w position rows.
    _alloc_cache(ours, T)
    no_ds = _step(ours, nb, 0, T, ids, positions, mm_embeds=embeds, mm_mask=mask)
    assert _rel(no_ds, ref) > 1e-2
    _alloc_cache(ours, T)
    text_pos = _step(ours, nb, 0, T, ids,
                     torch.arange(T).expand(3, -1), mm_embeds=embeds, mm_mask=mask,
                     deepstack_embeds=deepstack)
    assert _rel(text_pos, ref) > 1e-3


@torch.no_grad()
def test_prefill_one_image_matches_hf(models):
    config, hf, ours, _ = models
    torch.manual_seed(3)
    ids = [5, 6] + _image_tokens(GRIDS[0]) + [7, 8, 9]
    grid = torch.tensor(GRIDS[:1])
    pixel_values = _pixels(grid, config)
    ref = _hf_logits(hf, ids, grid, pixel_values)
    embeds, deepstack, mask, positions, _ = _mm_inputs(ours, ids, grid, pixel_values)
    nb = _alloc_cache(ours, len(ids))
    logits = _step(ours, nb, 0, len(ids), ids, positions, mm_embeds=embeds, mm_mask=mask,
                   deepstack_embeds=deepstack)
    assert _rel(logits, ref) <= 1e-4


@torch.no_grad()
def test_chunked_prefill_split_inside_image(models):
    config, hf, ours, _ = models
    torch.manual_seed(4)
    ids = _prompt()
    grid = torch.tensor(GRIDS)
    pixel_values = _pixels(grid, config)
    ref = _hf_logits(hf, ids, grid, pixel_values)
    embeds, deepstack, mask, positions, _ = _mm_inputs(ours, ids, grid, pixel_values)
    T = len(ids)
    split = ids.index(IMAGE) + 3  # three of the first image's six placeholders in chunk one
    n1 = int(mask[:split].sum())
    assert 0 < n1 < int(mask.sum())
    nb = _alloc_cache(ours, T)
    first = _step(ours, nb, 0, split, ids[:split], positions[:, :split], mm_embeds=embeds[:n1],
                  mm_mask=mask[:split], deepstack_embeds=deepstack[:, :n1])
    second = _step(ours, nb, split, T, ids[split:], positions[:, split:], mm_embeds=embeds[n1:],
                   mm_mask=mask[split:], deepstack_embeds=deepstack[:, n1:])
    scale = ref.abs().max()
    assert ((first - ref[:split]).abs().max() / scale).item() <= 1e-4
    assert ((second - ref[split:]).abs().max() / scale).item() <= 1e-4


@torch.no_grad()
def test_text_only_prefill_matches_hf(models):
    config, hf, ours, _ = models
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]
    ref = _hf_logits(hf, ids)
    nb = _alloc_cache(ours, len(ids))
    positions, delta = mrope_positions(ids, [], IMAGE, VSTART, MERGE)
    assert delta == 0
    logits = _step(ours, nb, 0, len(ids), ids, positions)
    assert _rel(logits, ref) <= 1e-4
    # A 1-row position tensor (plain text positions) is accepted too.
    _alloc_cache(ours, len(ids))
    assert _rel(_step(ours, nb, 0, len(ids), ids, torch.arange(len(ids))), ref) <= 1e-4


@torch.no_grad()
def test_decode_after_image_prefill(models):
    config, hf, ours, _ = models
    torch.manual_seed(5)
    ids = _prompt()
    grid = torch.tensor(GRIDS)
    pixel_values = _pixels(grid, config)
    embeds, deepstack, mask, positions, delta = _mm_inputs(ours, ids, grid, pixel_values)
    assert delta != 0
    L = len(ids)
    nb = _alloc_cache(ours, L + 1)
    prefill = _step(ours, nb, 0, L, ids, positions, mm_embeds=embeds, mm_mask=mask,
                    deepstack_embeds=deepstack)
    token = int(prefill[-1].argmax())
    decode = _step(ours, nb, L, L + 1, [token], torch.full((3, 1), L + delta))
    ref = _hf_logits(hf, ids + [token], grid, pixel_values)
    assert _rel(decode[0], ref[-1]) <= 1e-4


@torch.no_grad()
def test_tied_embeddings(tmp_path_factory):
    config, hf, ours, names = _build(tmp_path_factory, tie=True)
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    ids = [3, 14, 15, 92, 65, 35]
    ref = _hf_logits(hf, ids)
    nb = _alloc_cache(ours, len(ids))
    logits = _step(ours, nb, 0, len(ids), ids, torch.arange(len(ids)).expand(3, -1))
    assert _rel(logits, ref) <= 1e-4


def test_load_rejects_missing_vision_weight(models, tmp_path):
    config, hf, _, _ = models
    ours = Qwen3VLForConditionalGeneration(config, ModelContext(CpuOps()))
    state = {k: v for k, v in hf.state_dict().items() if k != "model.visual.merger.linear_fc1.bias"}
    with pytest.raises(ValueError, match="merger.linear_fc1.bias"):
        ours.load_weights(state.items())

"""Qwen3-VL vision tower and MRoPE against transformers (float32, tiny random config)."""
import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from vlinfer.layers import ModelContext
from vlinfer.models.qwen3_vl_vision import Qwen3VLVisionModel, split_image_embeds
from vlinfer.ops.cpu import CpuOps
from vlinfer.layers.rotary import mrope_cos_sin
from vlinfer.multimodal.mrope import mrope_positions

IMAGE, VSTART, VEND, VIDEO = 190, 191, 192, 193
MERGE = 2


def _config() -> Qwen3VLConfig:
    return Qwen3VLConfig(
        vision_config=dict(depth=3, hidden_size=64, num_heads=4, intermediate_size=128,
                           patch_size=16, temporal_patch_size=2, in_channels=3,
                           spatial_merge_size=MERGE, out_hidden_size=96, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        # head_dim/2 = 16 > 3 * 5, so the interleave leaves a temporal-only tail (slot 15) to check.
        text_config=dict(
            hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_hidden_layers=2, intermediate_size=192, vocab_size=200, rope_parameters={
                "rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 5, 5],
                "mrope_interleaved": True
            }),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = _config()
    hf = Qwen3VLForConditionalGeneration(config).eval()
    visual = hf.model.visual
    # HF's init (std 0.02, zero biases) makes attention ~uniform and hides position bugs; use O(1)
    # activations.
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith(
                    "norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            elif name == "pos_embed.weight":
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    ours = Qwen3VLVisionModel(config, ModelContext(CpuOps())).eval()
    loaded = ours.load_weights((k, v.clone()) for k, v in visual.state_dict().items())
    assert loaded == set(dict(ours.named_parameters()))
    return config, hf, ours


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _pixels(grid: torch.Tensor, config) -> torch.Tensor:
    v = config.vision_config
    n = int(grid.prod(-1).sum())
    return torch.randn(n, v.in_channels * v.temporal_patch_size * v.patch_size ** 2)


@pytest.mark.parametrize("grid", [
    [[1, 4, 6], [1, 8, 8], [1, 2, 10]],
    [[1, 6, 4]],
    # multi-frame entry: each frame its own attention segment; 12 > 8 upsamples
    [[2, 4, 4], [1, 12, 6]],
])
@torch.no_grad()
def test_vision_matches_hf(models, grid):
    config, hf, ours = models
    torch.manual_seed(1)
    grid_thw = torch.tensor(grid)
    pixel_values = _pixels(grid_thw, config)
    ref = hf.model.visual(pixel_values, grid_thw=grid_thw, return_dict=True)
    embeds, deepstack = ours(pixel_values, grid_thw)
    assert embeds.shape == (int(grid_thw.prod(-1).sum()) // MERGE**2,
                            config.vision_config.out_hidden_size)
    assert _rel(embeds, ref.pooler_output) <= 1e-4
    assert len(deepstack) == len(ref.deepstack_features) == 2
    for d, r in zip(deepstack, ref.deepstack_features):
        assert d.shape == embeds.shape
        assert _rel(d, r) <= 1e-4

    per_image = split_image_embeds(embeds, grid_thw, MERGE)
    ref_split = hf.model.get_image_features(pixel_values, grid_thw).pooler_output
    assert [t.shape for t in per_image] == [t.shape for t in ref_split]
    for a, b in zip(per_image, ref_split):
        assert _rel(a, b) <= 1e-4


@torch.no_grad()
def test_vision_batch_equals_separate(models):
    """Packing must not leak attention across images: batched == each image alone."""
    config, _, ours = models
    torch.manual_seed(2)
    grid_thw = torch.tensor([[1, 4, 6], [1, 8, 8]])
    pixel_values = _pixels(grid_thw, config)
    embeds, _ = ours(pixel_values, grid_thw)
    first = ours(pixel_values[:24], grid_thw[:1])[0]
    second = ours(pixel_values[24:], grid_thw[1:])[0]
    assert _rel(torch.cat([first, second]), embeds) <= 1e-5


def _image_tokens(grid) -> list[int]:
    t, h, w = grid
    return [VSTART] + [IMAGE] * (t * h * w // MERGE ** 2) + [VEND]


SEQUENCES = {
    "text_only": ([5, 6, 7, 8, 9], []),
    "image_first": (_image_tokens([1, 4, 6]) + [10, 11, 12], [[1, 4, 6]]),
    "image_middle": ([1, 2, 3] + _image_tokens([1, 8, 4]) + [4, 5], [[1, 8, 4]]),
    "image_last": ([1, 2] + _image_tokens([1, 2, 10]), [[1, 2, 10]]),
    "two_images": ([1, 2, 3, 4] + _image_tokens([1, 4, 6]) + [7, 8] + _image_tokens([1, 8, 8]) +
                   [9, 10, 11], [[1, 4, 6], [1, 8, 8]]),
    "two_images_adjacent": (_image_tokens([1, 6, 2]) + _image_tokens([1, 2, 4]), [[1, 6, 2],
                                                                                  [1, 2, 4]]),
}


@pytest.mark.parametrize("name", list(SEQUENCES))
def test_mrope_positions_match_hf(models, name):
    config, hf, _ = models
    ids, grids = SEQUENCES[name]
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == IMAGE).int()
    ref_pos, ref_delta = hf.model.get_rope_index(
        input_ids, mm_token_type_ids=mm_types,
        image_grid_thw=torch.tensor(grids) if grids else None)
    pos, delta = mrope_positions(ids, grids, IMAGE, VSTART, MERGE)
    assert pos.dtype == torch.long and pos.shape == (3, len(ids))
    assert torch.equal(pos, ref_pos[:, 0])
    assert delta == int(ref_delta.item())
    # Tensor inputs behave the same.
    pos2, delta2 = mrope_positions(input_ids[0],
                                   torch.tensor(grids).view(-1, 3), IMAGE, VSTART, MERGE)
    assert torch.equal(pos2, pos) and delta2 == delta


def test_mrope_positions_rejects_bad_counts():
    with pytest.raises(ValueError):
        mrope_positions([1] + [IMAGE] * 5 + [2], [[1, 4, 6]], IMAGE, VSTART, MERGE)
    with pytest.raises(ValueError):
        mrope_positions([1, 2], [[1, 4, 6]], IMAGE, VSTART, MERGE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_mrope_cos_sin_match_hf(models, dtype):
    config, hf, _ = models
    rotary = hf.model.language_model.rotary_emb
    ids, grids = SEQUENCES["two_images"]
    pos, delta = mrope_positions(ids, grids, IMAGE, VSTART, MERGE)
    # Prefill positions plus a few decode steps far out (i + delta on all rows).
    decode = torch.arange(len(ids), len(ids) + 4) + delta + 5000
    positions = torch.cat([pos, decode.expand(3, -1)], dim=1)
    x = torch.zeros(1, dtype=dtype)
    ref_cos, ref_sin = rotary(x, positions[:, None, :])
    cos, sin = mrope_cos_sin(positions, rotary.inv_freq,
                             config.text_config.rope_parameters["mrope_section"],
                             rotary.attention_scaling, dtype)
    assert cos.shape == (positions.shape[1], config.text_config.head_dim) and cos.dtype == dtype
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)
    # The h/w rows must actually matter (guards against a trivially-text-only result).
    assert not torch.equal(cos,
                           mrope_cos_sin(positions[0], rotary.inv_freq, [6, 5, 5], 1.0, dtype)[0])


@torch.no_grad()
def test_vision_rotary_stays_float32_under_dtype_cast():
    """Casting the tower to bf16 must not round the rotary frequencies (HF from_pretrained keeps
    them fp32)."""
    config = _config()
    fp32 = Qwen3VLVisionModel(config, ModelContext(CpuOps()))
    bf16 = Qwen3VLVisionModel(config, ModelContext(CpuOps())).to(torch.bfloat16)
    positions = torch.tensor([[0, 0], [3, 7], [40, 95]])
    for a, b in zip(fp32._rotary(positions), bf16._rotary(positions)):
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, b)


@torch.no_grad()
def test_vision_bf16_error_is_transformers_bf16_error(models):
    """bfloat16 tolerance (README): with the CPU kernels (vision attention on AVX512-BF16, GELU in
    one pass), the tower's error against float32 transformers is within 1.5x of transformers' own
    bfloat16 error."""
    import copy
    config, hf, ours = models
    torch.manual_seed(3)
    grid_thw = torch.tensor([[1, 16, 20], [1, 6, 4], [1, 30, 8]])
    pixel_values = _pixels(grid_thw, config)
    truth = hf.model.visual(pixel_values, grid_thw=grid_thw, return_dict=True)
    hf_bf16 = copy.deepcopy(hf.model.visual).to(torch.bfloat16)
    # from_pretrained keeps it fp32
    hf_bf16.rotary_pos_emb.inv_freq = hf.model.visual.rotary_pos_emb.inv_freq
    ref = hf_bf16(pixel_values.bfloat16(), grid_thw=grid_thw, return_dict=True)
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    embeds, deepstack = ours_bf16(pixel_values, grid_thw)
    assert embeds.dtype == torch.bfloat16
    for got, want, exact in [(embeds, ref.pooler_output, truth.pooler_output),
                             *zip(deepstack, ref.deepstack_features, truth.deepstack_features)]:
        hf_err = _rel(want.float(), exact)
        assert 0 < hf_err < 0.05  # bf16 really rounds, and not absurdly
        assert _rel(got.float(), exact) <= 1.5 * hf_err

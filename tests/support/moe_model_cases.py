"""Builders and constants of tests/models/test_moe_model.py that other test modules use too (IMG_B,
IMG_C, PROMPT_TWO, hf_inputs, qwen3_moe_config, qwen3_vl_moe_config, save_with_layout): imported
from here by every one of them, that module included."""
import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from dependencies import qwen_tokenizer_dir
from text_checkpoints import hf_qwen3_vl_processor
from images import picture
from vlinfer.toy.tiny_checkpoints import QWEN3_VL_SPECIAL

HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 64, 48, 6, 2
MOE_TEXT = dict(hidden_size=HIDDEN, moe_intermediate_size=EXPERT_WIDTH, intermediate_size=96,
                num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, hidden_act="silu")
PROMPT_TWO = "<|im_start|>user\nCompare <|vision_start|><|image_pad|><|vision_end|> with " \
             "<|vision_start|><|image_pad|><|vision_end|> please.<|im_end|>\n" \
             "<|im_start|>assistant\n"
IMG_A, IMG_B, IMG_C = picture(120, 160, 1), picture(64, 96, 2), picture(64, 64, 3)
EXPERT = re.compile(
    r"^(.+\.mlp\.experts)\.(?:(\d+)\.(gate|up|down)_proj\.weight|(gate_up|down)_proj)$")


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=512, num_hidden_layers=3, mlp_only_layers=[1],
                          decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=1024,
                          tie_word_embeddings=False,
                          rope_parameters={"rope_type": "default",
                                           "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0, architectures=["Qwen3MoeForCausalLM"], **MOE_TEXT)


def qwen3_vl_moe_config():
    from transformers import Qwen3VLMoeConfig
    return Qwen3VLMoeConfig(
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64,
                           patch_size=16, temporal_patch_size=2, in_channels=3,
                           spatial_merge_size=2, out_hidden_size=HIDDEN,
                           num_position_embeddings=2304, deepstack_visual_indexes=[0, 1],
                           hidden_act="gelu_pytorch_tanh"), text_config=dict(
                               vocab_size=151936, num_hidden_layers=2, max_position_embeddings=4096,
                               **MOE_TEXT, rope_parameters={
                                   "rope_type": "default", "rope_theta": 5000000.0,
                                   "mrope_section": [4, 2, 2], "mrope_interleaved": True
                               }), tie_word_embeddings=False,
        architectures=["Qwen3VLMoeForConditionalGeneration"], **QWEN3_VL_SPECIAL)


def save_with_layout(model, folder: str, layout: str) -> str:
    """model.save_pretrained, then the expert tensors rewritten into `layout`; tokenizer and
    preprocessor beside."""
    model.save_pretrained(folder, safe_serialization=True)
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    tensors = {}
    for file in files:
        with safe_open(os.path.join(folder, file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
        os.remove(os.path.join(folder, file))
    experts: dict[str, dict] = {}
    out = {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m is None:
            out[name] = t
        elif m[4]:  # fused, transformers' in-memory layout: gate_up [E, 2I, H], down [E, H, I]
            experts.setdefault(m[1], {})[m[4]] = t
        else:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
    for prefix, parts in experts.items():
        if "gate_up" in parts:
            gate_up, down = parts["gate_up"], parts["down"]
        else:
            n = len(parts["gate"])
            gate_up = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)])
            down = torch.stack([parts["down"][e] for e in range(n)])
        if layout == "per-expert":
            for e in range(gate_up.shape[0]):
                gate, up = gate_up[e].chunk(2)
                out.update({
                    f"{prefix}.{e}.gate_proj.weight": gate.clone(),
                    f"{prefix}.{e}.up_proj.weight": up.clone(),
                    f"{prefix}.{e}.down_proj.weight": down[e].clone()
                })
        elif layout == "fused":
            out.update({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down})
        else:  # the Qwen3-VL-MoE hub: gate_up [E, H, 2I] (gate columns first), down [E, I, H]
            out.update({f"{prefix}.gate_up_proj": gate_up.transpose(1, 2).contiguous(),
                        f"{prefix}.down_proj": down.transpose(1, 2).contiguous()})
    save_file(out, os.path.join(folder, "model.safetensors"))
    for name in os.listdir(qwen_tokenizer_dir()):
        shutil.copy(os.path.join(qwen_tokenizer_dir(), name), folder)
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True,
        "resample": 3, "size": {"shortest_edge": 65536, "longest_edge": 16777216}
    }
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor, f)
    return folder


def hf_inputs(folder, text, images):
    out = hf_qwen3_vl_processor(folder)(text=[text], images=images or None, return_tensors="pt")
    kwargs = {"mm_token_type_ids": out["mm_token_type_ids"]}
    if images:
        kwargs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    return out["input_ids"], kwargs

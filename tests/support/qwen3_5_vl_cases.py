"""Builders and constants of tests/models/test_qwen3_5_vl.py that other test modules use too (MOE,
TEXT, VISION): imported from here by every one of them, that module included."""
from qwen3_5_text_cases import LAYER_TYPES

TEXT = dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
            layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=48, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
           shared_expert_intermediate_size=40)
VISION = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, patch_size=16,
              temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=64,
              num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh")

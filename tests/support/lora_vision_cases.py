"""Builders and constants of tests/models/test_lora_vision.py that other test modules use too (TEXT,
VISION): imported from here by every one of them, that module included."""
# PEFT target_modules regexes (full match on the module name): every vision linear (blocks' qkv,
# proj and MLP, the merger's and the DeepStack mergers'), the patch embedding (a Conv3d: PEFT gives
# it convolution-shaped A and B) and the decoder's.
VISION = (r"model\.visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
          r"|(merger|deepstack_merger_list\.\d+)\.linear_fc[12]|patch_embed\.proj)")
TEXT = r"model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"

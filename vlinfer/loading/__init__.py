"""Loading a model's files: finding it (an alias, a folder, a .gguf file, a repo id, an embedded
toy), reading its config, tokenizer and tensors, and copying tensors into parameters. What builds
the model from them is the engine's (vlinfer/engine/build_model.py)."""
import importlib

# Each name from its module on first use: `vlinfer.loading.sources` (the aliases, which the CLI's
# --help lists) reads without torch.
_PUBLIC = {
    **dict.fromkeys(("CheckpointError", "CheckpointSlice", "ReadCounter", "check_float_tensors",
                     "check_layer_counts", "check_model_size", "checkpoint_tensor_index",
                     "eos_token_ids", "fitting", "iterate_weights", "lm_head_table", "load_config",
                     "load_tokenizer"), "vlinfer.loading.checkpoint"),
    **dict.fromkeys(("EMBEDDED_MODELS", "HF_ALIASES", "PACKAGED_MODELS", "ModelNotFoundError",
                     "ModelSource", "cache_dir", "embedded_model_path", "known_aliases",
                     "resolve_model"), "vlinfer.loading.sources"),
    "load_weights": "vlinfer.loading.weights",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'vlinfer.loading' has no attribute {name!r}")

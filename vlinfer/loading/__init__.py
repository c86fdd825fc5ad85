"""Loading a model's files: finding it (an alias, a folder, a .gguf file, a repo id, an embedded
toy), reading its config, tokenizer and tensors, and copying tensors into parameters. What builds
the model from them is the engine's (vlinfer/engine/build_model.py)."""
from vlinfer.loading.checkpoint import (CheckpointError, CheckpointSlice, ReadCounter,
                                        check_float_tensors, check_layer_counts, check_model_size,
                                        checkpoint_tensor_index, eos_token_ids, fitting,
                                        iterate_weights, lm_head_table, load_config, load_tokenizer)
from vlinfer.loading.sources import (EMBEDDED_MODELS, HF_ALIASES, PACKAGED_MODELS,
                                     ModelNotFoundError, ModelSource, cache_dir,
                                     embedded_model_path, known_aliases, resolve_model)
from vlinfer.loading.weights import load_weights

__all__ = [
    "CheckpointError", "CheckpointSlice", "EMBEDDED_MODELS", "HF_ALIASES", "ModelNotFoundError",
    "ModelSource", "PACKAGED_MODELS", "ReadCounter", "cache_dir", "check_float_tensors",
    "check_layer_counts", "check_model_size", "checkpoint_tensor_index", "embedded_model_path",
    "eos_token_ids", "fitting", "iterate_weights", "known_aliases", "lm_head_table", "load_config",
    "load_tokenizer", "load_weights", "resolve_model"
]

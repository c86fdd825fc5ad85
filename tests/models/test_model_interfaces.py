"""Model capabilities are declared on the classes (models/interfaces.py) and read by the engine
with isinstance: no hasattr / getattr probing of a model in vlinfer/engine, and no attribute set
on a built model from outside."""
import ast
import os

import pytest

from vlinfer.models import get_model_class
from vlinfer.models.interfaces import (OwnsWeightLoading, PagedAttentionBlock, PrefillOnly,
                                       SupportsFusedDecode, SupportsMRoPE, SupportsMultiModal,
                                       SupportsPooling)
from vlinfer.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from vlinfer.models.qwen3 import Qwen3ForCausalLM
from vlinfer.models.qwen3_moe import Qwen3MoeForCausalLM
from vlinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLTextModel
from vlinfer.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from vlinfer.models.qwen3_vl_vision import Qwen3VLVisionModel

from dependencies import REPO
ENGINE = os.path.join(REPO, "vlinfer", "engine")
# What the engine may still read by name: configs, requests and graph backends, never a model.
NOT_A_MODEL = {"text_config", "hf_config", "hf", "config", "lora_request", "backend"}
MODEL_NAMES = {"model", "net"}  # layers bind their declared cache and LoRA fields: not patching


def probes(source: str) -> list[str]:
    """hasattr / getattr / setattr / delattr calls on anything but NOT_A_MODEL, and attributes
    assigned on a model-like name (`net.x = ...`, `self.model.x = ...`): 'line: code' each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args
                and node.func.id in ("hasattr", "getattr", "setattr", "delattr")
                and ast.unparse(node.args[0]) not in NOT_A_MODEL):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if not isinstance(target, ast.Attribute):
                continue
            if ast.unparse(target.value).split(".")[-1] in MODEL_NAMES:
                found.append(f"{node.lineno}: {ast.unparse(target)} = ...")
    return found


def test_the_scan_sees_probes():
    """The scan is not blind: the probes the engine used to make are found."""
    old = """
def load(net, model, self):
    if hasattr(net, "load_weights"):
        net.load_weights(w)
    classifier = getattr(self.model, "classifier", None)
    net.lm_head = None
    net.checkpoint_bytes_read = 3
    prefill = {m for part in model.modules() if getattr(part, "runs_prefill_only", False)}
    declared = getattr(text_config, "max_position_embeddings", None)
"""
    assert sorted(int(p.split(":")[0]) for p in probes(old)) == [3, 5, 6, 7, 8]


def test_engine_does_not_probe_or_patch_models():
    found = []
    for folder, _, files in os.walk(ENGINE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ENGINE)
                found += [f"{rel}:{p}" for p in probes(open(path).read())]
    assert not found, ("declare a capability in vlinfer/models/interfaces.py instead: "
                       + "; ".join(found))


VISION = {SupportsPooling, OwnsWeightLoading, SupportsMultiModal, SupportsMRoPE}


@pytest.mark.parametrize("cls,declared", [
    (LlamaForCausalLM, {SupportsPooling}),
    (Qwen3ForCausalLM, {SupportsPooling}),
    (Qwen3MoeForCausalLM, {SupportsPooling, OwnsWeightLoading}),
    (Qwen3VLForConditionalGeneration, VISION),
    (Qwen3VLMoeForConditionalGeneration, VISION),
])
def test_model_classes_declare_their_capabilities(cls, declared):
    every = {SupportsPooling, OwnsWeightLoading, SupportsMultiModal, SupportsMRoPE}
    assert {interface for interface in every if issubclass(cls, interface)} == declared


def test_parts_declare_theirs():
    assert issubclass(LlamaModel, SupportsFusedDecode)
    assert issubclass(Qwen3VLTextModel, SupportsFusedDecode)
    assert issubclass(Qwen3VLVisionModel, PrefillOnly) and not issubclass(LlamaModel, PrefillOnly)
    assert issubclass(LlamaAttention, PagedAttentionBlock)


def test_registry_classes_take_heads_at_construction():
    """Every registered class is built with its heads (the third constructor argument)."""
    import inspect

    from vlinfer.models.registry import _MODELS
    for arch in _MODELS:
        cls = get_model_class(type("Config", (), {"architectures": [arch]}))
        params = list(inspect.signature(cls.__init__).parameters)
        assert params[1:4] == ["config", "ctx", "heads"], arch

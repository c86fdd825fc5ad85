"""Model resolution through the local Hugging Face cache, the way a downloaded repo id is found
offline."""
import os
import shutil

import pytest

from vlinfer import LLM, ModelNotFoundError, SamplingParams
from vlinfer.loading import known_aliases, resolve_model


def test_repo_id_resolves_from_the_local_hf_cache(qwen3_checkpoint, tmp_path, monkeypatch):
    path, model = qwen3_checkpoint
    # The hub cache layout: models--{org}--{name}/refs/main -> snapshots/{commit}/<files>.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--vlinfer-test--tiny-qwen3"
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(path, snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    source = resolve_model("vlinfer-test/tiny-qwen3")
    assert os.path.samefile(source.path, snapshot)
    llm = LLM("vlinfer-test/tiny-qwen3", dtype="float32", kv_cache_bytes=4 * 2 ** 20)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_qwen3_5_alias_offline_names_the_repo_and_the_download(tmp_path, monkeypatch):
    """`qwen3.5` stands for Qwen/Qwen3.5-2B; with an empty cache and no network the error says
    which repo and how to fetch it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert "qwen3.5" in known_aliases()
    with pytest.raises(ModelNotFoundError, match=r"'qwen3\.5' \(Qwen/Qwen3\.5-2B\) not found"
                       ) as err:
        resolve_model("qwen3.5")
    assert "huggingface-cli download Qwen/Qwen3.5-2B" in str(err.value)


def test_a_damaged_name_around_a_fused_fragment_is_named():
    """A tensor name whose fused fragment matches but whose rest is damaged (found by
    test_generated_checkpoints' damaged bytes: 'model.' -> ' odel.') is refused by name, not with a
    KeyError."""
    import torch
    from torch import nn

    from vlinfer.loading import load_weights

    class Tiny(nn.Module):
        packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0)}

        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"tie_word_embeddings": False})()
            self.gate_up_proj = nn.Linear(2, 4, bias=False)

    with pytest.raises(ValueError, match="' odel.gate_proj.weight' has no matching parameter"):
        load_weights(Tiny(), iter([(" odel.gate_proj.weight", torch.zeros(2, 2))]))

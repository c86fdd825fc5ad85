"""Bad requests get a clear error at generate, and the engine serves the next call."""
import re

import pytest

from engine_checks import assert_block_pool_empty
from vlinfer import LLM, ModelNotFoundError, RequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3_checkpoint):
    return LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=4 * 2 ** 20, max_model_len=128)


def serves_next_call(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([5] * 129, "max_model_len"),
    ([5, 100000], "vocabulary"),
    ({"text": "x"}, "unknown prompt keys"),
    ({"prompt": "hi", "multi_modal_data": {"image": ["a.png"]}}, "does not accept images"),
    (3.5, "must be a str"),
])
def test_bad_prompt(llm, prompt, match):
    with pytest.raises(RequestError, match=match) as info:
        llm.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    good, bad = info.value.outputs
    # the good request in the call completed
    assert len(good.outputs[0].token_ids) == 4 and good.error is None
    # its own reason, per request
    assert re.search(match, bad.error) and bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == [] and bad.outputs[0].text == ""
    serves_next_call(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([[1, 2, 3]], SamplingParams(**kwargs), use_tqdm=False)
    serves_next_call(llm)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found") as info:
        LLM(str(tmp_path / "no-such-model"))
    assert "no-such-model" in str(info.value)
    with pytest.raises(ModelNotFoundError, match="huggingface-cli download"):
        import os
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            LLM("no-such-org/no-such-model")
        finally:
            del os.environ["HF_HUB_OFFLINE"]


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(str(tmp_path))

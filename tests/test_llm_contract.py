"""Promises of the Python API beyond its outputs: LLM.chat answers a bad conversation as generate
answers a bad prompt; constructing and running an LLM leaves torch's global RNG alone;
allow_image_urls fetches through the server's fetch (address checks, no proxies from the
environment, byte and time limits); validation that matters raises errors that `python -O` keeps."""
import ast
import asyncio
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from engine_checks import assert_block_pool_empty
from text_checkpoints import build_checkpoint, tiny_text_config
from images import ImageServer, picture

from vlinfer import LLM, RequestError, SamplingParams
from vlinfer.multimodal.url_fetch import UrlFetchError, UrlPolicy, fetch_image_url_sync
from vlinfer.serve.security import ImagePolicy, fetch_url

from dependencies import REPO as ROOT
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", max_model_len=1024, kv_cache_bytes=16 << 20)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl(tiny_vl_with_context):
    return LLM(tiny_vl_with_context(2048), **ENGINE)


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


# ---- LLM.chat: per-conversation errors ----
def test_chat_answers_bad_conversations_and_runs_the_others(vl):
    image = picture(64, 64, seed=3)
    good = {0: user("Hello there."),
            2: user([{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]),
            6: user("Name a colour.")}
    bad = {
        1: (user("look at <|image_pad|> this"), "special vision token"),
        3: (user([{"type": "video",
                   "video": "clip.mp4"}]), "video 0: video file not found: clip.mp4"),
        4: (user("hi") + ["not a message"], "message 1 must be a dict"),
        # rejected by generate, after the template
        5: (user("word " * 2000), "more than max_model_len=1024")
    }
    conversations = [good[i] if i in good else bad[i][0] for i in range(7)]
    with pytest.raises(RequestError) as info:
        vl.chat(conversations, GREEDY, use_tqdm=False)
    outs = info.value.outputs
    assert len(outs) == 7
    for i, (_, match) in bad.items():
        assert match in outs[i].error and outs[i].outputs[0].finish_reason == "error", (
            i, outs[i].error)
        assert f"request {i}: " in str(info.value)
    for i, conversation in good.items():
        alone = vl.chat(conversation, GREEDY, use_tqdm=False)[0]
        assert outs[i].error is None and outs[i].outputs[0].token_ids == alone.outputs[
            0].token_ids, i
        assert len(alone.outputs[0].token_ids) == 4
    assert sorted(i for i, o in enumerate(outs) if o.error) == sorted(bad)
    assert_block_pool_empty(vl)


def test_chat_with_only_bad_conversations_and_per_conversation_params(vl):
    with pytest.raises(RequestError, match=r"^request 0: .*special vision token"):
        vl.chat([user("<|vision_start|>")], GREEDY, use_tqdm=False)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    with pytest.raises(RequestError) as info:
        vl.chat([user([{"type": "audio"}]), user("Hello there.")], params, use_tqdm=False)
    # the second conversation kept its own params
    assert len(info.value.outputs[1].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 conversations"):
        vl.chat([user([{"type": "audio"}]), user("Hello there.")], [GREEDY], use_tqdm=False)
    assert_block_pool_empty(vl)


# ---- torch's global RNG ----
def test_llm_leaves_the_global_rng_alone(qwen3_checkpoint, tiny_vl_with_context):
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    text = LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=4 << 20)
    first = text.generate([[3, 4, 5], [6, 7]], sampled, use_tqdm=False)
    # the vision tower's position embedding included
    vision = LLM(tiny_vl_with_context(2048), **ENGINE)
    vision.chat(
        user([{"type": "image", "image": picture(64, 64, seed=1)}, {"type": "text", "text": "Hi"}]),
        sampled, use_tqdm=False)
    assert torch.equal(torch.random.get_rng_state(), before)
    # The engine's draws come from its own generators: another global state, the same tokens.
    torch.manual_seed(99)
    again = LLM(qwen3_checkpoint[0], dtype="float32", kv_cache_bytes=4 << 20)
    second = again.generate([[3, 4, 5], [6, 7]], sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]


# ---- image URLs: the server's fetch ----
@pytest.fixture
def image_server(monkeypatch):
    """Proxies in the environment point at a dead port: a fetch that used them would fail."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                 "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    image = picture(48, 64, seed=5)
    server = ImageServer(png(image))
    yield server, image
    server.close()


def test_allow_image_urls_checks_addresses_like_the_server(tiny_vl_with_context, image_server):
    server, image = image_server
    llm = LLM(tiny_vl_with_context(2048), allow_image_urls=True, **ENGINE)
    url_part = {"type": "image_url", "image_url": {"url": f"{server.url}/x.png"}}
    with pytest.raises(
            RequestError, match="image 0: image URL host '127.0.0.1' resolves to the non-public "
            "address 127.0.0.1"):
        llm.chat(user([url_part, {"type": "text", "text": "What is it?"}]), GREEDY, use_tqdm=False)
    assert_block_pool_empty(llm)
    with pytest.raises(
            ValueError,
            match="allow_image_urls must be True, False or a vlinfer.multimodal.UrlPolicy"):
        LLM(tiny_vl_with_context(2048), allow_image_urls="yes", **ENGINE)


def test_a_url_policy_fetches_without_env_proxies(tiny_vl_with_context, image_server):
    server, image = image_server
    llm = LLM(tiny_vl_with_context(2048), allow_image_urls=UrlPolicy(allow_private=True,
                                                                     timeout=10), **ENGINE)
    url_part = {"type": "image_url", "image_url": {"url": f"{server.url}/x.png"}}
    fetched = llm.chat(user([url_part, {"type": "text", "text": "What is it?"}]), GREEDY,
                       use_tqdm=False)[0]
    inline = llm.chat(
        user([{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]), GREEDY,
        use_tqdm=False)[0]
    assert fetched.outputs[0].token_ids == inline.outputs[
        0].token_ids and fetched.images == inline.images


def test_the_shared_fetch_limits_bytes_and_time(image_server):
    server, image = image_server
    data = png(image)
    private = dict(allow_private=True)
    assert fetch_image_url_sync(f"{server.url}/x.png", UrlPolicy(**private)) == data
    with pytest.raises(UrlFetchError,
                       match=f"image URL body is {len(data)} bytes, over the limit of 100"):
        fetch_image_url_sync(f"{server.url}/x.png", UrlPolicy(max_bytes=100, **private))
    with pytest.raises(UrlFetchError, match="took longer than 0.3s"):
        fetch_image_url_sync(f"{server.url}/slow.png", UrlPolicy(timeout=0.3, **private))
    assert not server.release.is_set()  # the limit ended the fetch, not the server answering
    with pytest.raises(UrlFetchError, match="is not in the allowed hosts"):
        fetch_image_url_sync(f"{server.url}/x.png",
                             UrlPolicy(allowed_hosts=("example.com", ), **private))


def test_the_server_fetches_through_the_same_function(image_server):
    server, image = image_server
    policy = ImagePolicy(allowed_url_hosts=("127.0.0.1",), allow_private_urls=True, url_timeout=5.0,
                         max_image_bytes=1 << 20)
    assert policy.url_policy == UrlPolicy(
        allowed_hosts=("127.0.0.1", ), allow_private=True, timeout=5.0, max_bytes=1 << 20,
        max_redirects=3, allowlist_name="this server's allowlist (--allowed-url-hosts)")
    # env proxies ignored here too
    assert asyncio.run(fetch_url(f"{server.url}/x.png", policy)) == png(image)
    with pytest.raises(Exception, match="non-public address 127.0.0.1") as info:
        asyncio.run(fetch_url(f"{server.url}/x.png", ImagePolicy(allowed_url_hosts=("*",))))
    assert info.value.status == 400


# ---- validation that `python -O` keeps ----
def test_no_assert_statements_in_the_package():
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "vlinfer")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                tree = ast.parse(open(path).read())
                found += [f"{os.path.relpath(path, ROOT)}:{n.lineno}" for n in ast.walk(tree)
                          if isinstance(n, ast.Assert)]
    assert found == []


def test_block_double_free_raises_under_python_O():
    script = """
from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.sequence import Sequence
from vlinfer.sampling_params import SamplingParams
bm = BlockManager(4, 4)
seq = Sequence(list(range(6)), SamplingParams())
if not bm.allocate(seq, 6):  # not an assert: -O would drop the call with it
    raise SystemExit("no blocks")
stale = list(seq.block_table)
bm.free(seq)
seq.block_table = stale
try:
    bm.free(seq)
except RuntimeError as e:
    print("raised:", e)
"""
    res = subprocess.run([sys.executable, "-O", "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith("raised: KV block ") and "freed twice" in res.stdout


def _checkpoint_with_config(tmp_path, family: str, **changes) -> str:
    path = str(tmp_path / family)
    build_checkpoint(path, tiny_text_config(family, tie=True))
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


def test_a_checkpoint_that_disagrees_with_its_config_names_the_weight(tmp_path):
    # the weights were saved with 128
    path = _checkpoint_with_config(tmp_path, "qwen3", intermediate_size=96)
    with pytest.raises(
            ValueError,
            match=r"checkpoint tensor 'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight': "
            r"shape mismatch: "):
        LLM(path, dtype="float32", kv_cache_bytes=4 << 20)


@pytest.mark.parametrize("tensor", [
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.embed_tokens.weight"
])
def test_a_weight_too_large_for_its_slice_is_refused_not_cut(monkeypatch, qwen3_checkpoint, tensor):
    """Fused and vocabulary layers load slices of the checkpoint tensor: a larger tensor must be
    refused, not narrowed to the parameter's size."""
    from vlinfer import loading
    from vlinfer.engine.build_model import load_model
    from vlinfer.layers import ModelContext
    from vlinfer.ops.reference import ReferenceOps
    source = loading.resolve_model(qwen3_checkpoint[0])
    hf_config = loading.load_config(source)
    good = dict(loading.iterate_weights(source, hf_config))
    grown = torch.cat([good[tensor], good[tensor][:1]])  # one row more than the config says
    monkeypatch.setattr(
        loading, "iterate_weights",
        lambda *a, **k: iter([(n, grown if n == tensor else t) for n, t in good.items()]))
    with pytest.raises(
            ValueError, match=f"checkpoint tensor {tensor!r}: shape mismatch: checkpoint "
            rf"\({grown.shape[0]}, {grown.shape[1]}\) has {grown.shape[0]} rows"):
        load_model(source, hf_config, torch.device("cpu"), ModelContext(ReferenceOps()))

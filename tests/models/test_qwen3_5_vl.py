"""Qwen3.5 with vision (Qwen3_5ForConditionalGeneration, and the MoE variant) through the whole
engine against transformers, float32, on a tiny random checkpoint: Qwen3-VL's tower without
DeepStack, the hybrid decoder with interleaved multimodal rotary over a partial rotary head.
Prompt logits of an image request and of a text one; an image request and a text request
batched together generate transformers' greedy tokens, in one step and in chunks; a video clip
(Qwen3-VL's timestamps and frame groups) the same."""
import json

import pytest
import torch

from engine_checks import assert_block_pool_empty
from images import picture
from vlinfer import LLM, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.toy.tiny_checkpoints import (QWEN3_VL_SPECIAL, _rescale,
                                          write_qwen3_vl_processor_files)
from qwen3_vl_engine_cases import PROMPT_0, PROMPT_1, hf_greedy, hf_inputs
from video_cases import ASK, CLIP_ODD, HUB_VIDEO_CONFIG, META_ODD, V
from video_cases import hf_inputs as hf_video_inputs
from qwen3_5_vl_cases import MOE, TEXT, VISION

NUM_NEW = 16
CASES = [(PROMPT_1, [picture(120, 160, 1)]), (PROMPT_0, [])]


@pytest.fixture(scope="module", params=["Qwen3_5", "Qwen3_5Moe"])
def checkpoint(request, tmp_path_factory):
    import transformers
    config_class = getattr(transformers, f"{request.param}Config")
    model_class = getattr(transformers, f"{request.param}ForConditionalGeneration")
    text = dict(TEXT, **MOE) if request.param == "Qwen3_5Moe" else dict(TEXT)
    config = config_class(vision_config=VISION, text_config=text, tie_word_embeddings=False,
                          architectures=[model_class.__name__], **QWEN3_VL_SPECIAL)
    with torch.random.fork_rng(devices=[]):
        model = model_class(config).eval()
    _rescale(model, torch.Generator().manual_seed(3))
    if request.param == "Qwen3_5Moe":
        model.set_experts_implementation("eager")
    folder = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(folder, safe_serialization=True)
    write_qwen3_vl_processor_files(folder)
    with open(f"{folder}/video_preprocessor_config.json", "w") as f:
        json.dump(HUB_VIDEO_CONFIG, f)  # the hub's sizes: both engines read it, clips stay small
    return folder, model


def test_prompt_logits_and_mixed_batch_match_transformers(checkpoint):
    folder, model = checkpoint
    llm = LLM(folder, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024)
    engine = llm.engine
    assert engine.resolved.num_state_slots > 0
    expected = []
    for text, images in CASES:
        seq = engine.make_sequence({"prompt": text, "multi_modal_data": {"image": images}})
        engine.add_sequence(seq)
        assert engine.block_manager.allocate(seq, seq.num_tokens)
        ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
        ids, kwargs = hf_inputs(llm, text, images)
        assert ids[0].tolist() == seq.token_ids
        with torch.no_grad():
            ref = model(input_ids=ids, **kwargs).logits[0]
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
        engine.abort_request(seq.request_id)
        expected.append(hf_greedy(model, ids, kwargs, NUM_NEW))
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
                for text, images in CASES]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(requests, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_nothing_held(llm)
    # chunks of 16 tokens: the image's rows and the linear layers' state carry across chunks
    chunked = LLM(folder, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024,
                  max_num_batched_tokens=16)
    outs = chunked.generate(requests, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_nothing_held(chunked)


def test_video_logits_and_greedy_match_transformers(checkpoint):
    """A clip of 10 frames at 4 fps (sampled to 5, padded to 3 groups of two) on Qwen3.5: the
    prompt ids (timestamps, outer vision tokens) of transformers' processor, float32 prompt
    logits within 1e-4 relative, and greedy tokens equal, alone and batched with a text request,
    in one step and in chunks of 16 tokens (a group's tokens across two steps, the linear
    layers' state carried)."""
    folder, model = checkpoint
    text, videos = ASK.format(V), [(CLIP_ODD, META_ODD)]
    request = {"prompt": text, "multi_modal_data": {"video": videos}}
    llm = LLM(folder, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024)
    engine = llm.engine
    seq = engine.make_sequence(request)
    engine.add_sequence(seq)
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    engine.abort_request(seq.request_id)
    ids, kwargs = hf_video_inputs(folder, text, [], videos)
    assert ids[0].tolist() == seq.token_ids and "pixel_values_videos" in kwargs
    with torch.no_grad():
        ref = model(input_ids=ids, **kwargs).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    text_ids, text_kwargs = hf_inputs(llm, CASES[1][0], [])
    expected = [hf_greedy(model, ids, kwargs, NUM_NEW),
                hf_greedy(model, text_ids, text_kwargs, NUM_NEW)]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    for engine_llm in (llm, LLM(folder, dtype="float32", kv_cache_bytes=32 * 2 ** 20,
                                max_model_len=1024, max_num_batched_tokens=16)):
        outs = engine_llm.generate([request, CASES[1][0]], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert outs[0].videos[0]["grid_thw"] == kwargs["video_grid_thw"][0].tolist()
        assert_nothing_held(engine_llm)


def assert_nothing_held(llm):
    assert_block_pool_empty(llm)
    bm = llm.engine.block_manager
    assert bm.num_free_slots == bm.num_state_slots


def test_repeated_image_prompt_hits_its_checkpoint_and_stays_exact(checkpoint):
    """Prefix caching (docs/hybrid.md): the image request again hits the blocks up to the last
    boundary before its last token, image-keyed, its linear layers restored from the checkpoint
    there: logits and greedy tokens are transformers'. The same text with another picture of the
    same size (the same token ids) hits nothing past the blocks before its image."""
    from hybrid_prefix_cache_cases import prefill_logits
    folder, model = checkpoint
    llm = LLM(folder, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024,
              kvcache_block_size=16)
    text, images = CASES[0]
    request = {"prompt": text, "multi_modal_data": {"image": images}}
    ids, kwargs = hf_inputs(llm, text, images)
    with torch.no_grad():
        ref = model(input_ids=ids, **kwargs).logits[0]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    first = llm.generate([request], greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    last = (ids.shape[1] - 1) // 16 * 16
    ours, seq = prefill_logits(llm.engine, request)
    assert seq.num_cached_tokens == last > 0
    assert ((ours - ref[last:]).abs().max() / ref.abs().max()).item() < 1e-4
    again = llm.generate([request], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == last
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(
        model, ids, kwargs, NUM_NEW)
    other = {"prompt": text, "multi_modal_data": {"image": [picture(120, 160, 2)]}}
    out = llm.generate([other], greedy, use_tqdm=False)[0]
    assert out.prompt_token_ids == first.prompt_token_ids
    image_start = seq.mm_items[0].offset
    assert out.num_cached_tokens <= image_start // 16 * 16
    assert_nothing_held(llm)
    assert llm.reset_prefix_cache() and not llm.engine.block_manager.checkpoints


def test_language_model_only_builds_no_tower_and_refuses_media(checkpoint):
    """language_model_only=True (vLLM's --language-model-only): no vision parameter exists, the
    tower's tensors are never read, text prompts give the full model's (transformers') logits
    and greedy tokens, and an image or video request is refused by name while a text request
    beside it runs on."""
    folder, model = checkpoint
    opts = dict(dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024)
    llm = LLM(folder, language_model_only=True, **opts)
    engine = llm.engine
    ours_model = engine.model_runner.model
    assert ours_model.model.visual is None and not engine.is_multimodal
    assert not [n for n, _ in ours_model.named_parameters() if "visual" in n]
    vision_bytes = sum(p.numel() * p.element_size() for p in model.model.visual.parameters())
    text_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if not n.startswith("model.visual."))
    assert sum(p.numel() * p.element_size() for p in ours_model.parameters()) == text_bytes
    full_read = LLM(folder, **opts).engine.model_runner.checkpoint_bytes_read
    assert full_read - engine.model_runner.checkpoint_bytes_read == vision_bytes > 0
    # text prompts: the full model's logits and tokens
    text = CASES[1][0]
    seq = engine.make_sequence(text)
    engine.add_sequence(seq)
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    engine.abort_request(seq.request_id)
    ids, kwargs = hf_inputs(llm, text, [])
    assert ids[0].tolist() == seq.token_ids
    with torch.no_grad():
        ref = model(input_ids=ids, **kwargs).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    expected = hf_greedy(model, ids, kwargs, NUM_NEW)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    # media refused by name, the text request beside them unharmed
    chat = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                         {"type": "text", "text": "What happens?"}]}]
    with pytest.raises(ValueError, match=r"language_model_only=True .* does not accept videos"):
        llm.chat(chat, greedy, use_tqdm=False)
    engine.add_request(text, greedy, "text")
    engine.step()
    image = {"prompt": CASES[0][0], "multi_modal_data": {"image": CASES[0][1]}}
    with pytest.raises(ValueError, match=r"language_model_only=True .* does not accept images"):
        engine.add_request(image, greedy, "image")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert finished == {"text": expected}
    assert_nothing_held(llm)


def test_qwen3_vl_language_model_only_builds_no_tower():
    """The same switch on Qwen3-VL (models/qwen3_vl.py holds_tower): no tower, no vision
    parameter, the decoder whole."""
    from transformers import Qwen3VLConfig
    from vlinfer.layers import ModelContext
    from vlinfer.models import Heads
    from vlinfer.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from vlinfer.ops.reference import ReferenceOps
    text = dict(vocab_size=151936, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [6, 5, 5], "mrope_interleaved": True})
    config = Qwen3VLConfig(vision_config=dict(VISION, deepstack_visual_indexes=[0]),
                           text_config=text, **QWEN3_VL_SPECIAL)
    ctx = ModelContext(ReferenceOps())
    with torch.device("meta"):
        full = Qwen3VLForConditionalGeneration(config, ctx)
        text_only = Qwen3VLForConditionalGeneration(config, ctx, Heads(vision_tower=False))
    assert full.holds_vision_tower and not text_only.holds_vision_tower
    names = {n for n, _ in full.named_parameters()}
    assert {n for n, _ in text_only.named_parameters()} == {
        n for n in names if not n.startswith("model.visual.")} != names


def test_speculation_with_an_image_on_the_hybrid_target(checkpoint, monkeypatch):
    """Speculative decoding on Qwen3.5 with vision (docs/speculative.md "Hybrid targets"): an
    image request and a text one batched, proposals of transformers' own continuation with one
    token wrong in two steps of three (accepted, rejected and partly accepted verifications, the
    image request's state put back after each rejection): greedy tokens are transformers'."""
    from vlinfer.engine.speculative import speculator
    folder, model = checkpoint
    llm = LLM(folder, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False})
    expected, prompts = [], []
    for text, images in CASES:
        ids, kwargs = hf_inputs(llm, text, images)
        prompts.append(ids[0].tolist())
        expected.append(hf_greedy(model, ids, kwargs, NUM_NEW))
    calls = [0]

    def propose(token_ids, k, min_n, max_n, never):
        for prompt, tokens in zip(prompts, expected):
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                proposal = list(tokens[done:done + k])
                calls[0] += 1
                if 0 <= calls[0] % 3 - 1 < len(proposal):
                    proposal[calls[0] % 3 - 1] += 1
                return proposal
        return []
    monkeypatch.setattr(speculator, "propose_ngram", propose)
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
                for text, images in CASES]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(requests, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.speculator
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert_nothing_held(llm)


def test_mtp_with_an_image_on_the_hybrid_target(checkpoint, tmp_path):
    """MTP speculation (docs/speculative.md "MTP") on Qwen3.5 with vision: the checkpoint with an
    `mtp.*` head written beside it (random, so most proposals fail), an image request batched with
    a text one: greedy tokens are transformers', proposals were verified (the image request's
    state put back after each rejection), the head's catch-up ran over the image's rows, and
    nothing is held after."""
    import shutil
    from vlinfer.toy.mtp_heads import TorchMTP, save_mtp
    folder, model = checkpoint
    with_head = str(tmp_path / "with_head")
    shutil.copytree(folder, with_head)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        save_mtp(with_head, TorchMTP(model))
    llm = LLM(with_head, dtype="float32", kv_cache_bytes=32 * 2 ** 20, max_model_len=1024,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                  "adaptive": False})
    expected = []
    for text, images in CASES:
        ids, kwargs = hf_inputs(llm, text, images)
        expected.append(hf_greedy(model, ids, kwargs, NUM_NEW))
    requests = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
                for text, images in CASES]
    seen = []
    head = llm.engine.model_runner.mtp
    catch_up = head.catch_up
    head.catch_up = lambda plan, ids, hidden, mm: seen.append(bool(mm)) or catch_up(
        plan, ids, hidden, mm)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(requests, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.speculator
    assert s.num_drafts > 0 and s.num_accepted_tokens < s.num_draft_tokens
    assert any(seen)  # a catch-up of a step with image rows got them
    assert_nothing_held(llm)

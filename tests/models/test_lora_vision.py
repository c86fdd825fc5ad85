"""LoRA on Qwen3-VL's vision tower and mergers as well as its language model: adapters made by peft
itself (random non-zero B), run by the engine against transformers + PEFT on the same weights,
float32: prompt logits within 1e-4 and greedy tokens equal for an image prompt and a video prompt
(and on Qwen3-VL-MoE, the same vision code); a language-only, a vision+language and a vision-only
adapter and the base model mixed in one batch (one packed vision pass, each image's patch rows under
its own adapter), chunked; and the encoder cache keyed by the vision adapter: the same image is
encoded again under a vision adapter, never under a language-only one."""
import json

import pytest
import torch

from engine_checks import assert_block_pool_empty
from images import picture
from vlinfer import LLM, LoRARequest, RequestError, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.toy.tiny_checkpoints import _rescale, build_tiny_qwen3_vl
from lora_cases import make_adapter
from moe_model_cases import IMG_B, IMG_C, PROMPT_TWO, qwen3_vl_moe_config, save_with_layout
from moe_model_cases import hf_inputs as moe_hf_inputs
from video_cases import ASK, CLIP_ODD, HUB_VIDEO_CONFIG, META_ODD, V, hf_inputs, request
from lora_vision_cases import TEXT, VISION

NUM_NEW = 16
I = "<|vision_start|><|image_pad|><|vision_end|>"
IMG = picture(96, 128, 1)
# (prompt, images, videos): an image prompt and a video prompt (three temporal groups of a clip).
CASES = {
    "image": (ASK.format("Look: " + I), [IMG], []),
    "video": (ASK.format(V), [], [(CLIP_ODD, META_ODD)])
}
# name -> (rank, alpha, rslora, targets, seed)
ADAPTERS = {"text": (8, 16, False, TEXT, 1), "both": (8, 16, False, f"{VISION}|{TEXT}", 2),
            "eyes": (4, 8, True, VISION, 3)}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration
    path = build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("vl")), seed=0,
                               tie_word_embeddings=False)
    with open(f"{path}/video_preprocessor_config.json", "w") as f:
        json.dump(HUB_VIDEO_CONFIG, f)
    adapters = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        base = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        adapters[name] = LoRARequest(name, i + 1,
                                     make_adapter(base, str(tmp_path_factory.mktemp(name)), *spec))
    return path, adapters


def peft_model(path: str, adapter: LoRARequest | None):
    from peft import PeftModel
    from transformers import Qwen3VLForConditionalGeneration
    model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return PeftModel.from_pretrained(model,
                                     adapter.lora_path).eval() if adapter is not None else model


@pytest.fixture(scope="module")
def references(setup):
    """(adapter name or None, case) -> (transformers' prompt logits, its NUM_NEW greedy tokens)."""
    path, adapters = setup
    refs = {}
    for name in [None, *adapters]:
        model = peft_model(path, adapters.get(name))
        for case, (text, images, videos) in CASES.items():
            ids, kwargs = hf_inputs(path, text, images, videos)
            with torch.no_grad():
                logits = model(input_ids=ids, **kwargs).logits[0]
                out = model.generate(ids, max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                     do_sample=False, **kwargs)
            refs[(name, case)] = logits, out[0, ids.shape[1]:].tolist()
    return refs


def make_llm(path, **kw):
    options = dict(dtype="float32", kv_cache_bytes=32 * 2**20, max_model_len=2048, enable_lora=True,
                   max_loras=3, max_lora_rank=8)
    return LLM(path, **{**options, **kw})


def test_vision_adapters_equal_peft_on_images_and_video(setup, references):
    path, adapters = setup
    llm = make_llm(path)
    engine = llm.engine
    assert "model.visual.blocks.0.attn.qkv" in engine.model_runner.lora.layers
    for name in [None, *adapters]:
        lora = adapters.get(name)
        for case, (text, images, videos) in CASES.items():
            seq = engine.make_sequences(request(text, images, videos), lora_request=lora)[0]
            assert (seq.vision_lora is not None) == (name in ("both", "eyes"))
            engine.add_sequence(seq)  # holds its images in the encoder cache
            assert engine.block_manager.allocate(seq, seq.num_tokens)
            ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
            ref_logits, _ = references[(name, case)]
            assert ((ours - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-4, (name,
                                                                                              case)
            engine.abort_request(seq.request_id)
        outs = llm.generate([request(*c) for c in CASES.values()], GREEDY, use_tqdm=False,
                            lora_request=lora)
        assert [o.outputs[0].token_ids for o in outs] == [references[(name, c)][1]
                                                          for c in CASES], name
    for case in CASES:  # each adapter changes transformers' answer, the vision-only one included
        answers = [references[(name, case)][1] for name in [None, *adapters]]
        assert len({tuple(a) for a in answers}) == len(answers), case
    assert len(engine.model_runner.encoder_cache) == 0
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunk16"])
def test_mixed_batch_equals_each_alone(setup, references, options):
    """The base model and the three adapters on the same image and the same clip, all in one batch:
    the vision pass packs the base's images (shared with the language-only adapter's) and each
    vision adapter's own copy."""
    path, adapters = setup
    llm = make_llm(path, **options)
    names = [None, "text", "both", "eyes"] * 2
    cases = ["image"] * 4 + ["video"] * 4
    outs = llm.generate([request(*CASES[c]) for c in cases], GREEDY, use_tqdm=False,
                        lora_request=[adapters.get(n) for n in names])
    assert [o.outputs[0].token_ids
            for o in outs] == [references[(n, c)][1] for n, c in zip(names, cases)]
    # The image and the clip's three groups, encoded once for the base and the language-only adapter
    # together and once under each vision adapter.
    assert llm.engine.model_runner.vision.num_images_encoded == 3 * (1 + 3)
    assert len(llm.engine.model_runner.encoder_cache) == 0
    assert_block_pool_empty(llm)


def test_same_image_is_encoded_again_under_a_vision_adapter_only(setup, references):
    path, adapters = setup
    llm = make_llm(path)
    engine, runner = llm.engine, llm.engine.model_runner
    prompt = request(*CASES["image"])
    # (adapter, images encoded after it)
    steps = [(None, 1), ("both", 2), ("text", 2), ("eyes", 3), ("both", 3)]
    ids = []
    for name, encoded in steps:  # each admitted while the ones before still hold their encodings
        ids.append(engine.add_request(prompt, GREEDY, lora_request=adapters.get(name)))
        engine.step()
        assert runner.vision.num_images_encoded == encoded, name
    assert len(runner.encoder_cache) == 3  # the base's (shared with "text"), "both"'s and "eyes"'s
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    assert [finished[i] for i in ids] == [references[(n, "image")][1] for n, _ in steps]
    assert len(runner.encoder_cache) == 0 and runner.vision.num_images_encoded == 3
    assert_block_pool_empty(llm)


@pytest.mark.slow  # two processes: `make test-full` and CI run it
def test_tensor_parallel_vision_adapters_equal_peft(setup, references):
    """TP=2: the vision tower and its adapters' slots live on rank 0 alone (the worker installs only
    its shard of the language model's part of each adapter)."""
    path, adapters = setup
    names = [None, "text", "both", "eyes"]
    with make_llm(path, tensor_parallel_size=2) as llm:
        outs = llm.generate([request(*CASES["image"])] * 4, GREEDY, use_tqdm=False,
                            lora_request=[adapters.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [references[(n, "image")][1] for n in names]


def test_qwen3_vl_moe_vision_adapter_equals_peft(tmp_path):
    """Qwen3-VL-MoE runs the same vision tower: a vision + attention adapter's image prompt logits
    as PEFT's."""
    from peft import PeftModel
    from transformers import Qwen3VLMoeForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        model = Qwen3VLMoeForConditionalGeneration(qwen3_vl_moe_config()).eval()
    _rescale(model, torch.Generator().manual_seed(0))
    path = save_with_layout(model, str(tmp_path / "moe"), "fused")
    attention = r"model\.language_model\.layers\.\d+\.self_attn\.[qv]_proj"
    lora = LoRARequest("moe-eyes", 1, make_adapter(model, str(tmp_path / "adapter"), 8, 16, False,
                                                  f"{VISION}|{attention}", 4))
    reference = Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    reference.set_experts_implementation("eager")
    reference = PeftModel.from_pretrained(reference, lora.lora_path).eval()
    llm = make_llm(path, kv_cache_bytes=16 * 2 ** 20, max_model_len=1024)
    engine = llm.engine
    images = [IMG_B, IMG_C]
    seq = engine.make_sequences({"prompt": PROMPT_TWO, "multi_modal_data": {"image": images}},
                                lora_request=lora)[0]
    engine.add_sequence(seq)
    assert seq.vision_lora == lora and engine.block_manager.allocate(seq, seq.num_tokens)
    ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    ids, kwargs = moe_hf_inputs(path, PROMPT_TWO, images)
    with torch.no_grad():
        ref = reference(input_ids=ids, **kwargs).logits[0]
        base = model(input_ids=ids, **kwargs).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert ((base - ref).abs().max() / ref.abs().max()).item() > 1e-2  # the adapter matters
    engine.abort_request(seq.request_id)
    assert_block_pool_empty(llm)


def test_a_patch_embedding_adapter_equals_peft_and_a_bad_conv_is_refused(setup, references,
                                                                          tmp_path):
    """PEFT adapts the patch embedding (a Conv3d) with a conv A of the base's kernel and stride and
    a 1x1x1 conv B: the engine runs it as the flattened patch's matmul, an adapter on it alone
    equal to PEFT's logits. A conv B of a larger kernel is refused by name, the others run."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLForConditionalGeneration
    path, adapters = setup
    base = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    conv = LoRARequest("conv", 9, make_adapter(base, str(tmp_path / "conv"), 4, 8, False,
                                               r"model\.visual\.patch_embed\.proj", 5))
    llm = make_llm(path)
    engine = llm.engine
    seq = engine.make_sequences(request(*CASES["image"]), lora_request=conv)[0]
    assert seq.vision_lora == conv
    engine.add_sequence(seq)
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    ours = engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    engine.abort_request(seq.request_id)
    ids, kwargs = hf_inputs(path, *CASES["image"])
    with torch.no_grad():
        ref = peft_model(path, conv)(input_ids=ids, **kwargs).logits[0]
    base_logits = references[(None, "image")][0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert ((base_logits - ref).abs().max() / ref.abs().max()).item() > 1e-3  # it matters
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "adapter_config.json").write_text((tmp_path / "conv" / "adapter_config.json")
                                              .read_text())
    tensors = load_file(str(tmp_path / "conv" / "adapter_model.safetensors"))
    tensors = {k: v.repeat(1, 1, 2, 1, 1) if "lora_B" in k else v for k, v in tensors.items()}
    save_file(tensors, str(wide / "adapter_model.safetensors"))
    with pytest.raises(RequestError) as e:
        llm.generate([request(*CASES["image"])] * 2, GREEDY, use_tqdm=False,
                     lora_request=[LoRARequest("wide", 10, str(wide)), adapters["eyes"]])
    outs = e.value.outputs
    assert "model.visual.patch_embed.proj" in outs[0].error
    assert "nor a patch conv's" in outs[0].error
    assert outs[1].outputs[0].token_ids == references[("eyes", "image")][1]
    assert_block_pool_empty(llm)

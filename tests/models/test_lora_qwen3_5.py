"""LoRA on Qwen3.5 (text, MoE text, with vision) against transformers + PEFT on the same tiny
random weights, float32: adapters made by peft itself (random non-zero B) on the full-attention
projections, the Gated DeltaNet ones (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, fused into
one matmul in the engine, and out_proj) and the MLP; prompt logits within 1e-4 per sequence and
greedy tokens equal, per adapter and with two adapters and the base model mixed in one batch,
chunked (the state slots carry each sequence's adapter-dependent state). On Qwen3.5 with vision,
the tower's linears and its patch embedding's Conv3d too."""
import pytest
import torch

from engine_checks import assert_block_pool_empty
from images import picture
from vlinfer import LLM, LoRARequest, SamplingParams
from vlinfer.engine import SchedulerOutput
from vlinfer.toy.tiny_checkpoints import (QWEN3_VL_SPECIAL, _rescale,
                                          write_qwen3_vl_processor_files)
from lora_cases import make_adapter
from qwen3_5_text_cases import PROMPTS, qwen3_5_moe_config, save, text_config
from qwen3_5_vl_cases import MOE, TEXT, VISION
from qwen3_vl_engine_cases import PROMPT_0, PROMPT_1, hf_inputs

NUM_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
LINEAR_ATTN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", *LINEAR_ATTN, "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rslora, targets, seed)
ADAPTERS = {"all": (8, 16, False, ALL, 1), "linear": (4, 8, True, LINEAR_ATTN, 2)}


def peft_model(model_class, path: str, adapter: LoRARequest | None, moe: bool = False):
    from peft import PeftModel
    model = model_class.from_pretrained(path, dtype=torch.float32).eval()
    if moe:
        model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None  # as ignore_eos
    return PeftModel.from_pretrained(model, adapter.lora_path).eval() if adapter else model


def make_llm(path, **kw):
    options = dict(dtype="float32", kv_cache_bytes=16 * 2 ** 20, max_model_len=256,
                   max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8)
    return LLM(path, **{**options, **kw})


def engine_logits(llm, prompt, lora) -> torch.Tensor:
    engine = llm.engine
    seq = engine.make_sequences(prompt, lora_request=lora)[0]
    engine.add_sequence(seq)
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    try:
        return engine.model_runner.prompt_logits(SchedulerOutput([seq], [seq.num_tokens]))
    finally:
        engine.abort_request(seq.request_id)


def relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def text_setup(model_class, config, folder, tmp_path_factory, adapters, moe=False):
    """(folder, {name: LoRARequest}, {(name, prompt index): (logits, greedy tokens)})."""
    with torch.random.fork_rng(devices=[]):
        model = model_class(config).eval()
    _rescale(model, torch.Generator().manual_seed(0))
    save(model, folder)
    loras = {}
    for i, (name, spec) in enumerate(adapters.items()):
        base = model_class.from_pretrained(folder, dtype=torch.float32)
        loras[name] = LoRARequest(name, i + 1,
                                  make_adapter(base, str(tmp_path_factory.mktemp(name)), *spec))
    refs = {}
    for name in [None, *loras]:
        reference = peft_model(model_class, folder, loras.get(name), moe)
        for i, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                logits = reference(input_ids=ids).logits[0]
                out = reference.generate(input_ids=ids, max_new_tokens=NUM_NEW, do_sample=False)
            refs[(name, i)] = logits, out[0, ids.shape[1]:].tolist()
    return folder, loras, refs


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM
    return text_setup(Qwen3_5ForCausalLM, text_config(),
                      str(tmp_path_factory.mktemp("qwen3_5")), tmp_path_factory, ADAPTERS)


def assert_equal_peft(llm, loras, refs):
    for name in [None, *loras]:
        for i, prompt in enumerate(PROMPTS):
            ours = engine_logits(llm, prompt, loras.get(name))
            assert relative(ours, refs[(name, i)][0]) < 1e-4, (name, i)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras.get(name))
        assert [o.outputs[0].token_ids for o in outs] == [refs[(name, i)][1]
                                                          for i in range(len(PROMPTS))], name
    for i in range(len(PROMPTS) - 1):  # each adapter changes PEFT's logits (the 1-token one too)
        for name in loras:
            assert relative(refs[(None, i)][0], refs[(name, i)][0]) > 1e-3, (name, i)


def test_linear_attention_adapters_equal_peft(dense):
    folder, loras, refs = dense
    llm = make_llm(folder)
    layers = llm.engine.model_runner.lora.layers
    assert "model.layers.0.linear_attn.in_proj" in layers  # in_proj_qkv / z / b / a, fused
    assert "model.layers.0.linear_attn.out_proj" in layers
    assert_equal_peft(llm, loras, refs)
    assert_block_pool_empty(llm)


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}], ids=["whole", "chunk16"])
def test_mixed_batch_equals_each_alone(dense, options):
    """Both adapters and the base model interleaved in one call: each sequence's linear layers
    run its own adapter into its own state slot, in one step and across 16-token chunks."""
    folder, loras, refs = dense
    llm = make_llm(folder, **options)
    names = [None, "all", "linear"] * 2
    picks = [i % len(PROMPTS) for i in range(len(names))]
    outs = llm.generate([PROMPTS[i] for i in picks], GREEDY, use_tqdm=False,
                        lora_request=[loras.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [refs[(n, i)][1]
                                                      for n, i in zip(names, picks)]
    assert_block_pool_empty(llm)


def test_moe_adapters_equal_peft(tmp_path_factory):
    """Qwen3.5-MoE: the attention, linear-attention and shared-expert projections (the routed
    experts are one fused tensor in transformers, which PEFT's LoRA does not target)."""
    from transformers import Qwen3_5MoeForCausalLM
    targets = r".*\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_\w+|out_proj)|" \
              r"mlp\.shared_expert\.(gate|up|down)_proj|mlp\.shared_expert_gate)"
    folder, loras, refs = text_setup(
        Qwen3_5MoeForCausalLM, qwen3_5_moe_config(), str(tmp_path_factory.mktemp("moe")),
        tmp_path_factory, {"moe": (8, 16, False, targets, 4)}, moe=True)
    llm = make_llm(folder)
    assert "model.layers.1.mlp.shared_expert_gate" in llm.engine.model_runner.lora.layers
    assert_equal_peft(llm, loras, refs)
    assert_block_pool_empty(llm)


# the tower's linears and its patch embedding (a Conv3d), and the decoder's linear-attention ones
VISION_TARGETS = (r"model\.visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
                  r"|merger\.linear_fc[12]|patch_embed\.proj)")
DECODER_TARGETS = r"model\.language_model\.layers\.\d+\.linear_attn\.(in_proj_\w+|out_proj)"
VL_ADAPTERS = {"eyes": (8, 16, False, VISION_TARGETS, 5),
               "both": (4, 8, True, f"{VISION_TARGETS}|{DECODER_TARGETS}", 6)}
VL_CASES = [(PROMPT_1, [picture(120, 160, 1)]), (PROMPT_0, [])]


@pytest.mark.parametrize("family", ["Qwen3_5", "Qwen3_5Moe"])
def test_vision_tower_adapters_equal_peft(family, tmp_path):
    """Qwen3.5 with vision: adapters on the tower (patch embedding included) and on the decoder;
    an image prompt's and a text prompt's logits as PEFT's, then both adapters and the base model
    mixed in one batch, greedy as PEFT's."""
    import transformers
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}ForConditionalGeneration")
    text = dict(TEXT, **MOE) if family == "Qwen3_5Moe" else dict(TEXT)
    config = config_class(vision_config=VISION, text_config=text, tie_word_embeddings=False,
                          architectures=[model_class.__name__], **QWEN3_VL_SPECIAL)
    with torch.random.fork_rng(devices=[]):
        model = model_class(config).eval()
    _rescale(model, torch.Generator().manual_seed(3))
    folder = str(tmp_path / family)
    model.save_pretrained(folder, safe_serialization=True)
    write_qwen3_vl_processor_files(folder)
    loras = {}
    for i, (name, spec) in enumerate(VL_ADAPTERS.items()):
        base = model_class.from_pretrained(folder, dtype=torch.float32)
        loras[name] = LoRARequest(name, i + 1, make_adapter(base, str(tmp_path / name), *spec))
    llm = make_llm(folder, kv_cache_bytes=32 * 2 ** 20, max_model_len=1024)
    assert "model.visual.patch_embed.proj" in llm.engine.model_runner.lora.layers
    requests = [{"prompt": t, "multi_modal_data": {"image": images}} for t, images in VL_CASES]
    expected = {}
    for name in [None, *loras]:
        reference = peft_model(model_class, folder, loras.get(name), family == "Qwen3_5Moe")
        for case, (prompt, images) in enumerate(VL_CASES):
            ids, kwargs = hf_inputs(llm, prompt, images)
            with torch.no_grad():
                ref = reference(input_ids=ids, **kwargs).logits[0]
                out = reference.generate(input_ids=ids, max_new_tokens=NUM_NEW, do_sample=False,
                                         **kwargs)
            expected[(name, case)] = out[0, ids.shape[1]:].tolist()
            if name is not None and images:
                assert relative(expected_logits, ref) > 1e-3, name  # the adapter matters
            if name is None and images:
                expected_logits = ref
            ours = engine_logits(llm, requests[case], loras.get(name))
            assert relative(ours, ref) < 1e-4, (name, case)
    names = [None, "eyes", "both"] * 2
    cases = [0, 0, 0, 1, 1, 1]
    outs = llm.generate([requests[c] for c in cases], GREEDY, use_tqdm=False,
                        lora_request=[loras.get(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [expected[(n, c)]
                                                      for n, c in zip(names, cases)]
    assert_block_pool_empty(llm)

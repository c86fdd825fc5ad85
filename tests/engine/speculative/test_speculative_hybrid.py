"""Speculative decoding on hybrid targets (Qwen3.5 dense and MoE text: Gated DeltaNet state beside
full attention): greedy tokens equal transformers' without speculation, with n-gram and draft-model
proposals that are accepted and rejected (counted), with prefix caching on and hitting; a
verification that rejects a proposal puts back the state it verified from, and the same run with
that put-back skipped (a planted bug) fails the same check."""
import pytest
import torch

from engine_checks import assert_block_pool_empty

from text_checkpoints import build_checkpoint, tiny_text_config
from vlinfer import LLM, SamplingParams
from vlinfer.engine.cache_pool import CachePool
from vlinfer.engine.speculative import speculator
from vlinfer.toy.tiny_checkpoints import _rescale
from qwen3_5_text_cases import qwen3_5_moe_config, save, text_config

NUM_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
# Prompts that repeat (n-gram proposals hit) and one that does not.
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13, 11, 12, 13, 40, 41] * 3,
           [(j * j) % 509 + 3 for j in range(21)]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}


@pytest.fixture(scope="module", params=["dense", "moe"])
def target(request, tmp_path_factory):
    """(folder, transformers' greedy tokens per prompt) of a tiny random Qwen3.5 text model."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        model = (Qwen3_5ForCausalLM(text_config()) if request.param == "dense" else
                 Qwen3_5MoeForCausalLM(qwen3_5_moe_config())).eval()
    _rescale(model, torch.Generator().manual_seed(3))
    if request.param == "moe":
        model.set_experts_implementation("eager")
    folder = save(model, str(tmp_path_factory.mktemp(f"qwen3_5_{request.param}")))
    model.generation_config.eos_token_id = None  # as ignore_eos
    expected = []
    for ids in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    return folder, expected


def plant_proposals(monkeypatch, expected):
    """A proposer that knows transformers' greedy continuation and proposes it with one token
    wrong in two steps of three (at the step's count mod 3: all right, the 1st wrong, the 2nd
    wrong): verifications that accept everything, nothing, and some then reject. Exactness must
    hold for any proposal; this one makes every case happen on a random model."""
    calls = [0]

    def propose(token_ids, k, min_n, max_n, never):
        for prompt, tokens in zip(PROMPTS, expected):
            if token_ids[:len(prompt)] == prompt:
                done = len(token_ids) - len(prompt)
                proposal = list(tokens[done:done + k])
                calls[0] += 1
                wrong = calls[0] % 3 - 1
                if 0 <= wrong < len(proposal):
                    proposal[wrong] = (proposal[wrong] + 1) % 500 + 3
                return proposal
        return []
    monkeypatch.setattr(speculator, "propose_ngram", propose)


def make_llm(folder, spec, **kw):
    return LLM(folder, dtype="float32", kv_cache_bytes=16 * 2 ** 20, max_model_len=256,
               max_num_seqs=8, speculative_config=spec, **kw)


def generate(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_rejections_and_acceptances(llm):
    s = llm.engine.speculator
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens, (
        s.num_drafts, s.num_accepted_tokens, s.num_draft_tokens)


def assert_idle(llm):
    assert_block_pool_empty(llm)
    bm = llm.engine.block_manager
    assert bm.num_free_slots == bm.num_state_slots > 0


def test_ngram_greedy_equals_transformers(target):
    """Real n-gram proposals: on a random model nearly all of them fail, and each failure puts
    the state back."""
    folder, expected = target
    llm = make_llm(folder, NGRAM, enable_prefix_caching=False)
    assert generate(llm) == expected
    s = llm.engine.speculator
    assert s.num_drafts > 0 and s.num_accepted_tokens < s.num_draft_tokens
    assert_idle(llm)


def test_accepted_and_rejected_proposals_keep_the_state_exact(target, monkeypatch):
    folder, expected = target
    plant_proposals(monkeypatch, expected)
    llm = make_llm(folder, NGRAM, enable_prefix_caching=False)
    assert generate(llm) == expected
    assert_rejections_and_acceptances(llm)
    assert_idle(llm)


def test_prefix_caching_hits_and_checkpoints_stay_exact(target, monkeypatch):
    """Prefix caching on, chunks of 16 (hybrid chunks cut at block boundaries, checkpoints saved,
    recomputed spans after a rejection among them): each prompt twice, the second hitting; greedy
    tokens equal transformers'."""
    folder, expected = target
    plant_proposals(monkeypatch, expected)
    llm = make_llm(folder, NGRAM, enable_prefix_caching=True, max_num_batched_tokens=16)
    assert generate(llm) == expected
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 16)
    assert llm.engine.block_manager.checkpoints
    assert_rejections_and_acceptances(llm)


def test_a_state_not_put_back_fails(target, monkeypatch):
    """The planted bug: a rejected proposal's state kept (the put-back skipped). The kept tokens
    then run twice through the linear layers and the greedy tokens leave transformers'."""
    folder, expected = target
    plant_proposals(monkeypatch, expected)
    monkeypatch.setattr(CachePool, "restore_slots", lambda self, *args: None)
    llm = make_llm(folder, NGRAM, enable_prefix_caching=False)
    outputs = generate(llm)
    assert all(ours != theirs for ours, theirs in zip(outputs, expected))
    assert_rejections_and_acceptances(llm)


def test_draft_model_greedy_equals_transformers(target, tmp_path):
    """A pure-attention draft (tiny Qwen3, same vocabulary) on the hybrid target."""
    folder, expected = target
    draft = str(tmp_path / "draft")
    build_checkpoint(draft, tiny_text_config("qwen3", True), seed=5)
    llm = make_llm(folder, {"model": draft, "num_speculative_tokens": 3, "adaptive": False},
                   enable_prefix_caching=False)
    assert generate(llm) == expected
    s = llm.engine.speculator
    assert s.num_drafts > 0 and s.num_accepted_tokens < s.num_draft_tokens
    assert_idle(llm)
    assert not llm.engine.speculator.draft.shadows


def test_a_hybrid_draft_is_refused_by_name(target):
    folder, _ = target
    with pytest.raises(ValueError, match="draft model .*linear-attention state"):
        make_llm(folder, {"model": folder, "num_speculative_tokens": 2})


@pytest.mark.parametrize("target", ["dense"], indirect=True)
def test_sampled_continuations_are_distributed_as_transformers(target, monkeypatch):
    """6000 seeded draws of a three-token continuation (temperature 0.7, top-k 4) with and without
    speculation. With it, the second token is proposed (the likeliest after the likeliest first
    one) and verified by rejection sampling; where it is rejected, the state is put back and the
    third token comes after the recomputed span. The second token's frequencies after the most
    frequent first token a, and the third's after (a, b) (the verification's own row) and after
    (a, c) (c drawn where b was rejected: the state put back), against transformers' processed
    distributions in total variation (bounds 3x the sampling noise: a 3% bias shows)."""
    import numpy as np
    from transformers import AutoModelForCausalLM
    folder, _ = target
    n, prompt = 6000, PROMPTS[0]
    params = SamplingParams(n=n, temperature=0.7, top_k=4, max_tokens=3, ignore_eos=True, seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def processed(ids):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1] / 0.7
        return row.masked_fill(row < row.topk(4).values[-1], float("-inf")).softmax(-1)

    a = int(processed(prompt).argmax())
    b = int(processed(prompt + [a]).argmax())
    monkeypatch.setattr(speculator, "propose_ngram",
                        lambda ids, k, *_: [b] if len(ids) == len(prompt) + 1 else [])
    spec = dict(NGRAM, disable_by_batch_size=n)
    options = dict(dtype="float32", kv_cache_bytes=160 * 2 ** 20, max_model_len=64,
                   max_num_seqs=1024, max_num_batched_tokens=32768)
    runs = {}
    for name, extra in (("plain", {}), ("speculative", {"speculative_config": spec})):
        llm = LLM(folder, **options, **extra)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        runs[name] = np.array([c.token_ids for c in out.outputs])
        if extra:
            s = llm.engine.speculator
            assert 300 < s.num_accepted_tokens < s.num_draft_tokens - 1000
            assert_idle(llm)

    def tv(draws, ids):
        empirical = torch.bincount(torch.tensor(draws), minlength=512).float() / len(draws)
        noise = 0.5 * float(np.sqrt(2 / np.pi) * np.sqrt(4 / len(draws)))
        return 0.5 * (empirical - processed(ids)).abs().sum().item(), 3 * noise

    # c: the likeliest second token but b, drawn where b was rejected; the third token after it
    # comes from the state put back and the recomputed span
    c = int(processed(prompt + [a]).topk(2).indices[1])
    for name, draws in runs.items():
        after_a = draws[draws[:, 0] == a]
        after_ab, after_ac = after_a[after_a[:, 1] == b], after_a[after_a[:, 1] == c]
        assert len(after_ab) > 300 and len(after_ac) > 300, name
        for got, bound in (tv(after_a[:, 1], prompt + [a]), tv(after_ab[:, 2], prompt + [a, b]),
                           tv(after_ac[:, 2], prompt + [a, c])):
            assert got < bound, (name, got, bound)

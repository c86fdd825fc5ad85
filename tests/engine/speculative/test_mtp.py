"""MTP speculation (speculative_config method "mtp") on tiny random Qwen3.5 dense and MoE and
Qwen3-Next checkpoints, float32, whose `mtp.*` head (transformers saves none) is written beside
them and trained a little on the target's own greedy outputs (vlinfer/toy/mtp_heads.py), so that
proposals are accepted as well as rejected.

- The head's logits at every position of a chunked prefill equal an oracle written here from the
  published layout (plain torch around transformers' own decoder layer and norms with the head's
  weights), 1e-4 relative.
- Greedy tokens with MTP equal transformers' without speculation, over a batch, with chunked
  prefill, prefix caching that hits, and a tight pool that preempts; accepted and rejected
  proposals counted; every proposal equals the oracle's greedy chain from the same tokens, and
  the same check fails with the head fed the wrong position's hidden state (a planted bug).
- Nothing held after finish, abort and preemption: the head's K and V are in the target's blocks,
  its kept hidden state in the state slots."""
import pytest
import torch

from engine_checks import assert_block_pool_empty

from text_checkpoints import build_checkpoint, tiny_text_config
from qwen3_5_text_cases import qwen3_5_moe_config, qwen3_next_config, save, text_config
from vlinfer import LLM, SamplingParams
from vlinfer.engine import mtp_head
from vlinfer.engine.scheduler import SchedulerOutput
from vlinfer.toy.mtp_heads import TorchMTP, save_mtp, text_model, train_mtp
from vlinfer.toy.tiny_checkpoints import _rescale

NUM_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 6, [(j * j) % 509 + 3 for j in range(21)],
           [(7 * i + 11) % 500 + 3 for i in range(37)]]
MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module", params=["dense", "moe", "next"])
def target(request, tmp_path_factory):
    """(transformers model, its head, folder, transformers' greedy tokens per prompt)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
    kind = request.param
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = {"dense": lambda: Qwen3_5ForCausalLM(text_config()),
                 "moe": lambda: Qwen3_5MoeForCausalLM(qwen3_5_moe_config()),
                 "next": lambda: Qwen3NextForCausalLM(qwen3_next_config())}[kind]().eval()
        _rescale(model, torch.Generator().manual_seed(3))
        if kind != "dense":
            model.set_experts_implementation("eager")
        head = TorchMTP(model)
        model.generation_config.eos_token_id = None  # as ignore_eos
        with torch.no_grad():  # the target's own greedy rows, cut to one length
            rows = [model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW,
                                   do_sample=False)[0, :20 + NUM_NEW].tolist() for ids in PROMPTS]
        train_mtp(model, head, rows, steps=60)
    head.eval()
    folder = save(model, str(tmp_path_factory.mktemp(f"mtp_{kind}")))
    save_mtp(folder, head)
    expected = []
    for ids in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    return model, head, folder, expected


def oracle_rows(model, head, tokens: list[int], drafts: int = 0):
    """The head's output logits at positions 0 .. len(tokens) - 2 from the published layout
    (x = fc(cat(norm_e(embed(t[p + 1])), norm_h(h_p))), one causal decoder layer at rotary p, a
    final norm, the target's LM head), then `drafts` greedy proposals, each feeding the head's
    output back one position on. Returns (logits [len - 1, vocab], proposals)."""
    lm = text_model(model)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = lm(input_ids=ids).last_hidden_state[:, :-1]
        embeds = lm.embed_tokens(ids[:, 1:])
        proposals, logits = [], None
        for step in range(drafts + 1):
            n = embeds.shape[1]
            rope = lm.rotary_emb(embeds, torch.arange(n)[None])
            x = head.fc(torch.cat([head.pre_fc_norm_embedding(embeds),
                                   head.pre_fc_norm_hidden(hidden)], -1))
            out = head.layers[0](x, position_embeddings=rope, attention_mask=None)
            y = head.norm(out[0] if isinstance(out, tuple) else out)
            rows = model.lm_head(y)[0]
            logits = rows if logits is None else logits
            if step == drafts:
                break
            token = int(rows[-1].argmax())
            top2 = rows[-1].topk(2).values
            proposals.append((token, float(top2[0] - top2[1])))
            embeds = torch.cat([embeds, lm.embed_tokens(torch.tensor([[token]]))], 1)
            hidden = torch.cat([hidden, y[:, -1:]], 1)
    return logits, proposals


def make_llm(folder, **kw):
    kw.setdefault("kv_cache_bytes", 16 * 2 ** 20)
    return LLM(folder, dtype="float32", max_model_len=256, max_num_seqs=8,
               speculative_config=MTP, **kw)


def assert_nothing_held(llm):
    assert_block_pool_empty(llm)
    bm = llm.engine.block_manager
    assert bm.num_free_slots == bm.num_state_slots > 0


def test_head_logits_match_oracle(target, monkeypatch):
    """A prompt prefilled in two chunks: the head's rows at every position (the second chunk's
    first pairs with the hidden state the slot kept) against the oracle."""
    model, head, folder, _ = target
    llm = make_llm(folder)
    engine, runner = llm.engine, llm.engine.model_runner
    assert runner.mtp is not None
    # the head's attention is one more layer of the paged pool (sizing counts its bytes a block),
    # its kept hidden state one more state tensor (one row of hidden_size a slot)
    full = [t for t in model.config.layer_types if t == "full_attention"]
    pool = runner.cache_pool
    assert len(pool.layers) == len(full) + 1 and pool.layers[-1] is runner.model.mtp.layers[
        0].self_attn.attn
    assert [tuple(t.shape) for t in pool.state_tensors[-1]] == [(1, pool.num_slots, 64)]
    seen = []
    catch_up = runner.mtp.catch_up
    monkeypatch.setattr(runner.mtp, "catch_up", lambda *a: seen.append(catch_up(*a)) or seen[-1])
    ids = PROMPTS[2]
    seq = engine.make_sequence(ids)
    engine.add_sequence(seq)
    assert engine.block_manager.allocate(seq, seq.num_tokens)
    for n in (20, len(ids) - 20):
        runner.prompt_logits(SchedulerOutput([seq], [n]))
        seq.num_computed_tokens += n
    ours = runner.model.compute_logits(torch.cat(seen))
    ref, _ = oracle_rows(model, head, ids)
    assert ours.shape == ref.shape == (len(ids) - 1, 512)
    error = (ours - ref).abs().max(-1).values / ref.abs().max(-1).values  # per position
    assert error.max().item() < 1e-4
    engine.abort_request(seq.request_id)
    assert_nothing_held(llm)


def record_proposals(runner, log):
    propose = runner.mtp.propose

    def recording(seqs, ks, never):
        out = propose(seqs, ks, never)
        log.extend((list(s.token_ids), p) for s, p in zip(seqs, out))
        return out
    return recording


def check_proposals(model, head, log) -> tuple[int, int]:
    """(proposals compared, mismatches) against the oracle's chain from the same tokens; a
    proposal whose oracle margin is under 1e-3 ends its chain's comparison (float rounding may
    pick either)."""
    compared = wrong = 0
    for tokens, proposal in log:
        _, ref = oracle_rows(model, head, tokens, len(proposal))
        for token, (expected, margin) in zip(proposal, ref):
            if margin < 1e-3:
                break
            compared += 1
            if token != expected:
                wrong += 1
                break
    return compared, wrong


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}],
                         ids=["batch", "chunked"])
def test_greedy_identity_and_oracle_proposals(target, options, monkeypatch):
    model, head, folder, expected = target
    llm = make_llm(folder, **options)
    runner = llm.engine.model_runner
    log = []
    monkeypatch.setattr(runner.mtp, "propose", record_proposals(runner, log))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    s = llm.engine.speculator
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens, (
        s.num_drafts, s.num_accepted_tokens, s.num_draft_tokens)
    assert runner.mtp.num_catch_up_rows >= sum(map(len, PROMPTS)) - len(PROMPTS)
    compared, wrong = check_proposals(model, head, log[:12])
    assert compared >= 12 and wrong == 0, (compared, wrong)
    assert_nothing_held(llm)


def test_wrong_hidden_state_fails(target, monkeypatch):
    """A planted bug: each pair fed its own row's hidden state rather than the one before it.
    The output stays exact (verification), but the proposals leave the oracle's."""
    model, head, folder, expected = target
    plan = mtp_head.plan_catch_up

    def shifted(*args):
        p = plan(*args)
        p.prev = p.rows.clone()
        return p
    monkeypatch.setattr(mtp_head, "plan_catch_up", shifted)
    import vlinfer.engine.model_runner as model_runner
    monkeypatch.setattr(model_runner, "plan_catch_up", shifted)
    llm = make_llm(folder)
    runner = llm.engine.model_runner
    log = []
    monkeypatch.setattr(runner.mtp, "propose", record_proposals(runner, log))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    _, wrong = check_proposals(model, head, log[:12])
    assert wrong > 0


def test_prefix_hits_preemption_and_aborts(target):
    """Prefix caching that hits (the second pass restores checkpoints, the head's kept hidden
    state among them), a pool tight enough to preempt, an abort between steps: tokens exact and
    nothing held after."""
    _, _, folder, expected = target
    llm = make_llm(folder, max_num_batched_tokens=16)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.generate(requests, GREEDY, use_tqdm=False)
    again = llm.generate(requests, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    for outs in (first, again):
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert_nothing_held(llm)
    tight = LLM(folder, dtype="float32", max_model_len=96, max_num_seqs=3,
                kv_cache_bytes=_bytes_for_blocks(llm, 7), speculative_config=MTP,
                enable_prefix_caching=False)
    assert tight.engine.resolved.num_blocks == 7  # the three cannot all grow at once
    outs = tight.generate(requests, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert_nothing_held(tight)
    engine = tight.engine
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    for _ in range(6):
        engine.step()
    engine.abort_request(ids[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert_nothing_held(tight)


def _bytes_for_blocks(llm, blocks: int) -> int:
    """A budget of `blocks` KV blocks (the head's layer included) beside 3 state slots and no
    checkpoints."""
    pool = llm.engine.model_runner.cache_pool
    return blocks * pool.bytes_per_block + 3 * pool.bytes_per_slot + 1


def test_refusals(tmp_path, target):
    """By name: a checkpoint without mtp.* weights, a model family without an MTP head, MTP with
    tensor parallelism, a 'model' key."""
    import os
    import shutil
    _, _, folder, _ = target
    bare = str(tmp_path / "bare")
    shutil.copytree(folder, bare)
    os.remove(os.path.join(bare, "mtp.safetensors"))
    with pytest.raises(ValueError, match=r"MTP head weights \(mtp\.\*\)"):
        make_llm(bare)
    qwen3 = str(tmp_path / "qwen3")
    build_checkpoint(qwen3, tiny_text_config("qwen3", True))
    with pytest.raises(ValueError, match=r"Qwen3ForCausalLM\) has none"):
        make_llm(qwen3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):
        LLM(folder, speculative_config=MTP, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="method='mtp' takes no 'model'"):
        LLM(folder, speculative_config={**MTP, "model": folder})

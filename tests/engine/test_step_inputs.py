"""Step-input building (engine/step_inputs.py) without a model: a mixed batch's tensors against
values worked out by hand, and by plain loops over the block tables."""
import torch

from vlinfer.engine.sequence import Sequence
from vlinfer.engine.step_inputs import build_step_inputs, positions
from vlinfer.lora_request import LoRARequest
from vlinfer.pooling_params import PoolingParams
from vlinfer.sampling_params import SamplingParams

BS = 4  # block size


def make(tokens, computed, table, params=None, prompt_len=None):
    seq = Sequence(list(tokens), params or SamplingParams(max_tokens=8))
    if prompt_len is not None:  # the rest of tokens are outputs
        seq.num_prompt_tokens = prompt_len
    seq.num_computed_tokens = computed
    seq.block_table = list(table)
    return seq


def mixed_batch():
    """A: a prefill chunk that ends its prompt (samples; prompt logprobs asked); B: a decode; C:
    a first chunk that does not reach the end; D: a pooling prompt whole."""
    a = make(range(100, 110), 4, [7, 2, 5], SamplingParams(max_tokens=8, prompt_logprobs=0))
    b = make(range(200, 206), 5, [3, 9], prompt_len=5)
    c = make(range(300, 312), 0, [1, 4, 6])
    d = make(range(400, 403), 0, [8])
    d.sampling_params, d.pooling_params = None, PoolingParams()
    return [a, b, c, d], [6, 1, 4, 3]


def test_mixed_prefill_and_decode_batch():
    seqs, n = mixed_batch()
    a, b, c, d = seqs
    inputs, plan = build_step_inputs(seqs, n, BS, mrope=False)
    assert inputs.input_ids.tolist() == [104, 105, 106, 107, 108, 109, 205,
                                         300, 301, 302, 303, 400, 401, 402]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 8, 9, 5, 0, 1, 2, 3, 0, 1, 2]
    # A's tokens 4..7 in its second block (2), 8..9 in its third (5); B's token 5 in block 9; C in
    # block 1; D in 8.
    assert inputs.slot_mapping.tolist() == [8, 9, 10, 11, 20, 21, 37, 4, 5, 6, 7, 32, 33, 34]
    assert inputs.slot_mapping.dtype == torch.long
    assert inputs.cu_seqlens_q.tolist() == [0, 6, 7, 11, 14]
    assert inputs.cu_seqlens_q.dtype == torch.int32
    assert inputs.seq_lens.tolist() == [10, 6, 4, 3] and inputs.seq_lens.dtype == torch.int32
    assert inputs.block_tables.tolist() == [[7, 2, 5], [3, 9, -1], [1, 4, 6], [8, -1, -1]]
    assert inputs.block_tables.dtype == torch.int32
    assert not inputs.decode_only and inputs.mm_inputs == {} and inputs.lora_slots is None
    # Logits rows: A's prompt positions 4..8 (their logits give prompt tokens 5..9), then A's and
    # B's last rows.
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert [(s is a, j) for s, j in plan.prompt_rows] == [(True, j) for j in (5, 6, 7, 8, 9)]
    assert plan.sample_seqs == [a, b]
    assert inputs.pool_indices.tolist() == [13] and plan.pool_seqs == [d]


def test_slots_follow_the_block_tables():
    """Every scheduled token's slot is its block's id * block size + its offset in the block, by
    a plain loop."""
    seqs, n = mixed_batch()
    inputs, _ = build_step_inputs(seqs, n, BS, mrope=False)
    expected = []
    for seq, count in zip(seqs, n):
        for token in range(seq.num_computed_tokens, seq.num_computed_tokens + count):
            expected.append(seq.block_table[token // BS] * BS + token % BS)
    assert inputs.slot_mapping.tolist() == expected


def test_mrope_rows():
    """A multimodal prompt's three rows, continued past the prompt from its delta on every row; a
    text-only prompt's three rows are the token index."""
    e = make(range(8), 5, [0, 1], prompt_len=6)
    e.mrope_positions = torch.tensor([[0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15],
                                      [20, 21, 22, 23, 24, 25]])
    e.mrope_position_delta = -2
    f = make(range(3), 1, [2])
    inputs, _ = build_step_inputs([e, f], [3, 2], BS, mrope=True)
    assert inputs.positions.shape == (3, 5)
    assert inputs.positions.tolist() == [[5, 4, 5, 1, 2], [15, 4, 5, 1, 2], [25, 4, 5, 1, 2]]
    assert positions(e, 5, 8, mrope=False).tolist() == [5, 6, 7]


def test_verification_runs_as_decode_rows():
    """A sequence with proposals: its last token and each proposal one decode row, attending up
    to itself, each row its sequence's block table; all of its rows sample."""
    g = make(range(500, 506), 5, [4, 6], prompt_len=4)
    g.spec_token_ids = [900, 901]
    h = make(range(600, 603), 2, [3], prompt_len=2)
    inputs, plan = build_step_inputs([g, h], [3, 1], BS, mrope=False)
    assert inputs.input_ids.tolist() == [505, 900, 901, 602]
    assert inputs.positions.tolist() == [5, 6, 7, 2]
    assert inputs.slot_mapping.tolist() == [25, 26, 27, 14]
    assert inputs.seq_lens.tolist() == [6, 7, 8, 3]
    assert inputs.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    assert inputs.block_tables.tolist() == [[4, 6], [4, 6], [4, 6], [3, -1]]
    assert inputs.decode_only
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3] and plan.sample_seqs == [g, h]


def test_lora_slots_per_token():
    seqs, n = mixed_batch()
    seqs[1].lora_request = LoRARequest("x", 5, "/nowhere")
    inputs, _ = build_step_inputs(seqs, n, BS, mrope=False, lora_slot_of={5: 2})
    assert inputs.lora_slots.tolist() == [-1] * 6 + [2] + [-1] * 7


def test_state_slots_and_has_state():
    """A hybrid model's step: each sequence's state slot, and whether its slot holds its state so
    far (tokens computed before this step); none where no sequence holds a slot."""
    seqs, n = mixed_batch()
    inputs, _ = build_step_inputs(seqs, n, BS, mrope=False)
    assert inputs.state_slots is None and inputs.has_state is None
    for seq, slot in zip(seqs, (3, 0, 5, 1)):
        seq.state_slot = slot
    inputs, _ = build_step_inputs(seqs, n, BS, mrope=False)
    assert inputs.state_slots.tolist() == [3, 0, 5, 1]
    assert inputs.has_state.tolist() == [True, True, False, False]

"""Builders and constants of tests/engine/test_graph_runner.py that other test modules use too
(EchoModel, MAX_TOKENS, PROMPTS, TEXT_PROMPT, TWO_IMAGES, VL_PROMPT, cpu_graphs, generate,
greedy, picture, step, vl_checkpoint): imported from here by every one of them, that module
included."""
import random
import types

import pytest
import torch
from images import picture
from vlinfer import SamplingParams
from vlinfer.engine.step_inputs import StepInputs
from vlinfer.layers import ModelContext
from vlinfer.ops import Backend
from vlinfer.toy.tiny_checkpoints import build_tiny_qwen3_vl


class ReplayBackend:
    """Capture records the callable; replay re-runs it, reading whatever the static buffers hold
    then."""
    name = "eager replay (test)"

    def __init__(self, device, ops=None):
        self.device, self.ops = device, ops  # ops: the op table of the engine it was made for
        self.captured = []

    def capture(self, fn):
        self.captured.append(fn)
        return types.SimpleNamespace(replay=fn)


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Graph mode on CPU with ReplayBackend; yields the backends made (one per engine)."""
    made = []

    def factory(device, ops):
        made.append(ReplayBackend(device, ops))
        return made[-1]
    monkeypatch.setattr(Backend, "graph_capture", lambda self, device: factory(device, self))
    return made


class EchoModel(torch.nn.Module):
    """Returns, per row, what the forward saw in its context's step: input id, position, slot,
    seq_len, first block id."""

    def __init__(self, ctx: ModelContext):
        super().__init__()
        self.ctx = ctx

    def forward(self, input_ids, positions):
        ctx = self.ctx.forward_context()
        assert ctx.decode_only and ctx.cu_seqlens_q.tolist() == list(range(len(input_ids) + 1))
        pos = positions if positions.dim() == 1 else positions[1]
        return torch.stack(
            [input_ids, pos, ctx.slot_mapping,
             ctx.seq_lens.long(), ctx.block_tables[:, 1].long()], 1).float()


def step(b, width, mrope=False, decode_only=True, mm=None):
    ids = torch.arange(10, 10 + b)
    positions = torch.arange(20, 20 + b)
    return StepInputs(input_ids=ids, positions=positions.expand(3, -1) if mrope else positions,
                      slot_mapping=torch.arange(30, 30 + b),
                      cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
                      seq_lens=torch.arange(40, 40 + b, dtype=torch.int32),
                      block_tables=torch.arange(b * width, dtype=torch.int32).view(b, width),
                      decode_only=decode_only, mm_inputs=mm or {}, logits_indices=None)


# 5 sequences finishing at different steps: decode batches 5, 4, 3, 2, 1
MAX_TOKENS = [3, 5, 9, 12, 16]
_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (1, 17, 40, 5, 33)]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def generate(llm, requests):
    outs = llm.generate(requests, [greedy(n) for n in MAX_TOKENS[:len(requests)]], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


VL_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image." \
            "<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and" \
             "<|vision_start|><|image_pad|><|vision_end|>What differs?<|im_end|>\n" \
             "<|im_start|>assistant\n"
TEXT_PROMPT = "<|im_start|>user\nWrite one word about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return build_tiny_qwen3_vl(str(tmp_path_factory.mktemp("graph-qwen3-vl")), seed=0, num_heads=4,
                               num_kv_heads=2, head_dim=32, mrope_section=(6, 5, 5), vision_depth=2,
                               deepstack_visual_indexes=[0, 1], tie_word_embeddings=False)

"""One request's state as the engine sees it: tokens, KV blocks, progress, sampling state,
multimodal items."""
import time
from enum import Enum, auto
from itertools import count

import torch

from vlinfer.inputs import MultiModalItem
from vlinfer.outputs import RequestMetrics
from vlinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class PromptAndOutput:
    """token_ids split at num_prompt_tokens: what the sampler reads of a sequence (engine/sampler.py
    reads a proposed token's row through the same split)."""
    __slots__ = ()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Sequence(PromptAndOutput):
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, *,
                 request_id: str | None = None, prompt: str | None = None,
                 mm_items: list[MultiModalItem] | None = None,
                 mrope_positions: torch.Tensor | None = None, mrope_position_delta: int = 0,
                 generator: torch.Generator | None = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        # A request with n completions runs as n sequences: each its own request_id (the engine's
        # key), all sharing the request's id (parent_id), which outputs carry, with their completion
        # index.
        self.parent_id = self.request_id
        self.index = 0
        # the request whose n completions this is one of (the engine loop renames parent_id per
        # stream; this stays): siblings share the prompt, and so its prefix-cache hits
        self.request_group = self.request_id
        self.prompt = prompt
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        # A pooling request (embed / classify / score): prefill only, its last token's row pooled
        # (engine/pooling.py); it then has no sampling_params.
        self.pooling_params = None
        # the LoRARequest it runs with (engine/lora_manager.py); None: the base model
        self.lora_request = None
        # that adapter as read when the request was checked (what rank 0 installs)
        self.lora_adapter = None
        # The adapter its images are encoded under: lora_request when that has vision-tower modules,
        # else None (LoRAManager.vision_lora). Part of each item's encoder-cache key.
        self.vision_lora = None
        self.status = SequenceStatus.WAITING
        # time.perf_counter() past which the sequence ends as "length" (the server's
        # --request-timeout); None: no limit
        self.deadline: float | None = None
        self.block_table: list[int] = []
        # a hybrid model's state slot (engine/cache_pool.py), held with its blocks; None: none
        self.state_slot: int | None = None
        # the checkpoint slot a prefix hit restores its state from, before its next step
        self.restore_slot: int | None = None
        # chained hashes of this sequence's full blocks, filled lazily
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache; only the scheduler moves it
        # of the prompt, how many came from the prefix cache at first admission
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.mm_items = mm_items or []
        # 3-row (temporal, height, width) rotary positions of the prompt; generated token i sits at
        # i + mrope_position_delta on every row. None for text models, which use the token index.
        self.mrope_positions = mrope_positions
        self.mrope_position_delta = mrope_position_delta
        self.images_info: list[dict] = []
        self.videos_info: list[dict] = []
        self.generator = generator
        # SamplingParams.bad_words as token sequences for this engine's tokenizer
        # (LLMEngine.make_sequences).
        self.bad_words_token_ids: list[list[int]] = []
        # SamplingParams.structured_outputs as this sequence's grammar matcher (an llguidance
        # LLMatcher, advanced by every appended token; LLMEngine.make_sequences makes it); None when
        # unconstrained.
        self.grammar_matcher = None
        # structured/reasoning.py's ReasoningState when the engine has a reasoning parser: the text
        # split into reasoning and content, the thinking budget, the matcher parked while thinking
        self.reasoning = None
        # Speculative decoding (engine/speculative/): the tokens proposed for this step, verified
        # with the last token and never part of token_ids until accepted. The scheduler places and
        # clears them.
        self.spec_token_ids: list[int] = []
        self.output_logprobs: list[dict] = []  # per output token {token_id: outputs.Logprob}
        self.cumulative_logprob = 0.0
        # SamplingParams.prompt_logprobs: per prompt token {token_id: outputs.Logprob}, filled as
        # prefill chunks run; the first token has none (vLLM's None). None when not asked.
        asked = sampling_params is not None and sampling_params.prompt_logprobs is not None
        self.prompt_logprobs: list[dict |
                                   None] | None = [None] * len(self.token_ids) if asked else None
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.output_text = ""
        # of output_text, how much step outputs have already handed out as deltas
        self.num_streamed_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def encoder_key(self, item: MultiModalItem) -> tuple[int, int]:
        """The encoder cache's key of one of its items: the pixels, and the vision adapter they are
        encoded under (0: none). Prefix-cache blocks need no such key: their hash chain starts from
        the request's adapter."""
        return item.content_hash, \
            self.vision_lora.lora_int_id if self.vision_lora is not None else 0

    def mm_hashes_in(self, start: int, end: int) -> tuple[int, ...]:
        """Content hashes of the multimodal items overlapping token range [start, end)."""
        return tuple(item.content_hash for item in self.mm_items
                     if item.offset < end and item.end > start)

"""What an engine owns for structured outputs: llguidance's view of its tokenizer, a cache of
compiled grammars and the per-step token bitmask of every constrained sequence.

- The llguidance tokenizer is built on the first constrained request (a second or more for a 150K
  vocabulary), so
  an engine that never sees one pays nothing. Its vocabulary is the model's logits width (which may
  exceed the
  tokenizer's): ids past the tokenizer are never allowed.
- A grammar is compiled once per distinct constraint, when a request is made
  (LLMEngine.make_sequences, in the
  caller's thread under the engine loop), not in a step; each sequence gets a copy of the compiled
  matcher, whose
  state advances with every token it appends. A preempted sequence keeps its tokens, so its matcher
  stays exact.
- fill_bitmask computes the next-token masks of a step's constrained sequences in one call on
  llguidance's
  thread pool, into one int32 [rows, ceil(vocab / 32)] tensor the sampler applies
  (ops.apply_token_bitmask).
  start_bitmask runs it on this object's own mask thread and returns a Future: a matcher's mask
  depends only on
  the tokens it has already consumed, so when an accelerator runs the forward the model runner
  starts the masks
  before it and collects them after (llguidance releases the GIL while it computes). On the CPU the
  runner calls
  fill_bitmask after the forward: there the forward holds every core.

An engine's requests come from several threads (server handlers make sequences while the loop
steps), so the cache and the lazy tokenizer are guarded by a lock; the matchers themselves are
touched by the loop thread only."""
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from vlinfer.structured.params import StructuredOutputsParams

logger = logging.getLogger("vlinfer")

# distinct constraints kept compiled; the least recently used is dropped past this
MAX_CACHED_GRAMMARS = 256
MASK_THREADS = 2  # llguidance's mask threads: masks of a batch are small work next to the forward


class GrammarMatchers:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer  # the engine's Hugging Face (fast) tokenizer
        # llguidance numbers tokens up to the larger of the tokenizer's and the model's vocabulary;
        # the sampler cuts the mask to the logits width.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = sorted(t for t in eos_token_ids if t < self.vocab_size)
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None
        self._mask_thread = None  # runs fill_bitmask beside the forward (start_bitmask)
        # grammar text -> a fresh compiled LLMatcher
        self._compiled: OrderedDict[str, object] = OrderedDict()
        # grammar text -> how long its compile took (benchmarks)
        self.compile_seconds: dict[str, float] = {}
        self.tokenizer_seconds = 0.0

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance
            import llguidance.hf
            start = time.perf_counter()
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer,
                                                              n_vocab=self.vocab_size,
                                                              eos_token=self.eos_token_ids or None)
            self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
            self.tokenizer_seconds = time.perf_counter() - start
            logger.info("structured outputs: llguidance tokenizer of %d tokens built in %.2fs",
                        self.vocab_size, self.tokenizer_seconds)
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The compiled matcher of this constraint (from the cache, or compiled now); ValueError
        when the grammar cannot be built over this tokenizer."""
        import llguidance
        key = params.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
            tokenizer = self._tokenizer()
            start = time.perf_counter()
            compiled = llguidance.LLMatcher(tokenizer, params.grammar_text, log_level=0)
            seconds = time.perf_counter() - start
            if compiled.is_error():
                raise ValueError(
                    f"StructuredOutputsParams.{params.kind} cannot be compiled for this model's "
                    f"tokenizer: {compiled.get_error()}")
            self._compiled[key] = compiled
            self.compile_seconds[key] = seconds
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                old, _ = self._compiled.popitem(last=False)
                self.compile_seconds.pop(old, None)
            return compiled

    def new_matcher(self, params: StructuredOutputsParams):
        """A matcher at the start of the constraint, for one sequence."""
        return self.compile(params).deep_copy()

    def fill_bitmask(self, matchers: list) -> torch.Tensor:
        """int32 [len(matchers), bitmask_width] on the CPU: bit t of row i set when matchers[i]
        allows token t."""
        bitmask = torch.zeros(len(matchers), self.bitmask_width, dtype=torch.int32)
        row_bytes = self.bitmask_width * 4
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), row_bytes, len(matchers))
        return bitmask

    def start_bitmask(self, matchers: list) -> Future:
        """fill_bitmask(matchers) on the mask thread. The caller must not advance these matchers
        before the result is collected."""
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1,
                                                   thread_name_prefix="vlinfer-grammar-mask")
        return self._mask_thread.submit(self.fill_bitmask, matchers)

    def close(self) -> None:
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=True)
            self._mask_thread = None

    @staticmethod
    def accept(matcher, token_id: int) -> str | None:
        """Advance a sequence's matcher by the token it appended; the matcher's error when it
        refuses it (only possible when other options left the grammar's tokens no probability), else
        None. Past the end of the grammar (only EOS was allowed; ignore_eos went on) there is
        nothing to advance."""
        if matcher.is_stopped():
            return None
        if not matcher.consume_token(token_id):
            return matcher.get_error() or f"token {token_id} is not allowed by the constraint"
        return None

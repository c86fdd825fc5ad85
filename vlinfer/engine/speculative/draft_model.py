"""A draft model: a smaller checkpoint with the target's vocabulary, run by the same engine on rank
0 (whole, not tensor-parallel: draft_tensor_parallel_size=1), greedily, with its own KV pool.

Each target sequence has a shadow sequence in the draft's pool: the target's tokens, the draft's KV
over them, and its own blocks (freed with the request). A proposal catches the shadow up on the
tokens it has not seen (one prefill chunk for all sequences at once), then runs k - 1 one-token
steps; the proposal is the k arg-max tokens, a proposal of probability 1, which the target verifies
exactly (engine/sampler.py). At its next proposal the shadow keeps its KV over the tokens the target
kept (its proposals, if accepted), whether or not they were verified. Images reach the draft as
their placeholder tokens only (text-only drafting).

The shadows' progress and blocks have their target's owner: a Scheduler of the draft's own over its
pool (reserve, update, rollback, free); the draft batches its shadows itself, so that Scheduler
never schedules."""
import logging

import torch

from vlinfer import loading
from vlinfer.config import EngineConfig, SpeculativeConfig
from vlinfer.engine.block_manager import BlockManager
from vlinfer.engine.build_runner import build_runner
from vlinfer.engine.model_runner import ModelRunner
from vlinfer.engine.scheduler import Scheduler, SchedulerOutput
from vlinfer.engine.sequence import Sequence
from vlinfer.models import get_model_class
from vlinfer.models.interfaces import HasStateSlots
from vlinfer.sampling_params import SamplingParams

logger = logging.getLogger("vlinfer")
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def check_draft(model_cls, name: str) -> None:
    """Refuse a hybrid draft model at load, by name: its shadow rolls its KV back to the tokens
    its target kept at every proposal, which a linear-attention state cannot do."""
    if issubclass(model_cls, HasStateSlots):
        raise ValueError(
            f"speculative_config: the draft model {name} ({model_cls.__name__}) has "
            "linear-attention state, which cannot roll back to the tokens its target kept; a "
            "draft must be a pure-attention model (the target may be hybrid)")


class DraftModel:
    def __init__(self, runner: ModelRunner, name: str):
        self.runner = runner
        self.name = name
        self.scheduler: Scheduler | None = None  # made by allocate_kv_cache(), after sizing
        self.shadows: dict[int, Sequence] = {}  # target seq_id -> its shadow in the draft's pool
        # target seq_id -> how many target tokens its shadow had at its last proposal
        self.synced: dict[int, int] = {}
        self.num_pool_misses = 0  # proposals skipped because the draft's pool was full

    @classmethod
    def load(cls, config: SpeculativeConfig | None, target_vocab_size: int, device: torch.device,
             ops_choice: str | None, dtype: torch.dtype, block_size: int,
             max_num_seqs: int) -> "DraftModel | None":
        """The draft of speculative_config on the target's device, op implementation (ops_choice),
        dtype and block size; None without one. Loaded before the target's KV pool is sized: its
        pool takes its share of the same budget. Its KV stays in its compute dtype: the target's
        kv_cache_dtype is resolved for the target's checkpoint."""
        if config is None or config.method != "draft_model":
            return None
        source = loading.resolve_model(config.model)
        hf_config = loading.load_config(source)
        # an unsupported architecture or a hybrid one fails here, before any weight is read
        check_draft(get_model_class(hf_config), config.model)
        vocab = hf_config.get_text_config().vocab_size
        if vocab != target_vocab_size:
            raise ValueError(f"speculative_config: the draft model {config.model} has a vocabulary "
                             f"of {vocab} tokens and the target {target_vocab_size}: a draft must "
                             "share the target's tokenizer and vocabulary")
        draft_config = EngineConfig(model=config.model, device=device, enforce_eager=True,
                                    max_num_seqs=max_num_seqs)
        runner = build_runner(draft_config, source, hf_config, device, block_size,
                              ops_choice=ops_choice, dtype=dtype, kv_cache_dtype=None)
        logger.info("speculative decoding: draft model %s (%s) loaded on %s", source.name,
                    type(runner.model).__name__, device)
        return cls(runner, source.name)

    @property
    def bytes_per_block(self) -> int:
        return self.runner.cache_pool.bytes_per_block

    @property
    def block_manager(self) -> BlockManager | None:
        return self.scheduler.block_manager if self.scheduler is not None else None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """As many blocks as the target's pool: a shadow never holds more tokens than its target
        sequence. No prefix caching: a shadow's tokens include proposals not yet verified."""
        self.runner.allocate_kv_cache(num_blocks)
        pool = BlockManager(num_blocks, self.runner.block_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(pool, 0, 0)  # no admission limits: propose() batches the shadows

    def _shadow(self, seq: Sequence) -> Sequence:
        """The sequence's shadow, brought to its tokens: its KV stays valid over the tokens it
        shares with them (the target's tokens up to the last proposal, then the proposed tokens the
        target kept, whether or not it verified them), and never covers the last token, whose logits
        propose."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence([], GREEDY,
                                                         request_id=f"draft:{seq.request_id}")
        old, new = shadow.token_ids, seq.token_ids
        same, limit = self.synced.get(seq.seq_id, 0), min(len(old), len(new))
        while same < limit and old[same] == new[same]:
            same += 1
        shadow.token_ids = list(new)
        self.synced[seq.seq_id] = len(new)
        self.scheduler.rollback(shadow, min(same, len(new) - 1))
        return shadow

    def propose(self, seqs: list[Sequence], ks: list[int],
                never: frozenset[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens for each sequence, cut before a placeholder token; [] for
        a sequence whose shadow found no room in the draft's pool (that shadow starts over later).
        """
        wanted, proposals = {}, {}  # by shadow
        for seq, k in zip(seqs, ks):
            shadow = self._shadow(seq)
            # The whole proposal's KV at once: the catch-up chunk, then k - 1 proposed tokens.
            catch_up = shadow.num_tokens - shadow.num_computed_tokens
            if self.scheduler.reserve(shadow, catch_up + k - 1):
                wanted[shadow], proposals[shadow] = k, []
            else:
                self.num_pool_misses += 1
                self.release(seq)
        running = list(wanted)
        batch = SchedulerOutput(running, [s.num_tokens - s.num_computed_tokens for s in running])
        while batch.seqs:
            sampled, _, _ = self.runner.execute(batch)
            self.scheduler.update(batch, sampled)
            going = []
            for shadow, [token], _ in sampled:
                if token in never:  # a placeholder ends the proposal before it
                    continue
                proposals[shadow].append(token)
                if len(proposals[shadow]) < wanted[shadow]:
                    shadow.token_ids.append(token)
                    going.append(shadow)
            batch = SchedulerOutput(going, [1] * len(going))
        return [proposals.get(self.shadows.get(seq.seq_id), []) for seq in seqs]

    def release(self, seq: Sequence) -> None:
        self.synced.pop(seq.seq_id, None)
        shadow = self.shadows.pop(seq.seq_id, None)
        if shadow is not None:
            self.scheduler.free(shadow)

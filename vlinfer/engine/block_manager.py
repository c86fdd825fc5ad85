"""Paged KV memory: fixed-size blocks, reference counts, and prefix caching by chained block hashes;
and a hybrid model's per-sequence state slots (engine/cache_pool.py), held and freed with a
sequence's blocks: a sequence takes its slot with its first blocks, and gives both back at once
(finish, abort, preemption).

Prefix caching on a hybrid model (docs/hybrid.md "Prefix caching"): the linear layers' state at a
full-block boundary is copied into a checkpoint slot keyed by that block's hash (the slots past
the live ones); a hit is cut to the last block whose checkpoint exists, which is copied into the
sequence's own slot. The copies are the step's (scheduler.SchedulerOutput), run by the model
runner: restores before the forward, saves after it."""
import hashlib
from array import array
from collections import OrderedDict

from vlinfer.engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int], extra_keys: tuple = ()) -> int:
    """Hash of a full block, chained on its parent so equal blocks after different prefixes differ.
    extra_keys folds in what the token ids do not show, such as the content hash of an image whose
    placeholder tokens fall inside the block."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent_hash if parent_hash is not None else -1).to_bytes(17, "little", signed=True))
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(int(key).to_bytes(17, "little", signed=True))
    return int.from_bytes(h.digest(), "little")


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, num_checkpoint_slots: int = 0):
        self.block_size = block_size
        # free state slots, lowest first; empty and unused for a pure-attention model
        self.num_state_slots = num_state_slots
        self.free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))
        # checkpoint slots: the pool's slots past the live ones, never bound to a sequence
        self.num_checkpoint_slots = num_checkpoint_slots
        self.free_checkpoints: list[int] = list(
            range(num_state_slots + num_checkpoint_slots - 1, num_state_slots - 1, -1))
        # block hash -> checkpoint slot holding the state right after that block, LRU first
        self.checkpoints: OrderedDict[int, int] = OrderedDict()
        # (block hash, checkpoint slot) saved by the step in flight, committed by its update
        self.pending_saves: list[tuple[int, int]] = []
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, in eviction order: the front is reused first. Freed blocks that
        # still hold cached KV go to the back, so the least recently used cached block is evicted
        # first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def checkpointing(self) -> bool:
        """Prefix caching on a hybrid model: hits need a checkpointed state."""
        return self.enable_prefix_caching and self.num_checkpoint_slots > 0

    def shareable_tokens(self, num_tokens: int) -> int:
        """The longest block-aligned prefix of num_tokens a later request may hit: a hit always
        leaves the last token to compute."""
        return (num_tokens - 1) // self.block_size * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def update_block_hashes(self, seq: Sequence) -> list[int]:
        """Extend seq.block_hashes to cover every full block of its current tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            # The first block's parent is the request's adapter: KV computed under one adapter is
            # never another's.
            parent = seq.block_hashes[i - 1] if i else (
                seq.lora_request.lora_int_id if seq.lora_request else None)
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs],
                                               seq.mm_hashes_in(i * bs, (i + 1) * bs)))
        return seq.block_hashes

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _allocate_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its cached KV is about to be overwritten
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                # a state after KV no one can reuse is no use: dropped with the block
                self._drop_checkpoint(block.hash)
            block.hash = None
        block.ref_count = 1
        return block_id

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence with no blocks its cached prefix blocks. Returns the number of tokens
        whose KV is reused. The block holding the last token is never reused: that token must be
        recomputed for its logits, and writing its KV into a block other sequences read would be a
        hidden write to shared state."""
        # its blocks would leak: the scheduler frees a sequence before it allocates again
        if seq.block_table:
            raise RuntimeError(
                f"sequence {seq.request_id} already holds {len(seq.block_table)} KV blocks")
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            # prompt logprobs need the prompt's logits: its KV is computed, not read (vLLM's rule
            # too)
            return 0
        hits = []
        hashes = self.update_block_hashes(seq)
        for h in hashes[:self.shareable_tokens(seq.num_tokens) // self.block_size]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.num_state_slots:  # the linear layers start from a checkpoint: cut to the last one
            while hits and hashes[len(hits) - 1] not in self.checkpoints:
                hits.pop()
            if hits:
                seq.restore_slot = self.checkpoints[hashes[len(hits) - 1]]
                self.checkpoints.move_to_end(hashes[len(hits) - 1])
        for block_id in hits:
            self._take(block_id)
        seq.block_table = hits
        return len(hits) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.num_state_slots and seq.state_slot is None and not self.free_slots:
            return False
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of KV after seq.num_computed_tokens. False if
        the pool is out of blocks (nothing is allocated then)."""
        if not self.can_allocate(seq, num_new_tokens):
            return False
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._allocate_block())
        if self.num_state_slots and seq.state_slot is None:
            seq.state_slot = self.free_slots.pop()
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks whose KV is now complete so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self.update_block_hashes(seq)
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            # A block computed alongside an identical one that is already cached stays unhashed, so
            # it is reused as plain free space rather than kept as an unreachable copy.
            if block.hash is None and self.hash_to_block.setdefault(
                    hashes[i], block.block_id) == block.block_id:
                block.hash = hashes[i]

    def reserve_checkpoint(self, seq: Sequence, num_new_tokens: int) -> tuple[int, int] | None:
        """(seq's slot, a checkpoint slot) when seq's prefill chunk of num_new_tokens ends at a
        full-block boundary whose state is not checkpointed yet: the step copies the state there
        after its forward, and `commit_checkpoints` keys it by the block's hash. Decode steps take
        none (a generated block is rarely another request's prefix). The least recently used
        checkpoint makes room."""
        end, bs = seq.num_computed_tokens + num_new_tokens, self.block_size
        if (not self.checkpointing or end % bs or not end
                or seq.num_computed_tokens >= seq.num_tokens - 1):
            return None
        h = self.update_block_hashes(seq)[end // bs - 1]
        if h in self.checkpoints:
            self.checkpoints.move_to_end(h)
            return None
        if any(h == pending for pending, _ in self.pending_saves):
            return None
        if not self.free_checkpoints:
            if not self.checkpoints:  # every checkpoint slot is this step's
                return None
            self.free_checkpoints.append(self.checkpoints.popitem(last=False)[1])
        slot = self.free_checkpoints.pop()
        self.pending_saves.append((h, slot))
        return seq.state_slot, slot

    def commit_checkpoints(self) -> None:
        """The step's saves ran: each checkpoint is keyed by its block's hash, while that block's
        KV is cached (the step's update cached it)."""
        for h, slot in self.pending_saves:
            if h in self.hash_to_block and h not in self.checkpoints:
                self.checkpoints[h] = slot
            else:
                self.free_checkpoints.append(slot)
        self.pending_saves = []

    def drop_pending_checkpoints(self) -> None:
        """A step that failed before its update: its saves never ran."""
        self.free_checkpoints.extend(slot for _, slot in self.pending_saves)
        self.pending_saves = []

    def _drop_checkpoint(self, h: int) -> None:
        slot = self.checkpoints.pop(h, None)
        if slot is not None:
            self.free_checkpoints.append(slot)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and state checkpoint (vLLM's reset_prefix_cache). Only while
        no sequence holds a block: False, and nothing changed, otherwise."""
        if len(self.free_blocks) != len(self.blocks):
            return False
        for block in self.blocks:
            block.hash = None
        self.hash_to_block.clear()
        self.free_checkpoints.extend(self.checkpoints.values())
        self.checkpoints.clear()
        return True

    def trim(self, seq: Sequence) -> None:
        """Free the tail blocks past those seq.num_tokens needs: blocks taken for proposed tokens
        that were rejected (speculative decoding). They hold no full block of accepted tokens, so no
        hash."""
        while len(seq.block_table) > self.blocks_needed(seq.num_tokens):
            self._release(seq.block_table.pop(), seq)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first: a shared prefix outlives the suffixes that depend on it.
        for block_id in reversed(seq.block_table):
            self._release(block_id, seq)
        seq.block_table = []
        seq.restore_slot = None
        if seq.state_slot is not None:  # its state goes with it: a readmission starts afresh
            if seq.state_slot in self.free_slots:
                raise RuntimeError(f"state slot {seq.state_slot} freed twice (by sequence "
                                   f"{seq.request_id})")
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def _release(self, block_id: int, seq: Sequence) -> None:
        """Drop seq's reference to a block; unreferenced, it becomes free."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:  # a second free would hand one block to two sequences
            raise RuntimeError(f"KV block {block_id} freed twice (by sequence {seq.request_id})")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None
            if block.hash is None:  # holds nothing reusable: hand it out before cached blocks
                self.free_blocks.move_to_end(block_id, last=False)

"""KV-cache block bookkeeping in plain Python (no tensors), with prefix caching of full blocks.

A block holds `block_size` consecutive tokens of one sequence. A full block is registered under a
hash of its tokens chained with the previous block's hash, so a later sequence whose prompt starts
with the same tokens reuses it (reference-counted). A sequence's `cache_key` (its LoRA adapter) seeds the
chain, so sequences of different adapters never share blocks. Freed blocks keep their hash until the block is
reallocated, so a finished request's prompt still serves later ones (least recently freed first out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass(slots=True)
class Block:
    """One block of cache slots."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    """Allocates blocks to sequences; `num_blocks` blocks of `block_size` slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: dict[int, None] = dict.fromkeys(range(num_blocks))  # ordered set, oldest first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_cache_hits = 0  # tokens served from the prefix cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free(self) -> int:
        block_id = next(iter(self.free_block_ids))
        del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict: its contents are about to be overwritten
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def allocate_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks yet: reuse cached blocks of its leading full blocks.

        Sets `num_computed_tokens` to the tokens found and returns it. The last token is never taken
        from the cache, so the sequence always computes at least one token (its logits).
        """
        if seq.block_table:
            raise ValueError("allocate_prefix needs a sequence without blocks")
        if not self.enable_prefix_caching:
            return 0
        prev = seq.cache_key
        for start in range(0, len(seq) - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start:start + self.block_size])
            h = chain_hash(prev, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            prev = h
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.num_cache_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq`; all or nothing. False when out of blocks."""
        if not self.can_append(seq, num_new_tokens):
            return False
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq`'s computed tokens have filled, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        prev = self.blocks[seq.block_table[seq.num_cached_blocks - 1]].hash if seq.num_cached_blocks else seq.cache_key
        for i in range(seq.num_cached_blocks, num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.blocks[seq.block_table[i]]
            prev = chain_hash(prev, tokens)
            block.hash, block.token_ids = prev, tokens
            self.cached.setdefault(prev, block.block_id)
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (last block first, so shared prefixes stay longest)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_cached_blocks = 0

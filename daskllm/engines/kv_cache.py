"""Prefix KV cache at block granularity.

A prompt's tokens are cut into blocks of ``block_size``; each full block is named by a
hash chained over all blocks before it, so a block hash identifies the whole prefix up to
and including that block. The engine reuses the longest chain of resident blocks, and the
placement plugin computes the same hashes from token ids to mirror what each worker holds.

Blocks carry reference counts: a block in use by a running sequence is never evicted.
Released blocks that hold a hashed prefix stay resident, in least-recently-released
order, until an allocation needs the space (LRU eviction under a fixed token capacity).

A prefill of a shared prefix usually ends inside a block. That partial last block is kept
too, under its parent's hash and its tokens: a later prompt that continues the prefix
copies those rows into a block of its own instead of computing them (the rows are the
same bits it would compute, since the forward pass is batch-invariant).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0


def hash_block(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained to the hash of the prefix before it."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Chain of hashes of the full blocks of ``token_ids[:limit]``."""
    n = len(token_ids) if limit is None else min(limit, len(token_ids))
    hashes, parent = [], ROOT_HASH
    for start in range(0, n - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "partial_parent")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.partial_parent: int | None = None  # set for a kept partial block


class BlockManager:
    """Allocates KV blocks to sequences and keeps released prefixes for reuse."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.partials: dict[int, dict[tuple[int, ...], int]] = {}  # parent hash -> tokens -> block
        self._empty: deque[int] = deque(range(num_blocks))  # free, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, hashed; oldest first
        self.evicted_blocks = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def resident_hashes(self) -> frozenset[int]:
        return frozenset(self.hash_to_block)

    def match_prefix(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """Acquire the longest chain of cached blocks covering ``token_ids[:limit]``."""
        acquired, parent = [], ROOT_HASH
        bs = self.block_size
        for start in range(0, limit - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            parent = hash_block(parent, tokens)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._acquire(block_id)
            acquired.append(block_id)
        return acquired

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting least recently used prefixes; None if too few are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._empty:
                block_id = self._empty.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._forget(self.blocks[block_id])
                self.evicted_blocks += 1
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def register(self, block_id: int, parent: int, token_ids: Sequence[int]) -> tuple[int, int]:
        """Name a block that has just been filled: returns (its chain hash, the block to keep using).

        If another block already holds the same prefix (two sequences computed it in the
        same step), the caller switches to that copy and this one is dropped: the two hold
        the same bits (the forward pass is batch-invariant), and every user of a block
        then also holds its parent, so a parent is never evicted before its children.
        """
        tokens = tuple(token_ids)
        h = hash_block(parent, tokens)
        existing = self.hash_to_block.get(h)
        if existing is None:
            block = self.blocks[block_id]
            block.hash, block.token_ids = h, tokens
            self.hash_to_block[h] = block_id
            return h, block_id
        if existing != block_id and self.blocks[existing].token_ids == tokens:
            self._acquire(existing)
            self.release([block_id])
            return h, existing
        return h, block_id

    def register_partial(self, block_id: int, parent: int, token_ids: Sequence[int]) -> None:
        """Keep a partly filled block (the tail of a prefill) for prompts that continue it."""
        tokens = tuple(token_ids)
        if not tokens or len(tokens) >= self.block_size:
            return
        held = self.partials.setdefault(parent, {})
        if tokens in held:
            return
        block = self.blocks[block_id]
        block.partial_parent, block.token_ids = parent, tokens
        held[tokens] = block_id

    def match_partial(self, parent: int, next_tokens: Sequence[int]) -> tuple[int, int] | None:
        """(block, n): the kept partial block after ``parent`` whose tokens start ``next_tokens``."""
        best = None
        for tokens, block_id in self.partials.get(parent, {}).items():
            n = len(tokens)
            if n <= len(next_tokens) and tuple(next_tokens[:n]) == tokens and (best is None or n > best[1]):
                best = (block_id, n)
        return best

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; the tail of a sequence becomes evictable first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is not None or block.partial_parent is not None:
                self._evictable[block_id] = None
            else:
                self._empty.append(block_id)

    def reset(self) -> bool:
        """Forget every cached prefix not in use; True if nothing cached remains."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget(self.blocks[block_id])
            self._empty.append(block_id)
        return not self.hash_to_block and not self.partials

    def hold(self, block_id: int) -> None:
        """Take a reference to a resident block (it cannot be evicted until released)."""
        self._acquire(block_id)

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _forget(self, block: _Block) -> None:
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]
        if block.partial_parent is not None:
            held = self.partials.get(block.partial_parent, {})
            if held.get(block.token_ids) == block.block_id:
                del held[block.token_ids]
                if not held:
                    del self.partials[block.partial_parent]
        block.hash, block.token_ids, block.partial_parent = None, (), None

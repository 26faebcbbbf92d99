"""Continuous batching: which sequences run in the next engine step, and how many tokens.

Every step has a token budget. Running sequences go first (a decode needs one token, a
prompt still being prefilled takes a chunk), then waiting sequences are admitted in
priority order (lower first; arrival order among equals: first come, first served when no
request names one), each starting from the longest prefix already in the KV cache. When the
cache runs out of blocks, the newest running sequence is preempted: its blocks are
released (its prefix usually stays cached) and it is recomputed later, which changes
nothing in its output.

Long prompts never hold others up for long. A sequence computes at most ``prefill_chunk``
prompt tokens in a step, so a step's length is bounded and a request that arrives waits at
most one chunk. And a *long prefill* (a prompt of more than ``long_prefill`` tokens, while
it is prefilled) yields: in a step that also carries other work (a decode, a shorter prompt,
one waiting to start) it advances at most one block, so decodes and short requests run at
nearly their own speed; alone, it takes whole chunks. With ``context_cost`` set, both limits
count a token's cost rather than tokens: a token ``c`` positions into its prompt costs
``1 + c / context_cost`` (it also attends to the ``c`` before it), so chunks deep in a long
prompt take fewer tokens and a step's length stays bounded there too. (A prompt's tail of at
most a block joins the chunk before it rather than take a step alone.) Chunks change nothing
in a sequence's output (the engines' reductions do not depend on how a prompt is split into
steps).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from daskllm.engines.detok import TextStream
from daskllm.engines.kv_cache import ROOT_HASH, BlockManager, hash_block
from daskllm.engines.protocol import SamplingParams, TokenCallback


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    future: Future
    prefill_only: bool = False
    priority: int = 0  # waiting requests start lowest first (a deadline, or a user's priority)
    on_text: TokenCallback | None = None
    text: TextStream | None = None
    generator: torch.Generator | None = None
    matcher: object | None = None  # an llguidance matcher where the output follows a grammar
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain of the registered full blocks
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int | None = None  # prompt tokens the cache served at first admission
    logprobs: list[float] | None = None  # per generated token, when params.logprobs
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def cacheable_limit(self) -> int:
        # A generation must compute at least its last token to get logits; a prefill need not.
        return len(self.token_ids) if self.prefill_only else len(self.token_ids) - 1


def queue_by_priority(waiting: deque[Sequence], seq: Sequence) -> None:
    """Queue ``seq`` behind every waiting sequence of the same or a lower priority value."""
    if not waiting or waiting[-1].priority <= seq.priority:
        waiting.append(seq)  # the common case: O(1)
        return
    at = len(waiting)
    while at and waiting[at - 1].priority > seq.priority:
        at -= 1
    waiting.insert(at, seq)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 copy_rows: Callable[[int, int, int], None] | None = None, *,
                 prefill_chunk: int | None = None, long_prefill: int | None = None,
                 context_cost: float | None = None):
        self.blocks = blocks
        self.copy_rows = copy_rows  # (src block, dst block, rows): copies cached K/V rows
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = max(1, min(prefill_chunk, max_num_batched_tokens)) if prefill_chunk else None
        self.long_prefill = long_prefill  # None: no prefill yields
        self.context_cost = context_cost  # None: chunk limits count tokens (module docstring)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.cached_tokens = 0

    def add(self, arrived) -> None:
        """Queue newly arrived sequences: behind every waiting one of the same or a lower priority value."""
        for seq in arrived:
            queue_by_priority(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick the next step: (sequence, new tokens to compute) pairs."""
        budget = self.max_num_batched_tokens
        shared = self._shared()
        step: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget, shared)
            if not self._grow(seq, seq.num_computed + n):
                if not self._preempt_newest(keep=seq):
                    break
                continue
            step.append((seq, n))
            budget -= n
            i += 1
        # Blocks this step will compute: a waiting request whose next block is among them
        # waits one step and then finds it cached, instead of computing it a second time.
        computing = {h for seq, n in step for h in self._new_block_hashes(seq, n)}
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            self._attach_cached_prefix(seq)
            upcoming = self._new_block_hashes(seq, 1)
            if upcoming and upcoming[0] in computing:
                self._detach(seq)
                deferred.append(seq)
                continue
            n = self._chunk(seq, budget, shared)
            if not self._grow(seq, seq.num_computed + n):
                self._detach(seq)  # holding blocks while waiting could starve the running ones
                self.waiting.appendleft(seq)
                if not self.running and not deferred:  # cannot fit even alone: submit() rules this out
                    raise RuntimeError(f"request {seq.request_id} does not fit in the KV cache")
                break
            if seq.num_cached is None:
                seq.num_cached = min(seq.num_computed, seq.num_prompt_tokens)
                self.cached_tokens += seq.num_cached
            self.running.append(seq)
            computing.update(self._new_block_hashes(seq, n))
            if n:
                step.append((seq, n))
                budget -= n
            else:  # a prefill-only request that was entirely cached
                step.append((seq, 0))
        self.waiting.extendleft(reversed(deferred))
        return step

    def _is_long(self, seq: Sequence) -> bool:
        # By its length, not what is left: a chunk costs more the deeper into the prompt it is.
        return (self.long_prefill is not None and len(seq.token_ids) > self.long_prefill
                and len(seq.token_ids) - seq.num_computed > 1)

    def _shared(self) -> bool:
        """Whether the next step has work besides long prefills (which then yield to it)."""
        if self.long_prefill is None:
            return False
        return any(not self._is_long(seq) for seq in self.running) or any(
            not self._is_long(seq) for seq in self.waiting)

    def _chunk(self, seq: Sequence, budget: int, shared: bool) -> int:
        """Tokens ``seq`` computes in the next step: what it has left, within the budget and
        the chunk; a long prefill in a shared step, at most to the end of its current block."""
        n = min(len(seq.token_ids) - seq.num_computed, budget)
        if n <= 1:
            return n
        bs = self.blocks.block_size
        if shared and self._is_long(seq):
            return min(n, self._tokens_costing(bs, seq.num_computed), bs - seq.num_computed % bs)
        if self.prefill_chunk is None:  # no chunk limit: the step's budget is the only one
            return n
        chunk = self._tokens_costing(self.prefill_chunk, seq.num_computed)
        # A tail of a block or less goes with this chunk: a step of its own would cost a whole
        # pass over the weights for a few tokens.
        return n if n - chunk <= bs else chunk

    def _tokens_costing(self, limit: int, start: int) -> int:
        """How many tokens from position ``start`` on cost at most ``limit`` (at least one)."""
        if self.context_cost is None:
            return limit
        return max(1, int(limit / (1 + start / self.context_cost)))

    def _new_block_hashes(self, seq: Sequence, n: int) -> list[int]:
        """Hashes of the full blocks ``seq`` completes by computing its next ``n`` tokens.

        With ``n=1`` it is the block being started: the one a duplicate prefix would share.
        """
        bs = self.blocks.block_size
        limit = seq.cacheable_limit
        first = len(seq.block_hashes)  # blocks already named
        last = min(seq.num_computed + max(n, bs), limit) // bs
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        out = []
        for idx in range(first, last):
            parent = hash_block(parent, seq.token_ids[idx * bs:(idx + 1) * bs])
            out.append(parent)
        return out

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
        seq.block_table = []

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Name every block that became full in this step, so later requests can reuse it."""
        bs = self.blocks.block_size
        full = seq.num_computed // bs
        for idx in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h, seq.block_table[idx] = self.blocks.register(seq.block_table[idx], parent,
                                                           seq.token_ids[idx * bs:(idx + 1) * bs])
            seq.block_hashes.append(h)

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        cached = self.blocks.match_prefix(seq.token_ids, seq.cacheable_limit)
        seq.block_table = cached
        seq.block_hashes = [self.blocks.blocks[b].hash for b in cached]
        seq.num_computed = len(cached) * self.blocks.block_size
        if self.copy_rows is None:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        hit = self.blocks.match_partial(parent, seq.token_ids[seq.num_computed:seq.cacheable_limit])
        if hit is not None:
            src, rows = hit
            self.blocks.hold(src)  # so allocating the copy cannot evict the original
            new = self.blocks.allocate(1)
            if new is not None:
                self.copy_rows(src, new[0], rows)
                seq.block_table.append(new[0])
                seq.num_computed += rows
            self.blocks.release([src])

    def keep_partial_tail(self, seq: Sequence) -> None:
        """After a prefill: keep its partly filled last block for prompts that continue it."""
        bs = self.blocks.block_size
        full = seq.num_computed // bs
        tail = seq.token_ids[full * bs:seq.num_computed]
        if tail and full < len(seq.block_table):
            parent = seq.block_hashes[full - 1] if full else ROOT_HASH
            self.blocks.register_partial(seq.block_table[full], parent, tail)

    def _detach(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = -(-num_tokens // self.blocks.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        seq.block_table.extend(new)
        return True

    def _preempt_newest(self, keep: Sequence) -> bool:
        victim = self.running[-1]
        if victim is keep and len(self.running) == 1:
            return False
        self.running.pop()
        self._detach(victim)
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim is not keep

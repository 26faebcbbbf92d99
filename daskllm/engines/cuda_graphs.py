"""Steps replayed from CUDA graphs, one captured per bucket of the step's size.

A step of a small model is mostly kernel launches (about ten per layer), each costing more
time to start from Python than the GPU takes to run it: a 16-token prefill step ran 12.6 ms of
wall time for far less kernel time. Replaying a captured graph launches the whole step at once.

Two families of buckets, as vLLM's piecewise graphs bucket by token count:

* **decode**: B sequences of one new token each (1, 2, 4, 8, then every 16 up to
  ``max_num_seqs``); every row's logits come back;
* **mixed**: any step of at most T tokens (16 ... ``MAX_GRAPH_TOKENS``, each bucket at most
  1.5x the one below), prefill chunks and decodes together; the wanted rows' logits are
  gathered.

A step replays the smallest bucket of its family that holds it; a larger step runs eagerly,
where the GPU's time dwarfs the launches anyway. Padding is inert: extra tokens write their
K/V into the cache's scratch block and belong to no attention tile, extra tiles have no rows
(their programs exit at once), extra logit rows gather row 0. Since every kernel computes each
row on its own, padding changes nothing for the real rows, and a replay gives the eager step's
bits. Inputs reach the graphs through one pinned host buffer, uploaded in one copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from daskllm.engines.backends import PagedPlan

logger = logging.getLogger(__name__)

# nano-vllm's and vLLM's decode sizes: every size up to 8, then steps of 16.
_DECODE = (1, 2, 4, 8, *range(16, 1025, 16))
# Token counts of mixed steps: powers of two and the halfway points, so padding wastes < 1/3.
_MIXED = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
MAX_GRAPH_TOKENS = _MIXED[-1]  # beyond it the step's kernels outlast their launches: eager


def buckets(max_batch: int) -> list[int]:
    """Decode bucket sizes up to ``max_batch`` sequences."""
    return [b for b in _DECODE if b < max_batch] + [max_batch]


@dataclass(frozen=True, slots=True)
class Bucket:
    """The fixed shape a captured step has: its capacities, each a slice of the shared buffers."""

    tokens: int
    decode_tiles: int
    prefill_tiles: int
    logit_rows: int  # 0: every token's logits (decode), else the rows gathered
    split_chunks: int

    @property
    def decode(self) -> bool:
        return self.logit_rows == 0


class StepGraphs:
    """Captured steps of one :class:`~daskllm.engines.llama.LlamaModel` (cache allocated, Triton backend)."""

    def __init__(self, model, max_seqs: int, max_tokens: int, capture: bool = True):
        self.model = model
        backend = model.backend
        top = min(max_tokens, MAX_GRAPH_TOKENS)
        mixed = [t for t in _MIXED if t < top] + [top] if top >= _MIXED[0] else []

        def mixed_bucket(tokens: int) -> Bucket:
            return Bucket(tokens, min(tokens, max_seqs), backend.prefill_tile_capacity(tokens, max_seqs),
                          min(tokens, max_seqs), 0)

        self.decode = [Bucket(b, b, 0, 0, backend.split_chunks(b, model.config.max_model_len))
                       for b in buckets(max_seqs)]
        self.mixed = [mixed_bucket(t) for t in mixed]
        self.largest = mixed_bucket(max_tokens)  # an eager step's most: compiled for, never captured
        every = self.decode + self.mixed + [self.largest]
        self.width = -(-model.config.max_model_len // model.block_size)  # block-table columns
        tokens = max(b.tokens for b in every)
        sizes = {"ids": tokens, "positions": tokens, "slots": tokens, "logit_rows": max(b.logit_rows for b in every),
                 "decode_tiles": 4 * max(b.decode_tiles for b in every),
                 "prefill_tiles": 4 * max(b.prefill_tiles for b in every), "tables": max_seqs * self.width}
        # One int32 buffer holds every input, tables last: a step uploads its used prefix in one copy.
        self._offsets, offset = {}, 0
        for name, size in sizes.items():
            self._offsets[name] = (offset, size)
            offset += size
        pinned = model.device.type == "cuda"
        self._host = torch.zeros(offset, dtype=torch.int32, pin_memory=pinned)
        self._np = self._host.numpy()
        self._dev = torch.zeros(offset, dtype=torch.int32, device=model.device)
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if pinned and capture:
            start = time.perf_counter()
            self._fill_padding(self.largest)
            pool = torch.cuda.graph_pool_handle()
            for bucket in sorted(self.decode + self.mixed, key=lambda b: (b.tokens, b.prefill_tiles), reverse=True):
                self._graphs[bucket] = self._capture(bucket, pool)  # largest first: smaller ones reuse its memory
            logger.info("captured %d step graphs (decode batches %s; mixed steps of %s tokens) in %.1f s",
                        len(self._graphs), [b.tokens for b in self.decode], [b.tokens for b in self.mixed],
                        time.perf_counter() - start)

    @torch.inference_mode()
    def walk(self) -> None:
        """Run every bucket's step and the largest eager one on padding (inside ``compile_only``:
        compiles every kernel variant they launch)."""
        for bucket in (*self.decode, *self.mixed, self.largest):
            self._fill_padding(bucket)
            self._forward(bucket)

    # --- which graph --------------------------------------------------------------------------

    def bucket(self, num_tokens: int, num_seqs: int, decode: bool, decode_tiles: int, prefill_tiles: int,
               logit_rows: int) -> Bucket | None:
        """The smallest captured bucket holding a step of this shape (None: run it eagerly)."""
        if decode:
            return next((b for b in self.decode if b.tokens >= num_seqs), None) or self.bucket(
                num_tokens, num_seqs, False, decode_tiles, prefill_tiles, logit_rows)
        return next((b for b in self.mixed if b.tokens >= num_tokens and b.decode_tiles >= decode_tiles
                     and b.prefill_tiles >= prefill_tiles and b.logit_rows >= logit_rows), None)

    # --- a step -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, bucket: Bucket, ids: list[int], positions: list[int], slots: list[int],
            tiles: tuple[np.ndarray, np.ndarray], tables: list[list[int]], logit_rows: list[int]) -> torch.Tensor:
        """Float32 logits on the device: of every token for a decode bucket, else of ``logit_rows``."""
        self._fill(bucket, ids, positions, slots, tiles, tables, logit_rows)
        used = self._offsets["tables"][0] + len(tables) * self.width
        self._dev[:used].copy_(self._host[:used], non_blocking=True)
        if bucket not in self._graphs:  # no CUDA (tests): the same computation, eagerly
            logits = self._forward(bucket)
        else:
            graph, logits = self._graphs[bucket]
            graph.replay()
        return logits[:len(ids) if bucket.decode else len(logit_rows)]

    def _view(self, name: str, n: int, *shape: int) -> torch.Tensor:
        offset, _ = self._offsets[name]
        return self._dev[offset:offset + n].view(*shape) if shape else self._dev[offset:offset + n]

    def _forward(self, bucket: Bucket) -> torch.Tensor:
        t = bucket.tokens
        plan = PagedPlan(self._view("decode_tiles", 4 * bucket.decode_tiles, bucket.decode_tiles, 4),
                         self._view("prefill_tiles", 4 * bucket.prefill_tiles, bucket.prefill_tiles, 4),
                         self._view("tables", self._offsets["tables"][1], -1, self.width), bucket.split_chunks)
        rows = slice(None) if bucket.decode else self._view("logit_rows", bucket.logit_rows)
        return self.model.run(self._view("ids", t), self._view("positions", t), self._view("slots", t), plan, rows)

    @torch.inference_mode()
    def _capture(self, bucket: Bucket, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture: kernels compile, the allocator settles
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine of the worker may be loading on another thread meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = self._forward(bucket)
        return graph, logits

    def _region(self, name: str) -> np.ndarray:
        offset, size = self._offsets[name]
        return self._np[offset:offset + size]

    def _fill_padding(self, bucket: Bucket) -> None:
        """Every input of ``bucket`` padding: what the capture runs on."""
        self._fill(bucket, [], [], [], (np.zeros((0, 4), np.int32), np.zeros((0, 4), np.int32)), [], [])
        self._dev.copy_(self._host)

    def _fill(self, bucket: Bucket, ids, positions, slots, tiles, tables, logit_rows) -> None:
        n, t = len(ids), bucket.tokens
        scratch = self.model.scratch_block * self.model.block_size
        for name, values, pad in (("ids", ids, 0), ("positions", positions, 0), ("slots", slots, scratch)):
            region = self._region(name)
            region[:n], region[n:t] = values, pad
        if not bucket.decode:
            region = self._region("logit_rows")
            region[:len(logit_rows)], region[len(logit_rows):bucket.logit_rows] = logit_rows, 0
        for name, array, capacity in (("decode_tiles", tiles[0], bucket.decode_tiles),
                                      ("prefill_tiles", tiles[1], bucket.prefill_tiles)):
            region = self._region(name)[:4 * capacity].reshape(capacity, 4)
            region[:len(array)], region[len(array):] = array, 0  # padding tiles: no rows
        table_rows = self._region("tables").reshape(-1, self.width)
        for i, table in enumerate(tables):
            table_rows[i, :len(table)] = table

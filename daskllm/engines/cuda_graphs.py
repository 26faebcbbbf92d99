"""Decode steps replayed from CUDA graphs, one captured per batch-size bucket.

A decode step of a small model is mostly kernel launches (a dozen per layer), each costing
the GPU more time to start from Python than to run. Replaying a captured graph launches the
whole step at once. A step of B sequences replays the graph of the smallest bucket >= B;
rows past B are padding: they read position 0 and write their K/V into the cache's scratch
block, and since every kernel computes each row on its own they change nothing for the real
rows. Inputs reach the graph through fixed device buffers, filled from pinned host buffers.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from daskllm.engines.backends import PagedPlan

logger = logging.getLogger(__name__)

# nano-vllm's and vLLM's choice: every size up to 8, then steps of 16.
_BUCKETS = (1, 2, 4, 8, *range(16, 1025, 16))


def buckets(max_batch: int) -> list[int]:
    return [b for b in _BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    """Captured decode steps of one :class:`~daskllm.engines.llama.LlamaModel` (cache allocated)."""

    def __init__(self, model, max_batch: int):
        self.model = model
        self.buckets = buckets(max_batch)
        width = -(-model.config.max_model_len // model.block_size)
        shapes = {"ids": ((max_batch,), torch.long), "positions": ((max_batch,), torch.long),
                  "slots": ((max_batch,), torch.long), "tiles": ((max_batch, 4), torch.int32),
                  "tables": ((max_batch, width), torch.int32)}
        pinned = model.device.type == "cuda"
        self._host = {k: torch.zeros(s, dtype=d, pin_memory=pinned) for k, (s, d) in shapes.items()}
        self._np = {k: v.numpy() for k, v in self._host.items()}
        self._dev = {k: torch.zeros(s, dtype=d, device=model.device) for k, (s, d) in shapes.items()}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        start = time.perf_counter()
        self._fill([], [], [], [], max_batch)  # every row padding while capturing
        self._upload(max_batch)
        if pinned:
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                self._graphs[b] = self._capture(b, pool)
            logger.info("captured %d decode graphs (batch sizes %s) in %.1f s", len(self.buckets),
                        self.buckets, time.perf_counter() - start)

    def _forward(self, b: int) -> torch.Tensor:
        d = self._dev
        plan = PagedPlan(d["tiles"][:b], d["tables"][:b])
        return self.model.run(d["ids"][:b], d["positions"][:b], d["slots"][:b], plan, slice(None))

    @torch.inference_mode()
    def _capture(self, b: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture: kernels compile, the allocator settles
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine of the worker may be loading on another thread meanwhile.
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            logits = self._forward(b)
        return graph, logits

    def bucket(self, batch: int) -> int | None:
        """The graph a decode step of ``batch`` sequences replays (None: too many for any)."""
        return next((b for b in self.buckets if b >= batch), None)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits [B, vocab] (float32, on the device) of a decode step of B = len(ids) sequences."""
        b = self.bucket(len(ids))
        self._fill(ids, positions, slots, tables, b)
        self._upload(b)
        if b not in self._graphs:  # no CUDA (tests): the same computation, eagerly
            return self._forward(b)[:len(ids)]
        graph, logits = self._graphs[b]
        graph.replay()
        return logits[:len(ids)]

    def _fill(self, ids, positions, slots, tables, b: int) -> None:
        n, h = len(ids), self._np
        scratch = self.model.scratch_block
        h["ids"][:n], h["ids"][n:b] = ids, 0
        h["positions"][:n], h["positions"][n:b] = positions, 0
        h["slots"][:n], h["slots"][n:b] = slots, scratch * self.model.block_size
        rows = np.arange(b, dtype=np.int32)
        h["tiles"][:b, 0] = rows  # tile i: row i of the step, sequence i, one query
        h["tiles"][:b, 1] = rows
        h["tiles"][:b, 2] = 1
        h["tiles"][:b, 3] = h["positions"][:b]
        for i, table in enumerate(tables):
            h["tables"][i, :len(table)] = table
        h["tables"][n:b, 0] = scratch

    def _upload(self, b: int) -> None:
        for name, host in self._host.items():
            self._dev[name][:b].copy_(host[:b], non_blocking=True)

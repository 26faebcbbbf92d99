"""Triton kernels of the torch engine on a GPU, batch-invariant by construction.

A row's result must not depend on the other rows of the step, or greedy tokens would depend
on what a request was batched with. cuBLAS and torch's reductions choose their kernels, and
so their reduction order, by the number of rows; these kernels do not. One idea a module:

* :mod:`.matmul`: the projections. Each output element is reduced over K in one order, by
  one kind of tensor-core instruction, whatever the row count (no split-K); the tile follows
  the row count only where that reduction stays the same, checked on the device.
* :mod:`.norms`: RMSNorm, fused with the residual add before it, and SiLU x up; one program
  per row, one fixed-size reduction.
* :mod:`.rotary`: the rotary embedding of q and k fused with the KV-cache write.
* :mod:`.attention`: paged attention over the KV cache's block tables, keys in fixed tiles and
  chunks in position order with an online softmax; decode tiles, prefill tiles and the split
  over the context give a row the same bits.
* :mod:`._launch`: launching them, or compiling them without running them.

What shapes a reduction (a product's ``block_k``, attention's key tile and chunk) is fixed
in its module: changing it changes the bits. The kernels also run under
``TRITON_INTERPRET=1`` on CPU tensors, which is how the CPU test suite checks them.
"""

from daskllm.engines.triton_kernels._launch import compile_only, compiling_only
from daskllm.engines.triton_kernels.attention import (
    CHUNK_KEYS,
    DECODE_ROWS,
    KV_TILE,
    PREFILL_ROWS,
    AttentionLayout,
    fast_layout,
    paged_attention,
    positions_per_tile,
    self_check,
)
from daskllm.engines.triton_kernels.matmul import MatmulConfig, Product, load_plans, matmul, plan_key, verify
from daskllm.engines.triton_kernels.norms import add_rms_norm, rms_norm, silu_mul
from daskllm.engines.triton_kernels.rotary import rope_and_cache

__all__ = ["CHUNK_KEYS", "DECODE_ROWS", "KV_TILE", "PREFILL_ROWS", "AttentionLayout", "MatmulConfig", "Product", "add_rms_norm", "compile_only", "compiling_only", "fast_layout", "load_plans",
           "matmul", "paged_attention", "plan_key", "positions_per_tile", "rms_norm", "rope_and_cache", "self_check",
           "silu_mul", "verify"]

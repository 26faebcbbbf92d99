"""Triton kernels of the torch engine on a GPU, batch-invariant by construction.

A row's result must not depend on the other rows of the step, or greedy tokens would depend
on what a request was batched with. cuBLAS and torch's reductions choose their kernels, and
so their reduction order, by the number of rows; these kernels do not. One idea a module:

* :mod:`.matmul`: the projections. Each output element is reduced over K in one order, by
  one kind of tensor-core instruction, whatever the row count (no split-K).
* :mod:`.norms`: RMSNorm, fused with the residual add before it, and SiLU x up; one program
  per row, one fixed-size reduction.
* :mod:`.attention`: paged attention over the KV cache's block tables, keys in fixed tiles in
  position order with an online softmax.

Every constant that shapes a reduction (tile sizes, warps) is fixed in its module: changing
one changes the bits. The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors, which
is how the CPU test suite checks them.
"""

from daskllm.engines.triton_kernels.attention import BLOCK_Q, KV_TILE, paged_attention
from daskllm.engines.triton_kernels.matmul import matmul
from daskllm.engines.triton_kernels.norms import rms_norm

__all__ = ["BLOCK_Q", "KV_TILE", "matmul", "paged_attention", "rms_norm"]

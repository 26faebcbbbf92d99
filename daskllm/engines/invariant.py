"""Batch-invariant primitives: a row's result must not depend on the other rows.

Two ways to get a matrix product whose every row has the same bits whatever the row count:

* :class:`Linear` (the Llama engine's projections): on CPU in float32 (and in bfloat16
  where the CPU has bf16 instructions) the weight is reordered once into oneDNN's blocked layout and every product runs oneDNN's kernel for
  that layout, which is batch-invariant for *any* row count, 1 included. So a lone decode
  row costs a matrix-vector product's time instead of a padded 4-row GEMM's (about 3x less
  on the machines measured), and 32 rows run faster than MKL's GEMM too.
* :func:`linear` (the fallback, and the BERT engine): the CPU GEMM kernels give every row
  the same bits for any row count that is a multiple of ``ROW_MULTIPLE``; below it (and,
  with several threads, at other counts that are not multiples of it) they switch to
  kernels that round differently. Padding the row count is all it takes. MKL's default
  kernels on AVX2 switch below 4 rows; its compatible code path (``MKL_CBWR=COMPATIBLE``,
  what it runs on CPUs it has no tuned kernels for) below 8, so rows are padded to 8.
  One case is left to MKL: with several threads, that path gives small products
  (K=96, N=40) other bits at other row counts.

``tests/test_batch_invariance.py`` checks both properties on the machine it runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 8


def pad_rows(n: int) -> int:
    return max(ROW_MULTIPLE, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended so its first dimension is ``pad_rows`` of it."""
    extra = pad_rows(x.shape[0]) - x.shape[0]
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, extra)) if extra else x


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every row is batch-invariant."""
    n = x.shape[0]
    return F.linear(padded(x), weight, bias)[:n]


def _onednn_usable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                             and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """A weight (and bias) prepared once for batch-invariant products: ``Linear(w, b)(x)``.

    ``weight`` is [out, in] as in ``F.linear``; ``x`` is [rows, in]. The unprepared weight
    is not kept (``packed`` tells which path is in use).
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True):
        self.bias = bias
        self.packed = pack and _onednn_usable(weight)
        # batch_size=None: a layout not tuned to one row count, so every count runs the same kernel.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)

"""Batch-invariant primitives: a row's result must not depend on the other rows.

The CPU GEMM kernels give every row of a matrix product the same bits for any row count
that is a multiple of ``ROW_MULTIPLE``; for 1-3 rows (and, with several threads, other
counts that are not multiples of 4) they switch to kernels that round differently.
Padding the row count is all it takes. ``tests/test_batch_invariance.py`` checks the
property on the machine it runs on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 4


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

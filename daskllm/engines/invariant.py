"""Batch-invariant products: a row's result must not depend on the other rows.

A CPU matrix-product library picks its kernel (blocking, order of the K sum) by the call's
shape, row count included, so a row can get other bits when other rows share the call. Two
ways around that, chosen per dtype on the machine at hand:

* **Any row count (from a floor)**: oneDNN's kernel for a weight reordered once into its
  blocked layout gives every row the same bits for any row count on some CPUs, 1 included,
  and from a few rows on others (from 2 rows in float32 on Intel AVX-512 CPUs, where a lone
  row runs a matrix-vector kernel that sums K in another order). :func:`min_rows` probes the
  floor once per process and dtype; calls with fewer rows are padded to it. A lone decode row then costs
  about a matrix-vector product's time.
* **Fixed-size calls**: where no small floor exists (bfloat16 on CPUs with AMX, whose kernels
  tile the rows and the K sum by the row count), every call has exactly ``BLOCK_ROWS`` rows
  (zero rows pad the last one), so every call runs the same kernel and a row's bits depend
  only on its own values. :func:`linear` (``F.linear``, where oneDNN does not apply: float16,
  float64, a build without it) always does this: MKL's kernels switch with the row count
  below 8 rows on AVX2 and below 16 on AVX-512, and, with several threads, split the rows
  between threads by the count.

``tests/test_batch_invariance.py`` checks both on the machine it runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

# Rows per call of a fixed-size product: large enough for AMX and AVX-512 kernels to run at
# full speed on prefill steps, small enough that a padded decode step stays cheap
# (docs/engine.md, "How the forward pass avoids it").
BLOCK_ROWS = 64

# Attention's query rows per KV head are padded to a multiple of this (engines/backends.py):
# the batched products there keep their bits for any such count on the CPUs measured.
ROW_MULTIPLE = 8

Kernel = Literal["onednn", "onednn-blocks", "blocks"]


def pad_rows(n: int) -> int:
    return max(ROW_MULTIPLE, -(-n // ROW_MULTIPLE) * ROW_MULTIPLE)


def in_blocks(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``product(x)`` for ``x`` [rows, K], by calls of exactly ``BLOCK_ROWS`` rows each."""
    n = x.shape[0]
    extra = -n % BLOCK_ROWS
    blocks = [product(rows) for rows in (F.pad(x, (0, 0, 0, extra)) if extra else x).split(BLOCK_ROWS)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:n]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every row is batch-invariant (fixed-size calls)."""
    return in_blocks(lambda rows: F.linear(rows, weight, bias), x)


def _onednn_usable(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                             and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    # batch_size=None: a layout not tuned to one row count.
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _onednn_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# (K, N) of the probe: shapes whose products showed row-count-dependent kernels where there are
# any (AMX's bfloat16 kernels: all three; AVX-512's float32 kernels: a lone row at K = 1536).
PROBE_SHAPES = ((704, 256), (576, 1536), (1536, 576))
PROBE_ROWS = 256
PROBE_COUNTS = (*range(1, 41), 48, 64, 100, 128, 200)
# A kernel whose bits change above this many rows is run in fixed-size calls instead.
MAX_MIN_ROWS = 16


@functools.cache
def min_rows(dtype: torch.dtype) -> int | None:
    """The fewest rows from which oneDNN's prepared-weight products in ``dtype`` give each row
    the same bits at any row count on this CPU (1: from a lone row; None: no such count up to
    ``MAX_MIN_ROWS``). Probed once per process, in well under a second."""
    gen = torch.Generator().manual_seed(0)
    worst = 0  # the largest row count whose rows got other bits
    with torch.inference_mode():
        for k, n in PROBE_SHAPES:
            packed = _reorder((torch.randn(n, k, generator=gen) * 0.1).to(dtype))
            product = functools.partial(_onednn_product, packed=packed, bias=None)
            x = torch.randn(PROBE_ROWS, k, generator=gen).to(dtype)
            full = product(x)
            for rows in PROBE_COUNTS:
                if not (torch.equal(product(x[:rows]), full[:rows])
                        and torch.equal(product(x[-rows:]), full[-rows:])):
                    worst = max(worst, rows)
    return worst + 1 if worst < MAX_MIN_ROWS else None


class Linear:
    """A weight (and bias) prepared once for batch-invariant products: ``Linear(w, b)(x)``.

    ``weight`` is [out, in] as in ``F.linear``; ``x`` is [rows, in]. ``kernel`` says which way
    (module docstring): ``onednn`` (any row count from ``min_rows`` up: fewer are padded with
    zero rows), ``onednn-blocks`` (oneDNN in fixed-size calls) or ``blocks`` (``F.linear`` in
    fixed-size calls); ``packed``, whether oneDNN runs them. The unprepared weight is not kept.
    """

    __slots__ = ("weight", "bias", "kernel", "min_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True):
        self.bias = bias
        packed = pack and _onednn_usable(weight)
        self.weight = _reorder(weight) if packed else weight
        floor = min_rows(weight.dtype) if packed else None
        self.kernel: Kernel = "blocks" if not packed else "onednn" if floor is not None else "onednn-blocks"
        self.min_rows = floor or BLOCK_ROWS

    @property
    def packed(self) -> bool:
        """Whether oneDNN runs the products (on the weight in its blocked layout)."""
        return self.kernel != "blocks"

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return _onednn_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != "onednn":
            return in_blocks(self._product, x)
        n = x.shape[0]
        if n >= self.min_rows:
            return self._product(x)
        return self._product(F.pad(x, (0, 0, 0, self.min_rows - n)))[:n]

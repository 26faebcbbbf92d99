"""Batch-invariant products: a row's result must not depend on the other rows.

A CPU matrix-product library picks its kernel (blocking, order of the K sum) by the call's
shape, row count included, so a row can get other bits when other rows share the call. Two
ways around that, chosen once per process and dtype on the machine at hand (:func:`path_for`,
logged once):

* **Any row count (from a floor)**: oneDNN's kernel for a weight reordered once into its
  blocked layout gives every row the same bits for any row count on some CPUs, 1 included,
  and from a few rows on others (from 2 rows in float32 on AVX-512 CPUs, where a lone row runs
  a matrix-vector kernel that sums K in another order). :func:`min_rows` probes the floor;
  calls with fewer rows are padded to it. A lone decode row then costs about a matrix-vector
  product's time.
* **Fixed-size calls**: where no small floor exists (bfloat16 on CPUs with AMX, whose kernels
  tile the rows and the K sum by the row count), every call has exactly ``BLOCK_ROWS`` rows
  (zero rows pad the last one), so every call runs the same kernel and a row's bits depend
  only on its own values. :func:`linear` (``F.linear``, where oneDNN does not apply: float16,
  float64, a build without it) always does this: MKL's kernels switch with the row count
  below 8 rows on AVX2 and below 16 on AVX-512, and, with several threads, split the rows
  between threads by the count.

bfloat16 needs oneDNN's bfloat16 kernels, which exist only on CPUs with AVX-512 (BW, VL, DQ) or
AVX-NE-CONVERT. Elsewhere (AVX2-only CPUs, or any CPU under ``ONEDNN_MAX_CPU_ISA=AVX2``) a
bfloat16 weight is widened once to float32 and runs float32's way; each call widens its rows
and rounds the results back to bfloat16. That is what a bfloat16 kernel computes (exact
products, summed in float32, rounded once), at float32's speed and weight memory: ``F.linear``
in bfloat16 there falls back to torch's reference loops, 4.5-50x slower (docs/engine.md).

``tests/test_batch_invariance.py`` checks every way on the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

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


def _onednn_computes(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs prepared-weight products in ``dtype`` on this CPU."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    # oneDNN's own check, which honours ONEDNN_MAX_CPU_ISA: bfloat16 needs AVX-512 or AVX-NE-CONVERT
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
    ``MAX_MIN_ROWS``, or oneDNN has no kernels for ``dtype`` here). Probed once per process, in
    well under a second."""
    if not _onednn_computes(dtype):
        return None
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


@dataclasses.dataclass(frozen=True)
class Path:
    """How products of one dtype run batch-invariant on this CPU (module docstring)."""

    dtype: torch.dtype  # of the weights, the rows and the results
    compute: torch.dtype  # what the kernel computes in: ``dtype``, or float32 for a widened bfloat16
    kernel: Kernel  # onednn: any row count from min_rows; onednn-blocks, blocks: BLOCK_ROWS-row calls
    min_rows: int  # a call's fewest rows (fewer are padded with zero rows)

    @property
    def packed(self) -> bool:
        """Whether oneDNN runs the products (on the weight in its blocked layout)."""
        return self.kernel != "blocks"

    def __str__(self) -> str:
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        rows = "any row count" if self.min_rows == 1 else f"calls of at least {self.min_rows} rows"
        how = {"onednn": f"oneDNN on prepared weights, {rows}",
               "onednn-blocks": f"oneDNN on prepared weights, calls of exactly {BLOCK_ROWS} rows",
               "blocks": f"F.linear, calls of exactly {BLOCK_ROWS} rows"}[self.kernel]
        widened = f" (widened to {name(self.compute)}: oneDNN has no {name(self.dtype)} kernels on this CPU)"
        return f"{name(self.dtype)} products: {how}{widened if self.compute != self.dtype else ''}"


def unpacked(dtype: torch.dtype) -> Path:
    """``F.linear`` in fixed-size calls: the way that needs no oneDNN."""
    return Path(dtype, dtype, "blocks", BLOCK_ROWS)


def widened(dtype: torch.dtype) -> Path:
    """``dtype`` run float32's way on this CPU (bfloat16 where oneDNN has no bfloat16 kernels)."""
    return dataclasses.replace(path_for(torch.float32), dtype=dtype)


@functools.cache
def path_for(dtype: torch.dtype) -> Path:
    """The way products in ``dtype`` run on this CPU: probed once per process, and logged (at
    INFO; a warning where bfloat16 is widened)."""
    if _onednn_computes(dtype):
        floor = min_rows(dtype)
        chosen = Path(dtype, dtype, "onednn" if floor else "onednn-blocks", floor or BLOCK_ROWS)
    elif dtype == torch.bfloat16 and _onednn_computes(torch.float32):
        chosen = widened(dtype)
    else:
        chosen = unpacked(dtype)
    # a warning where bfloat16 is widened: its weights then take float32's memory for no speed
    logger.log(logging.WARNING if chosen.compute != dtype else logging.INFO, "batch-invariant %s", chosen)
    return chosen


class Linear:
    """A weight (and bias) prepared once for batch-invariant products: ``Linear(w, b)(x)``.

    ``weight`` is [out, in] as in ``F.linear``; ``x`` is [rows, in] of the weight's dtype, as is
    the result. ``path`` is how the products run: by default this CPU's path for the weight's
    dtype (:func:`path_for`), :func:`unpacked` off the CPU. The unprepared weight is not kept.
    """

    __slots__ = ("weight", "bias", "path")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, path: Path | None = None):
        if path is None:
            path = path_for(weight.dtype) if weight.device.type == "cpu" else unpacked(weight.dtype)
        if path.dtype != weight.dtype:
            raise ValueError(f"a path for {path.dtype} products given a {weight.dtype} weight")
        self.path = path
        weight = weight.to(self.path.compute)
        self.bias = None if bias is None else bias.to(self.path.compute)
        self.weight = _reorder(weight) if self.path.packed else weight

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.path.packed:
            return _onednn_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(self.path.compute)
        n = x.shape[0]
        if self.path.kernel != "onednn":
            y = in_blocks(self._product, x)
        elif n >= self.path.min_rows:
            y = self._product(x)
        else:
            y = self._product(F.pad(x, (0, 0, 0, self.path.min_rows - n)))[:n]
        return y.to(dtype)

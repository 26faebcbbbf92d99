"""Triton's interpreter (``TRITON_INTERPRET=1``) fit to check the Triton kernels' bits on a CPU.

Used by tests/test_triton_kernels.py and by ``bench/gpu_kernel_bits.py --device cpu``. Two
changes, undone on exit:

* Triton 3.6's interpreter turns a loop bound into an int with ``int(array)``, which numpy
  >= 2.4 refuses for the 1-element arrays it holds scalars in.
* ``tl.dot`` on floats becomes a sum over K in index order (:func:`_dot_in_k_order`).
* float32 to bfloat16 rounds to nearest even, as a GPU's conversion does (the interpreter
  truncates), and both directions take a few numpy operations (:func:`_bfloat16_casts`).
"""

from __future__ import annotations

import contextlib

import numpy as np
from collections.abc import Iterator


def on_device(device: str) -> contextlib.AbstractContextManager:
    """Where a bench script runs the kernels: on ``cpu`` this interpreter (TRITON_INTERPRET=1, set
    before the kernels' module is imported), else the GPU as it is. Exits naming what is missing."""
    import os
    import sys

    import torch

    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # @triton.jit reads the switch when it decorates
        if os.environ["TRITON_INTERPRET"] != "1":
            sys.exit("--device cpu runs the kernels under Triton's interpreter: TRITON_INTERPRET must be 1")
        return kernel_check_interpreter()
    if not torch.cuda.is_available():
        sys.exit(f"no CUDA device for --device {device}; --device cpu runs the kernels under Triton's interpreter")
    return contextlib.nullcontext()


@contextlib.contextmanager
def kernel_check_interpreter() -> Iterator[None]:
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl
    interpreter._patch_lang_tensor = patched
    builder.create_dot = _dot_in_k_order(dot, interpreter.TensorHandle)
    builder.cast_impl = _bfloat16_casts(cast, interpreter.TensorHandle)
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = patch
        builder.create_dot, builder.cast_impl = dot, cast


def _dot_in_k_order(dot, tensor_handle):
    """The interpreter's ``tl.dot`` as a sum over K in index order, row by row.

    The interpreter computes a float dot with ``np.matmul``, i.e. the host's BLAS, on the
    whole tile. Whether a row's bits then depend on where it sits in the tile (and so on the
    other rows) is a property of the BLAS kernel the CPU gets (numpy's OpenBLAS: yes with its
    Haswell and Zen kernels, no with Sandybridge), not of the Triton kernel under test. Summed
    here in a fixed order with plain float multiplies and adds, a row's bits depend on that
    row and the other operand only, on every host, so a row-invariance check compares the
    kernels' own logic (tiles, masks, the K loop and its accumulator) bit for bit.
    """

    def in_k_order(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype.kind != "f" or b.data.dtype.kind != "f":  # fp8 (held as raw bytes) and integers
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        lhs, rhs = a.data.astype(d.data.dtype), b.data.astype(d.data.dtype)
        products = lhs[..., :, :, None] * rhs[..., None, :, :]  # [..., M, K, N], each product rounded once
        # add.accumulate sums strictly left to right (add.reduce would pair terms up): K in index order.
        total = np.add.accumulate(products, axis=-2)[..., -1, :]
        return tensor_handle(total + d.data, d.dtype.scalar)  # as np.matmul(a, b) + d: the product, then acc

    return in_k_order


def _bfloat16_casts(cast, tensor_handle):
    """The interpreter's casts, with float32 <-> bfloat16 (held as uint16) done on the bits:
    round to nearest even downwards (NaN stays NaN), exact upwards."""
    import triton.language as tl

    def bf16_aware(self, src, dst_type):
        src_type, dst = src.dtype.scalar, dst_type.scalar
        if src_type == tl.float32 and dst == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
            nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
            return tensor_handle(np.where(nan, np.uint16(0x7FC0), rounded), dst)
        if src_type == tl.bfloat16 and dst == tl.float32:
            return tensor_handle((src.data.astype(np.uint32) << 16).view(np.float32), dst)
        return cast(self, src, dst_type)

    return bf16_aware

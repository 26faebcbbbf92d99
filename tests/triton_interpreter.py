"""Triton's interpreter (``TRITON_INTERPRET=1``) fit to check the Triton kernels' bits on a CPU.

Used by tests/test_triton_kernels.py and by ``bench/gpu_kernel_bits.py --device cpu``. Two
changes, undone on exit:

* Triton 3.6's interpreter turns a loop bound into an int with ``int(array)``, which numpy
  >= 2.4 refuses for the 1-element arrays it holds scalars in.
* ``tl.dot`` on floats becomes a sum over K in index order (:func:`_dot_in_k_order`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def kernel_check_interpreter() -> Iterator[None]:
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    dot = interpreter.InterpreterBuilder.create_dot
    interpreter._patch_lang_tensor = patched
    interpreter.InterpreterBuilder.create_dot = _dot_in_k_order(dot, interpreter.TensorHandle)
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = patch
        interpreter.InterpreterBuilder.create_dot = dot


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
        total = lhs[..., :, 0, None] * rhs[..., None, 0, :]
        for k in range(1, lhs.shape[-1]):
            total += lhs[..., :, k, None] * rhs[..., None, k, :]
        return tensor_handle(total + d.data, d.dtype.scalar)  # as np.matmul(a, b) + d: the product, then acc

    return in_k_order

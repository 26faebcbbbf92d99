"""Kernel launches, and compiling them without running them.

:func:`launch` is ``kernel[grid](*args, **kwargs)``, except inside :func:`compile_only`: there a
launch compiles its kernel for the arguments' specialization (Triton's warm-up) and runs
nothing. Walking a forward pass inside it compiles every kernel variant that pass launches, and
with ``workers`` the compilations run together on a thread pool (Triton's AsyncCompileMode, its
compiler releasing the GIL), the context waiting for them all on exit. That is how an engine
compiles its kernels at start-up in parallel rather than one at a time at first launch, and how
``bench/gpu_compile_check.py`` compiles them for a GPU on a machine without one. Outputs written
inside the context are garbage: nothing may read them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import triton

_COMPILE_ONLY: ContextVar[bool] = ContextVar("daskllm_triton_compile_only", default=False)


def launch(kernel, grid, *args, **kwargs) -> None:
    kernel.run(*args, grid=grid, warmup=_COMPILE_ONLY.get(), **kwargs)


def compiling_only() -> bool:
    return _COMPILE_ONLY.get()


@contextlib.contextmanager
def compile_only(workers: int = 1) -> Iterator[None]:
    """Launches in this thread compile and do not run (on ``workers`` threads when more than one)."""
    token = _COMPILE_ONLY.set(True)
    try:
        if workers > 1:
            # ignore_errors: a variant that does not compile raises where it is launched for real
            # (a product's verification drops such a config; any other kernel fails its step).
            with ThreadPoolExecutor(workers, thread_name_prefix="daskllm-triton-compile") as pool, \
                    triton.AsyncCompileMode(pool, ignore_errors=True):
                yield
        else:
            yield
    finally:
        _COMPILE_ONLY.reset(token)

"""One thread per process does the engines' torch work on CPU: :func:`run`.

torch's CPU thread pool is GNU OpenMP's, which gives every thread that starts parallel work a
team of its own. Once the teams together hold more threads than the machine has cores,
libgomp lets idle team threads spin only briefly (a fixed count that ``GOMP_SPINCOUNT`` cannot
raise) before they sleep, so each of a forward pass's many small operations pays to wake
them. Measured on 2 cores: the same `smollm2` forward pass over 4,096 tokens took 14 s on a
process's only computing thread and 21-22 s on a second one, its small operations 1.5-4x
slower. A worker whose LLM, embedding and reranking engines each computed on their own
thread (and loaded on yet another) paid that on every step. So engines load their models
and run their batches here, and a process has one team.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_local = threading.local()
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pid = 0


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread (inline when already there); its result or
    its exception."""
    if getattr(_local, "computing", False):
        return fn(*args, **kwargs)
    return _executor().submit(_call, fn, args, kwargs).result()


def set_num_threads(n: int) -> None:
    """torch's intra-op threads, for the calling thread and the compute thread (OpenMP keeps the
    setting per thread)."""
    torch.set_num_threads(n)
    run(torch.set_num_threads, n)


def _call(fn, args, kwargs):
    _local.computing = True
    return fn(*args, **kwargs)


def _executor() -> ThreadPoolExecutor:
    global _pool, _pid
    with _lock:
        if _pool is None or _pid != os.getpid():  # a forked child has no thread behind the old pool
            _pool, _pid = ThreadPoolExecutor(1, thread_name_prefix="daskllm-compute"), os.getpid()
        return _pool

"""vLLM's general plugin (entry point ``vllm.general_plugins``): an engine core ends with the
process that started it.

vLLM runs each engine's core in a child process and ends it on a clean shutdown only: a Dask
worker killed with SIGKILL (by the OOM killer, a nanny, a user) would leave its engine core
running, holding cores and memory. vLLM loads general plugins in every process it starts;
this one, in a child of the daskllm process named by ``DASKLLM_VLLM_PARENT`` (the engine
sets it while starting), watches for that parent to disappear and then kills its own process.
It imports nothing beyond the standard library and does nothing elsewhere.
"""

from __future__ import annotations

import os
import signal
import threading

PARENT_ENV = "DASKLLM_VLLM_PARENT"
POLL_SECONDS = 0.5


def follow_parent() -> None:
    """Called by vLLM in each of its processes; watches only in a direct child of daskllm's."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not parent.isdigit() or os.getppid() != int(parent) or os.getpid() == int(parent):
        return
    threading.Thread(target=_exit_with, args=(int(parent),), daemon=True, name="daskllm-parent-watch").start()


def _exit_with(parent: int) -> None:
    # A child whose parent dies is re-parented (to init or a subreaper): its parent pid changes.
    while os.getppid() == parent:
        threading.Event().wait(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)

"""A Ctrl-C (or SIGTERM) while the ``daskllm`` command imports its modules (seconds: pandas,
dask.dataframe) ends it quietly, with status 0: nothing has started yet that needs closing.

Only in the command's own process (``daskllm ...``, ``python -m daskllm.cli ...``): a program
that imports daskllm keeps its own signal handling. The command's ``main`` restores Python's
default once its modules are in, and ``daskllm serve`` installs its own (close, then exit).
"""

from __future__ import annotations

import os
import signal
import sys


def _exit_quietly(signum, frame) -> None:
    os._exit(0)


def is_the_command() -> bool:
    """This process is the ``daskllm`` command (the console script, or ``python -m daskllm.cli``)."""
    argv = list(getattr(sys, "orig_argv", ()))
    by_module = "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["daskllm.cli"]
    return by_module or os.path.basename(sys.argv[0]) == "daskllm"


def quiet_until_started() -> None:
    if is_the_command():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _exit_quietly)


def started() -> None:
    """The command's modules are in: Ctrl-C is Python's KeyboardInterrupt again, SIGTERM a plain end."""
    if is_the_command():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

"""Engines' background threads stop before the interpreter finalizes.

An engine's loop (or request batcher) is a daemon thread that may hold torch state. If it is
still alive while the interpreter tears down, the process can abort at exit ("terminate called
without an active exception", status 134) after a script has printed its answers. Everything
registered here is closed by an ``atexit`` hook, which runs before that teardown.
"""

from __future__ import annotations

import atexit
import logging
import weakref

logger = logging.getLogger(__name__)

_open: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(closeable) -> None:
    """Close ``closeable`` (anything with an idempotent ``close()``) at interpreter exit, if it
    is still alive then; it is not kept alive by this."""
    _open.add(closeable)


@atexit.register
def _close_all() -> None:
    for closeable in list(_open):
        try:
            closeable.close()
        except Exception:  # noqa: BLE001 - exiting anyway: say so, close the rest
            logger.warning("daskllm: could not close %r at exit", closeable, exc_info=True)

"""Engines' background threads are stopped at interpreter exit (a script that never closes its
engines used to abort at exit now and then: "terminate called without an active exception")."""

from __future__ import annotations

import gc
import weakref

from daskllm.engines import lifecycle
from daskllm.engines.batcher import Batcher


def test_the_exit_hook_closes_every_open_batcher_and_forgets_collected_ones(monkeypatch):
    # Only this test's objects: the hook must not close engines other tests of this process share.
    monkeypatch.setattr(lifecycle, "_open", weakref.WeakSet())
    running = Batcher(lambda items: [i * 2 for i in items], max_batch_items=8, name="test-exit")
    assert running.submit([1, 2]).result(timeout=30) == [2, 4]
    closed = Batcher(lambda items: items, max_batch_items=8, name="test-closed")
    closed.close()
    lifecycle._close_all()  # what atexit runs
    assert not running._thread.is_alive()
    assert not closed._thread.is_alive()  # closing twice is harmless
    gone = weakref.ref(closed)
    del closed
    gc.collect()
    assert gone() is None  # the exit hook holds no engine alive

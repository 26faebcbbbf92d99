"""Docs examples on a shared cluster.

Most docs examples start a ``LocalLLMCluster``: 7-11 s each here (workers, models, the first
call) of an example that computes for a second or two. tests/test_docs.py runs an example that
starts one cluster, and reaches it only through ``Client(cluster)``, on a cluster a host
process keeps for the test process's session instead:

- the host (``python docs_cluster.py SOCKET``, started by the test process with the examples'
  environment) starts a ``LocalLLMCluster`` with the arguments an example gives, keeps the last
  ``KEEP`` of them, and empties a kept one's caches before it serves the next example
  (``cold_start``); one an example did not close cleanly is closed, never reused, and all are
  closed after ``IDLE`` seconds without an example (an idle cluster's heartbeats take about 5%
  of a core, which the other tests need);
- in the example's process (this folder's ``sitecustomize`` on its ``PYTHONPATH``),
  ``daskllm.LocalLLMCluster`` is :class:`SharedCluster`: a handle on the host's cluster of the
  same arguments, which ``Client`` accepts as it accepts a cluster. Anything else an example
  asks of it fails, naming what, so an example that needs a fresh cluster cannot pass by
  mistake on a shared one.

The example's code runs as written; only where its cluster comes from changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import socket
import sys
import traceback
from multiprocessing.connection import Client as Connect
from multiprocessing.connection import Connection

ADDRESS = "DASKLLM_DOCS_CLUSTER"  # the host's socket (in a directory only its user reads), for the example
KEEP = 2  # clusters a host keeps (each holds the default model and embedder per worker)
IDLE = 20.0  # seconds without an example before the host closes its clusters


class SharedCluster:
    """A handle on the docs host's cluster with these arguments (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        self._conn = Connect(os.environ[ADDRESS], family="AF_UNIX")
        self._conn.send((args, kwargs))
        reply = self._conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"the docs tests' cluster host could not start LocalLLMCluster(*{args}, **{kwargs}):"
                               f"\n{reply[1]}")
        _, self.scheduler_address, self.dashboard_link = reply
        from distributed.core import Status

        self.status = Status.running

    def __getattr__(self, name: str):
        raise AttributeError(f"LocalLLMCluster.{name}: this example ran on tests/test_docs.py's shared cluster, "
                             f"which has no {name}; make it run on a fresh one (test_docs.FRESH)")

    def __await__(self):
        yield from ()
        return self

    def close(self) -> None:
        if self.status.name == "running":
            from distributed.core import Status

            self.status = Status.closed
            self._conn.send("closed")
            self._conn.close()

    def __enter__(self) -> SharedCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Patch(importlib.abc.MetaPathFinder):
    """Makes ``daskllm.cluster.LocalLLMCluster`` the shared handle once that module loads."""

    def find_spec(self, name, path, target=None):
        if name != "daskllm.cluster":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.LocalLLMCluster = SharedCluster

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    sys.meta_path.insert(0, _Patch())


def host(address: str) -> None:
    """Serve examples, one at a time, until killed."""
    from distributed import Client

    from daskllm import LocalLLMCluster
    from daskllm.runtime.control import cold_start

    kept: dict[str, tuple] = {}  # by arguments, the last used last
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        listener.listen()
        while True:
            listener.settimeout(IDLE if kept else None)
            try:
                conn = Connection(listener.accept()[0].detach())
            except TimeoutError:
                while kept:
                    _close(*kept.pop(next(iter(kept))))
                continue
            with conn:
                try:
                    args, kwargs = conn.recv()
                except EOFError:
                    continue
                key = repr((args, sorted(kwargs.items())))
                try:
                    if key in kept:
                        cluster, client = kept.pop(key)
                        cold_start(client)
                    else:
                        while len(kept) >= KEEP:
                            _close(*kept.pop(next(iter(kept))))
                        cluster = LocalLLMCluster(*args, **kwargs)
                        client = Client(cluster, set_as_default=False)
                except Exception:
                    conn.send(("error", traceback.format_exc()))
                    continue
                conn.send(("ok", cluster.scheduler_address, cluster.dashboard_link))
                try:
                    clean = conn.recv() == "closed"
                except EOFError:  # the example ended without closing its cluster
                    clean = False
                workers = len(client.scheduler_info(n_workers=-1)["workers"])
                if clean and workers == len(cluster.workers):
                    kept[key] = cluster, client
                else:
                    _close(cluster, client)


def _close(cluster, client) -> None:
    client.close()
    cluster.close()


if __name__ == "__main__":
    host(sys.argv[1])

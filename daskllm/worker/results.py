"""Remembered results (Helium's prompt cache): deterministic calls computed before, by hash.

Results of the requested outputs' deterministic calls (greedy, or sampled with a seed) are
remembered under their structural hash, in a size-bounded LRU, by the client that computed
them (``daskllm.compute``, ``node.compute()``, ``dask.compute``). The planner's ``cache`` pass
looks calls up here (the runtime hands it this store). A worker planning nested work (a pmap's
items, a dataframe partition) looks calls up in its own process's store, which nothing fills:
nested calls are served instead by the persistent result store (:mod:`daskllm.worker.store`),
which the decode and embed tasks themselves consult, keyed by content. A sampled call without
a seed is never remembered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from daskllm import config


class ResultStore:
    def __init__(self):
        self._data: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.version = 0  # changes whenever the contents do: plans made before are stale

    def get(self, key: str):
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        return None

    def put(self, key: str, value) -> None:
        limit = int(config.get("rewrite.result-cache-size"))
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > limit:
                self._data.popitem(last=False)
            self.version += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.version += 1

    def __len__(self) -> int:
        return len(self._data)


# This process's store.
RESULTS = ResultStore()

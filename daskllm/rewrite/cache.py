"""Result cache (Helium's prompt cache): a deterministic call computed before becomes a fetch.

Results of the requested outputs' deterministic calls (greedy, or sampled with a seed) are
remembered on the client under their structural hash, in a size-bounded LRU; a later
identical call is lowered to its remembered value and runs nowhere. Sampled calls without
a seed are never cached. Switch off with ``daskllm.rewrite.result-cache: false`` or by
leaving ``cache`` out of the passes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import networkx as nx

from daskllm import config
from daskllm.graph.items import hashes
from daskllm.graph.nodes import BATCHABLE_OPS


class _LRU:
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


RESULTS = _LRU()
MISSING = None


def cacheable(node) -> bool:
    return node.op in BATCHABLE_OPS and node.params.get("cache", True) and not node.params.get("nonce")


class ResultCache:
    name = "cache"

    def run(self, graph: nx.DiGraph) -> nx.DiGraph:
        graph.graph["result_cache"] = True
        hits = 0
        for node in graph:
            if not cacheable(node):
                continue
            found = [RESULTS.get(h) for h in hashes(graph, node)]
            if any(v is not None for v in found):
                graph.nodes[node]["cached"] = found
                hits += sum(v is not None for v in found)
        graph.graph["report"]["cache"] = {"hits": hits, "size": len(RESULTS)}
        return graph

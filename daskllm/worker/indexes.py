"""Vector-index shards resident on workers, held by the worker's :class:`~daskllm.worker.host.EngineHost`.

Task functions for :class:`daskllm.retrieval.ShardedIndex` (the client-side handle): each
runs on the worker holding the shard. Ingest embeds texts where they will be held, so no
vectors cross the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from distributed import get_worker

from daskllm.index import Hit, VectorIndex, merge_hits
from daskllm.worker.host import PLUGIN_NAME, get_engine, host


class IndexShardLost(LookupError):
    """An index shard is not where it was placed: its worker left the cluster or restarted."""


def _shard(name: str, shard: int) -> VectorIndex:
    plugin = host()
    try:
        return plugin.indexes[name][shard]
    except KeyError:
        held = {n: sorted(s) for n, s in plugin.indexes.items()}
        raise IndexShardLost(f"index {name!r} shard {shard} is not on worker {get_worker().address} "
                             f"(it holds {held or 'no indexes'}): the worker that held it left the cluster or "
                             f"restarted. Restore it from a saved copy (index.restore(), after index.save(path)), "
                             f"or rebuild the index") from None


def create_shard(name: str, shard: int, config: dict) -> int:
    index = VectorIndex(**{**config, "name": name})
    host().indexes.setdefault(name, {})[shard] = index
    return 0


def ingest_shard(name: str, shard: int, embedder: str, texts: Sequence, ids: Sequence[int]) -> int:
    """Task: embed ``texts`` with this worker's embedder and add them to the shard."""
    index = _shard(name, shard)
    for i, t in zip(ids, texts):
        if not isinstance(t, str):
            raise ValueError(f"index {name!r}: row with id {i} is a {type(t).__name__}, not text: {t!r:.80}")
    vectors = get_engine(embedder, "embed").embed(list(texts))
    return index.add(vectors, ids, list(texts))


def add_to_shard(name: str, shard: int, vectors, ids: Sequence[int], texts: Sequence[str] | None) -> int:
    return _shard(name, shard).add(vectors, ids, texts)


def search_shard(name: str, shard: int, queries: np.ndarray, k: int) -> list[list[Hit]]:
    index = _shard(name, shard)
    return index.search(queries, min(k, index.ntotal)) if index.ntotal else [[] for _ in range(len(queries))]


def save_shard(name: str, shard: int, path: str) -> str:
    return str(_shard(name, shard).save(path))


def load_shard(name: str, shard: int, path: str) -> int:
    index = VectorIndex.load(path)
    index.name = name
    host().indexes.setdefault(name, {})[shard] = index
    return index.ntotal


def drop_shards(name: str, dask_worker=None) -> int:
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else host()
    return len(plugin.indexes.pop(name, {}) or {}) if plugin is not None else 0


def merge_shards(k: int, *per_shard: list[list[Hit]]) -> list[list[Hit]]:
    """Each query's top ``k`` over every shard's hits."""
    return merge_hits(per_shard, k)


def embed_dim(embedder: str) -> int:
    return get_engine(embedder, "embed").dim


def count_shards(name: str, dask_worker=None) -> int:
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    return len(plugin.indexes.get(name, {})) if plugin is not None else 0

"""Vector indexes sharded across the workers of a Dask cluster.

A :class:`ShardedIndex` is a client-side handle. Each shard is a
:class:`~daskllm.index.VectorIndex` in one worker's memory (held by that worker's
:class:`~daskllm.worker.EngineHost`; the shard task functions are in
:mod:`daskllm.worker.indexes`). Ingest embeds texts on the worker that will hold them,
so no vectors cross the network; ``search`` embeds the queries once, runs one search task
per shard on the worker holding it, and merges the top-k. Vector ``i`` lives in shard
``i % shards``, so shards stay balanced under incremental ingest.
"""

from __future__ import annotations

import json
import pathlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from daskllm.index import Hit, VectorIndex
from daskllm.models import DEFAULT_EMBEDDING_MODEL
from daskllm.worker.calls import embed
from daskllm.worker.control import resident_models
from daskllm.worker.indexes import (IndexShardLost, add_to_shard, count_shards, create_shard, drop_shards, embed_dim,
                                    ingest_shard, load_shard, merge_shards, save_shard, search_shard)

INGEST_CHUNK = 512  # texts per ingest task: bounded memory, visible progress, concurrent batches


# --- the client-side handle ----------------------------------------------------------------

@dataclass
class ShardedIndex:
    """A vector index whose shards live in the memory of Dask workers."""

    client: object = field(repr=False)
    name: str
    config: dict  # VectorIndex settings: dim, kind, metric, ...
    workers: list[str]  # shard i lives on workers[i]
    embedder: str = DEFAULT_EMBEDDING_MODEL
    sizes: list[int] = field(default_factory=list)
    # Changes with every change of contents, so cached search results never outlive them.
    version: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The last saved copy of exactly these contents (save, load): where lost shards come back from.
    saved: tuple[str, str] | None = None  # (path, version)

    @classmethod
    def create(cls, client, name: str, *, embedder: str = DEFAULT_EMBEDDING_MODEL, dim: int | None = None,
               kind: str = "flat", metric: str = "ip", shards: int | None = None,
               workers: Sequence[str] | None = None, **index_options) -> ShardedIndex:
        """An empty index with ``shards`` shards (default: one per worker holding ``embedder``)."""
        holders = [w for w, names in resident_models(client, kind="embed").items() if embedder in names]
        candidates = list(workers) if workers is not None else holders
        if not candidates:
            raise LookupError(f"index {name!r}: no worker holds the embedder {embedder!r}")
        if any(_holds(client, name).values()):
            raise ValueError(f"index {name!r} already exists on the cluster; drop it or pick another name")
        shards = shards or len(candidates)
        if dim is None:
            dim = client.submit(embed_dim, embedder, workers=candidates[:1], pure=False).result()
        config = {"dim": dim, "kind": kind, "metric": metric, **index_options}
        VectorIndex(**config, name=name)  # validate here, before any worker sees it
        placement = [candidates[i % len(candidates)] for i in range(shards)]
        client.gather([client.submit(create_shard, name, i, config, workers=[w], pure=False)
                       for i, w in enumerate(placement)])
        return cls(client, name, config, placement, embedder, [0] * shards)

    @classmethod
    def from_texts(cls, client, name: str, texts: Sequence[str], ids: Sequence[int] | None = None,
                   **options) -> ShardedIndex:
        index = cls.create(client, name, **options)
        index.ingest(texts, ids)
        return index

    @property
    def shards(self) -> int:
        return len(self.workers)

    @property
    def ntotal(self) -> int:
        return sum(self.sizes)

    def _next_ids(self, n: int) -> np.ndarray:
        start = getattr(self, "_next_id", 0)
        self._next_id = start + n
        return np.arange(start, start + n, dtype=np.int64)

    def _split(self, ids: np.ndarray) -> list[np.ndarray]:
        return [np.flatnonzero(ids % self.shards == s) for s in range(self.shards)]

    def ingest(self, texts: Sequence[str], ids: Sequence[int] | None = None) -> ShardedIndex:
        """Embed and add texts (incremental). Ids default to consecutive numbers after the last."""
        self.restore()
        texts = list(texts)
        if not texts and not self.ntotal:
            raise ValueError(f"index {self.name!r}: nothing to ingest (empty corpus)")
        ids = self._next_ids(len(texts)) if ids is None else np.asarray(ids, dtype=np.int64)
        if len(ids) != len(texts):
            raise ValueError(f"index {self.name!r}: {len(texts)} texts but {len(ids)} ids")
        self._next_id = max(getattr(self, "_next_id", 0), int(ids.max()) + 1 if len(ids) else 0)
        futures = []
        for shard, rows in enumerate(self._split(ids)):
            for start in range(0, len(rows), INGEST_CHUNK):
                chunk = rows[start:start + INGEST_CHUNK]
                futures.append((shard, self.client.submit(
                    ingest_shard, self.name, shard, self.embedder, [texts[r] for r in chunk], ids[chunk].tolist(),
                    workers=[self.workers[shard]], allow_other_workers=False, pure=False)))
        self._collect_sizes(futures)
        return self

    def ingest_dataframe(self, ddf, column: str, id_column: str | None = None) -> ShardedIndex:
        """Ingest a dask dataframe column, partition by partition; ids from ``id_column`` or the index."""
        if column not in ddf.columns:
            raise KeyError(f"index {self.name!r}: the dataframe has no column {column!r}")
        for part in ddf.partitions:
            frame = part.compute()
            ids = frame[id_column] if id_column is not None else frame.index
            if not np.issubdtype(np.asarray(ids).dtype, np.integer):
                raise ValueError(f"index {self.name!r}: ids must be integers; pass id_column= "
                                 f"(got {np.asarray(ids).dtype})")
            self.ingest(frame[column].tolist(), np.asarray(ids, dtype=np.int64))
        return self

    def add_vectors(self, vectors, ids: Sequence[int] | None = None,
                    texts: Sequence[str] | None = None) -> ShardedIndex:
        self.restore()
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.config["dim"]:
            raise ValueError(f"index {self.name!r}: vectors must have dimension {self.config['dim']}, "
                             f"got shape {vectors.shape}")
        ids = self._next_ids(len(vectors)) if ids is None else np.asarray(ids, dtype=np.int64)
        if ids.shape != (len(vectors),):
            raise ValueError(f"index {self.name!r}: {len(vectors)} vectors but {len(ids)} ids")
        if texts is not None and len(texts) != len(vectors):
            raise ValueError(f"index {self.name!r}: {len(vectors)} vectors but {len(texts)} texts")
        self._next_id = max(getattr(self, "_next_id", 0), int(ids.max()) + 1 if len(ids) else 0)
        futures = [(shard, self.client.submit(add_to_shard, self.name, shard, vectors[rows], ids[rows].tolist(),
                                              None if texts is None else [texts[r] for r in rows],
                                              workers=[self.workers[shard]], allow_other_workers=False, pure=False))
                   for shard, rows in enumerate(self._split(ids)) if len(rows)]
        self._collect_sizes(futures)
        return self

    def _collect_sizes(self, futures) -> None:
        self.version = uuid.uuid4().hex
        for shard, size in zip([s for s, _ in futures], self.client.gather([f for _, f in futures])):
            self.sizes[shard] = max(self.sizes[shard], size)

    def lost_shards(self) -> dict[int, str]:
        """Shards whose worker has left the cluster: shard -> the worker that held it."""
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        return {s: w for s, w in enumerate(self.workers) if w not in alive}

    def restore(self) -> ShardedIndex:
        """Bring shards whose worker left back from the last saved copy, onto live workers
        holding the embedder. Raises :class:`IndexShardLost` naming them when there is no saved
        copy of the current contents (then rebuild the index)."""
        lost = self.lost_shards()
        if not lost:
            return self
        if self.saved is None or self.saved[1] != self.version:
            raise IndexShardLost(
                f"index {self.name!r}: shard(s) {sorted(lost)} were on worker(s) {sorted(set(lost.values()))}, "
                f"which left the cluster, and " + ("the index was never saved" if self.saved is None else
                                                   f"it changed since it was saved to {self.saved[0]}")
                + "; rebuild it (ShardedIndex.from_texts), or save it (index.save(path)) so lost shards can be restored")
        path = pathlib.Path(self.saved[0])
        holders = sorted(w for w, names in resident_models(self.client, kind="embed").items() if self.embedder in names)
        if not holders:
            raise IndexShardLost(f"index {self.name!r}: no live worker holds the embedder {self.embedder!r} "
                                 f"to take shard(s) {sorted(lost)}")
        moved = {s: holders[i % len(holders)] for i, s in enumerate(sorted(lost))}
        self.client.gather([self.client.submit(load_shard, self.name, s, str(path / f"shard-{s}"), workers=[w],
                                               allow_other_workers=False, pure=False) for s, w in moved.items()])
        for s, w in moved.items():
            self.workers[s] = w
        return self

    def search_futures(self, queries, k: int):
        """Futures for the search: one per shard, and the merged result (``list[list[Hit]]``).
        A shard whose worker left comes back from the last saved copy first (:meth:`restore`)."""
        self.restore()
        if isinstance(queries, str):
            raise TypeError(f"index {self.name!r}: search takes a list of queries; got one str")
        if not isinstance(k, int) or k <= 0:
            raise ValueError(f"index {self.name!r}: k must be a positive int, got {k!r}")
        if k > self.ntotal:
            raise ValueError(f"index {self.name!r}: k={k} is larger than the index ({self.ntotal} vectors)")
        if isinstance(queries, np.ndarray):
            vectors = self.client.scatter(np.asarray(queries, dtype=np.float32), broadcast=False)
        else:
            vectors = self.client.submit(embed, self.embedder, list(queries), pure=False)
        per_shard = [self.client.submit(search_shard, self.name, s, vectors, k, workers=[w],
                                        allow_other_workers=False, pure=False)
                     for s, w in enumerate(self.workers)]
        return per_shard, self.client.submit(merge_shards, k, *per_shard, pure=False)

    def search(self, queries, k: int = 5, *, errors: str = "raise") -> list[list[Hit] | Exception]:
        """Top-``k`` hits for each query (texts, or an array of vectors).

        A query that is not text fails alone: with ``errors="keep"`` its slot holds the error
        and the other queries' results are returned; with ``"raise"`` the error names it.
        """
        if errors not in ("raise", "keep"):
            raise ValueError(f"errors must be 'raise' or 'keep', got {errors!r}")
        if isinstance(queries, np.ndarray):
            return self.client.gather(self.search_futures(queries, k)[1])
        if isinstance(queries, str):
            raise TypeError(f"index {self.name!r}: search takes a list of queries; got one str")
        queries = list(queries)
        bad = {i: ValueError(f"index {self.name!r}: query {i} is a {type(q).__name__}, not text: {q!r:.80}")
               for i, q in enumerate(queries) if not isinstance(q, str)}
        if bad and errors == "raise":
            raise next(iter(bad.values()))
        good = [q for i, q in enumerate(queries) if i not in bad]
        hits = iter(self.client.gather(self.search_futures(good, k)[1]) if good else [])
        return [bad[i] if i in bad else next(hits) for i in range(len(queries))]

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        """Each worker writes its shard under ``path`` (a filesystem the workers and client share)."""
        self.restore()
        path = pathlib.Path(path).resolve()
        path.mkdir(parents=True, exist_ok=True)
        self.client.gather([self.client.submit(save_shard, self.name, s, str(path / f"shard-{s}"), workers=[w],
                                               allow_other_workers=False, pure=False)
                            for s, w in enumerate(self.workers)])
        (path / "index.json").write_text(json.dumps({"name": self.name, "config": self.config,
                                                     "embedder": self.embedder, "sizes": self.sizes,
                                                     "next_id": getattr(self, "_next_id", self.ntotal)}))
        self.saved = (str(path), self.version)
        return path

    @classmethod
    def load(cls, client, path: str | pathlib.Path, *, name: str | None = None,
             workers: Sequence[str] | None = None) -> ShardedIndex:
        path = pathlib.Path(path).resolve()
        if not (path / "index.json").is_file():
            raise FileNotFoundError(f"no saved sharded index at {path} (index.json is missing)")
        meta = json.loads((path / "index.json").read_text())
        name = name or meta["name"]
        if any(_holds(client, name).values()):
            raise ValueError(f"index {name!r} already exists on the cluster; drop it or load under another name")
        candidates = list(workers or client.scheduler_info()["workers"])
        placement = [candidates[i % len(candidates)] for i in range(len(meta["sizes"]))]
        sizes = client.gather([client.submit(load_shard, name, s, str(path / f"shard-{s}"), workers=[w],
                                             allow_other_workers=False, pure=False)
                               for s, w in enumerate(placement)])
        index = cls(client, name, meta["config"], placement, meta["embedder"], list(sizes))
        index._next_id = meta["next_id"]
        index.saved = (str(path), index.version)
        return index

    def drop(self) -> None:
        self.client.run(drop_shards, self.name)
        # Its contents are gone: results remembered for them must never answer a search of it again.
        self.version = uuid.uuid4().hex
        self.sizes = [0] * len(self.sizes)

    def detached(self) -> ShardedIndex:
        """This handle without its client: what travels into tasks (and hashes the same everywhere)."""
        import copy

        handle = copy.copy(self)
        handle.client = None
        return handle

    def __getstate__(self):
        # The handle travels into tasks by name and placement; the client stays behind.
        return {**self.__dict__, "client": None}


def _holds(client, name: str) -> dict[str, int]:
    return client.run(count_shards, name)

"""Vector indexes on faiss: exact flat (the default), IVF and HNSW, local or sharded.

A :class:`VectorIndex` is one faiss index plus the ids and texts of its vectors: a whole
index in one process, or one shard of a :class:`ShardedIndex`, whose shards live in the
memory of different Dask workers (:mod:`daskllm.retrieval` has the tasks that build and
search them, and the client-side handle).

Results are ranked by score, then by id, so equal scores (duplicate documents are common)
always rank the same way, and merging the shards' top-k gives exactly the top-k of one
flat index over the same vectors. For that, flat search computes every (query, vector)
score by the same per-pair routine, whatever the batch: see ``_exact_scores``.
"""

from __future__ import annotations

import functools

import json
import pathlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INDEX_KINDS = ("flat", "ivf", "hnsw")
METRICS = ("ip", "l2")


@dataclass(frozen=True, slots=True)
class Hit:
    id: int
    score: float  # higher is better: inner product, or minus the squared L2 distance
    text: str | None = None


class IndexError_(LookupError):
    """A named index or shard is not where it was looked for."""


@functools.cache
def _faiss():
    import faiss

    # One thread per search (parallelism comes from workers and tasks): a parallel region of
    # faiss's own OpenMP runtime, next to torch's (a second libgomp in the process), can
    # freeze a whole worker process, heartbeats included.
    faiss.omp_set_num_threads(1)
    return faiss


def _exact_scores():
    """Make faiss's flat search use its per-pair kernels for any number of queries.

    Past a batch size of 20 faiss switches to a BLAS matrix product, whose rounding
    depends on the batch and on the database size: a vector's score would then differ
    between a query run alone and in a batch, or between a shard and the whole index.
    """
    faiss = _faiss()
    faiss.cvar.distance_compute_blas_threshold = 2**30
    return faiss


class VectorIndex:
    """A faiss index with int64 ids and optional texts, searchable by vectors."""

    def __init__(self, dim: int, *, kind: str = "flat", metric: str = "ip", name: str = "index",
                 nlist: int | None = None, nprobe: int = 8, hnsw_m: int = 32, ef_search: int = 64):
        if kind not in INDEX_KINDS:
            raise ValueError(f"index {name!r}: kind must be one of {INDEX_KINDS}, got {kind!r}")
        if metric not in METRICS:
            raise ValueError(f"index {name!r}: metric must be one of {METRICS}, got {metric!r}")
        if not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"index {name!r}: dim must be a positive int, got {dim!r}")
        self.dim, self.kind, self.metric, self.name = dim, kind, metric, name
        self.nlist, self.nprobe, self.hnsw_m, self.ef_search = nlist, nprobe, hnsw_m, ef_search
        self._index = None if kind == "ivf" else self._make()  # IVF is made when it can be trained
        self.ids = np.zeros(0, dtype=np.int64)
        self.texts: list[str | None] = []
        self._position: dict[int, int] = {}
        # Tasks on one worker run in threads; faiss indexes are not safe to change while
        # another thread adds to or searches them.
        self._lock = threading.Lock()

    @property
    def ntotal(self) -> int:
        return len(self.ids)

    def config(self) -> dict:
        return {"dim": self.dim, "kind": self.kind, "metric": self.metric, "name": self.name, "nlist": self.nlist,
                "nprobe": self.nprobe, "hnsw_m": self.hnsw_m, "ef_search": self.ef_search}

    def _make(self, training: np.ndarray | None = None):
        faiss = _exact_scores()
        faiss_metric = faiss.METRIC_INNER_PRODUCT if self.metric == "ip" else faiss.METRIC_L2
        if self.kind == "flat":
            base = faiss.IndexFlat(self.dim, faiss_metric)
        elif self.kind == "hnsw":
            base = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss_metric)
            base.hnsw.efSearch = self.ef_search
        else:
            nlist = self.nlist or max(1, min(4096, int(4 * np.sqrt(len(training)))))
            if len(training) < nlist:
                raise ValueError(f"index {self.name!r}: IVF with nlist={nlist} needs at least {nlist} vectors "
                                 f"to train, got {len(training)}")
            quantizer = faiss.IndexFlat(self.dim, faiss_metric)
            ivf = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss_metric)
            ivf.train(training)
            ivf.nprobe = self.nprobe
            self.nlist = nlist
            return ivf
        return faiss.IndexIDMap2(base)

    def _check_vectors(self, vectors, what: str) -> np.ndarray:
        array = np.asarray(vectors, dtype=np.float32)
        if array.ndim == 1:
            array = array[None, :]
        if array.ndim != 2 or array.shape[1] != self.dim:
            raise ValueError(f"index {self.name!r}: {what} must have dimension {self.dim}, got shape "
                             f"{np.shape(vectors)}")
        if not np.isfinite(array).all():
            row = int(np.argwhere(~np.isfinite(array))[0][0])
            raise ValueError(f"index {self.name!r}: {what} row {row} has non-finite values")
        return np.ascontiguousarray(array)

    def add(self, vectors, ids: Sequence[int] | None = None, texts: Sequence[str | None] | None = None) -> int:
        """Add vectors (incremental); returns the new size. Ids default to 0, 1, 2, ... after the last."""
        vectors = self._check_vectors(vectors, "vectors")
        with self._lock:
            return self._add(vectors, ids, texts)

    def _add(self, vectors: np.ndarray, ids, texts) -> int:
        n = len(vectors)
        if ids is None:
            start = int(self.ids.max()) + 1 if self.ntotal else 0
            ids = np.arange(start, start + n, dtype=np.int64)
        ids = np.asarray(ids, dtype=np.int64)
        if ids.shape != (n,):
            raise ValueError(f"index {self.name!r}: {n} vectors but {ids.shape} ids")
        duplicates = [int(i) for i in ids if int(i) in self._position]
        if duplicates or len(set(ids.tolist())) != n:
            raise ValueError(f"index {self.name!r}: ids already present or repeated: {duplicates[:5] or 'repeated'}")
        if texts is not None and len(texts) != n:
            raise ValueError(f"index {self.name!r}: {n} vectors but {len(texts)} texts")
        if n == 0:
            return self.ntotal
        if self._index is None:
            self._index = self._make(training=vectors)
        self._index.add_with_ids(vectors, ids)
        for offset, i in enumerate(ids.tolist()):
            self._position[i] = self.ntotal + offset
        self.ids = np.concatenate([self.ids, ids])
        self.texts.extend(texts if texts is not None else [None] * n)
        return self.ntotal

    def text(self, id_: int) -> str | None:
        return self.texts[self._position[id_]]

    def search(self, queries, k: int) -> list[list[Hit]]:
        """The ``k`` best hits per query, by score then id."""
        queries = self._check_vectors(queries, "query vectors")
        if not isinstance(k, int) or k <= 0:
            raise ValueError(f"index {self.name!r}: k must be a positive int, got {k!r}")
        if k > self.ntotal:
            raise ValueError(f"index {self.name!r}: k={k} is larger than the index ({self.ntotal} vectors)")
        with self._lock:
            return self._search(queries, k)

    def _search(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        # One more than asked for: a tie between the k-th and the next means the tie may
        # continue past what was fetched, so fetch more (rare); otherwise one pass does.
        fetch = k + 1
        while True:
            scores, ids = self._index.search(queries, min(fetch, self.ntotal))
            if self.metric == "l2":
                scores = -scores
            if self.kind != "flat" or fetch >= self.ntotal or not np.any(scores[:, k - 1] == scores[:, -1]):
                break
            fetch *= 2
        out = []
        for row_scores, row_ids in zip(scores, ids):
            pairs = sorted(((-float(s), int(i)) for s, i in zip(row_scores, row_ids) if i >= 0))[:k]
            out.append([Hit(i, -s, self.text(i)) for s, i in pairs])
        return out

    def __getstate__(self):
        raise TypeError(f"index {self.name!r} lives in one process: save() it, or search it where it is")

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = pathlib.Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._index is not None:
                _faiss().write_index(self._index, str(path / "index.faiss"))
            (path / "config.json").write_text(json.dumps(self.config()))
            pq.write_table(pa.table({"id": pa.array(self.ids, pa.int64()),
                                     "text": pa.array(self.texts, pa.string())}), path / "payload.parquet")
        return path

    @classmethod
    def load(cls, path: str | pathlib.Path) -> VectorIndex:
        import pyarrow.parquet as pq

        path = pathlib.Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no saved index at {path} (config.json is missing)")
        index = cls(**json.loads((path / "config.json").read_text()))
        payload = pq.read_table(path / "payload.parquet")
        index.ids = payload.column("id").to_numpy().astype(np.int64)
        index.texts = payload.column("text").to_pylist()
        index._position = {int(i): p for p, i in enumerate(index.ids)}
        if (path / "index.faiss").is_file():
            index._index = _exact_scores().read_index(str(path / "index.faiss"))
            if index.kind == "ivf":
                index._index.nprobe = index.nprobe
        return index


def merge_hits(per_shard: Sequence[list[list[Hit]]], k: int) -> list[list[Hit]]:
    """Merge per-shard top-k lists into the overall top-k, by score then id."""
    merged = []
    for rows in zip(*per_shard):
        hits = sorted((h for row in rows for h in row), key=lambda h: (-h.score, h.id))
        merged.append(hits[:k])
    return merged

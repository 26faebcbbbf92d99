"""Which partition calls which distinct input: the table-wide dedupe plan (``dedupe=``).

* ``"auto"`` (the default): each partition drops its own duplicates; a tree reduction over
  128-bit hashes of the partitions' distinct keys finds the keys that more than one partition
  holds, each owned by one of its holders picked by hashing (rendezvous hashing: the shared
  keys' calls spread evenly over the partitions, so over the engines). Every partition calls
  the keys it holds alone or owns, so each distinct input of the table is called once, and only the results of
  the shared keys (as many as the duplicates across partitions) reach other partitions. Only
  hashes cross partitions: no shuffle of the rows, no table broadcast. With all-distinct
  prompts it costs a hash per row; with duplicates it keeps the global dedupe.
* ``"local"``: each partition calls its own distinct inputs, with no table-wide step (a
  partition never waits for another); a duplicate across partitions runs once per partition
  holding it (or comes from a result cache where the call is deterministic).
* ``"global"``: ``drop_duplicates`` by a task shuffle, then the table of results broadcast to
  every partition (the plan before ``"auto"``; kept to compare against).

Whatever the plan, a row gets the same tokens: only which task calls a prompt changes. Each
partition's calls run on its own worker's engines where it holds them and the table has at
least as many partitions as engines (:func:`daskllm.runtime.here.compute_nested`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from pandas.util import hash_pandas_object

from daskllm.dataframe.calls import call, spread
from daskllm.dataframe.ops import KEY, STRING, WHEN, Op

STRATEGIES = ("auto", "local", "global")
# Two 64-bit hashes of a key with different hash keys: a 128-bit identity, collisions ~1e-29 at 1e5 keys.
_HASH_KEYS = ("daskllm-dedupe-1", "daskllm-dedupe-2")  # 16 bytes each, as pandas asks

RESULT_META = pd.DataFrame({KEY: pd.Series([], dtype=STRING), "value": pd.Series([], dtype=object),
                            "error": pd.Series([], dtype=STRING), "shared": pd.Series([], dtype=bool)})


def local_distinct(frame: pd.DataFrame) -> pd.DataFrame:
    """A partition's distinct inputs (rows whose key is null have none); a table job's
    conditional calls, by input and conditions (a row whose conditions are null has none)."""
    if WHEN in frame.columns:
        return frame.dropna(subset=[KEY, WHEN]).drop_duplicates(subset=[KEY, WHEN])
    return frame.dropna(subset=[KEY]).drop_duplicates(subset=[KEY])


def key_hashes(keys: pd.Series) -> tuple:
    """Each key's 128-bit hash, as two arrays of 64 bits."""
    return tuple(hash_pandas_object(keys, index=False, hash_key=k).to_numpy() for k in _HASH_KEYS)


def sketch(distinct: pd.DataFrame, partition_info=None) -> pd.DataFrame:
    """A partition's distinct keys as hashes, with the partition's number and its rank for
    each key (a hash of both: the holder of lowest rank owns the key)."""
    h1, h2 = key_hashes(distinct[KEY])
    number = partition_info["number"]
    with np.errstate(over="ignore"):  # multiplication modulo 2**64 is the point
        rank = (h1 ^ np.uint64((number + 1) * 0x9E3779B97F4A7C15 % 2**64)) * np.uint64(0xBF58476D1CE4E5B9)
    return pd.DataFrame({"h1": h1, "h2": h2, "rank": rank, "owner": number, "holders": 1})


def merge_sketches(sketches: pd.DataFrame) -> pd.DataFrame:
    """One row per hash: the holder of lowest rank, its rank, and how many partitions hold it."""
    if isinstance(sketches, list):
        sketches = pd.concat(sketches)
    return sketches.sort_values("rank", kind="stable").groupby(["h1", "h2"], sort=False) \
        .agg(rank=("rank", "first"), owner=("owner", "first"), holders=("holders", "sum")).reset_index()


def shared_owners(sketches: pd.DataFrame) -> dict[tuple[int, int], int]:
    """The keys held by more than one partition (as hashes), each with its owner."""
    merged = merge_sketches(sketches)
    merged = merged[merged["holders"] > 1]
    return dict(zip(zip(merged["h1"].tolist(), merged["h2"].tolist()), merged["owner"].tolist()))


def call_owned(distinct: pd.DataFrame, owners: dict | None, op: Op, slots: tuple, here: bool = True,
               partition_info=None) -> pd.DataFrame:
    """Call the distinct inputs this partition holds alone or owns; ``shared`` marks the results
    other partitions read. ``here``: on this worker's engines (:func:`daskllm.runtime.here.compute_nested`)."""
    shared: list = []
    if owners:
        number = partition_info["number"]
        held = [owners.get(h) for h in zip(*(h.tolist() for h in key_hashes(distinct[KEY])))]
        shared = [k for k, o in zip(distinct[KEY], held) if o == number]
        distinct = distinct[[o is None or o == number for o in held]]
    results = call(distinct, op, slots, here)
    return results.assign(shared=results[KEY].isin(shared).astype(bool))


def shared_results(results: pd.DataFrame) -> pd.DataFrame:
    return results[results["shared"]]


def plan(frame, op: Op, slots: tuple, strategy: str):
    """The results of every distinct input of ``frame`` (its ``KEY`` column and the slot
    columns): ``(own, shared)``, ``own`` aligned with ``frame``'s partitions (or None) and
    ``shared`` a one-partition table every partition reads (or None)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"dedupe must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "global":
        # A task-based shuffle: P2P's per-shuffle bookkeeping (and its log lines) costs more than
        # it saves on a column of short prompt strings.
        distinct = frame.dropna(subset=[KEY]).drop_duplicates(subset=[KEY], shuffle_method="tasks")
        here = not spread(distinct.npartitions, op)
        table = distinct.map_partitions(call_owned, None, op, slots, here, meta=RESULT_META)
        return None, table.repartition(npartitions=1)
    distinct = frame.map_partitions(local_distinct, meta=frame._meta)
    here = not spread(distinct.npartitions, op)
    if strategy == "local" or distinct.npartitions == 1:
        return distinct.map_partitions(call_owned, None, op, slots, here, meta=RESULT_META, partition_info=True), None
    hashes = distinct.map_partitions(sketch, partition_info=True, meta=sketch(frame._meta, {"number": 0}))
    owners = hashes.reduction(lambda s: s, combine=merge_sketches, aggregate=shared_owners, meta=(None, object))
    own = distinct.map_partitions(call_owned, owners, op, slots, here, meta=RESULT_META, partition_info=True)
    return own, own.map_partitions(shared_results, meta=RESULT_META).repartition(npartitions=1)

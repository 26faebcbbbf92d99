"""The fixed Arrow type of every operator's output column, whatever its rows hold (all null,
all failed, an empty partition): the same dtype in ``meta``, in every computed partition and
through a parquet round trip."""

from __future__ import annotations

import functools
import json

import pandas as pd
import pyarrow as pa

from daskllm.models import resolve

TEXT = pd.ArrowDtype(pa.string())  # map, rerank documents, agg, every error column
ERROR = TEXT
HITS = pd.ArrowDtype(pa.list_(pa.struct([("id", pa.int64()), ("score", pa.float64()), ("text", pa.string())])))
DOCUMENTS = pd.ArrowDtype(pa.list_(pa.string()))
RATING = pd.Int64Dtype()
FIELDS = {"str": TEXT, "int": pd.Int64Dtype(), "float": pd.Float64Dtype(), "bool": pd.BooleanDtype()}


def embedding(dim: int) -> pd.ArrowDtype:
    """Embedding vectors: fixed-size lists of float32."""
    return pd.ArrowDtype(pa.list_(pa.float32(), dim))


@functools.cache
def embedding_dim(model: str) -> int:
    """The width of ``model``'s vectors, from its files (the embedder pools its hidden states)."""
    path = resolve(model)
    for name, key in (("1_Pooling/config.json", "word_embedding_dimension"), ("config.json", "hidden_size")):
        file = path / name
        if file.exists() and key in (config := json.loads(file.read_text())):
            return int(config[key])
    raise ValueError(f"cannot tell the embedding width of {model!r}: its config.json has no hidden_size")


def arrow_types(arrow_type: pa.DataType):
    """A ``types_mapper`` for reading these columns back from parquet: text and nested Arrow
    types stay Arrow types (pandas cannot rebuild a list dtype from its parquet metadata, pandas
    issue 57411, and reads text as its own string dtype), the rest as the file's pandas
    metadata says. ``dd.read_parquet(path, arrow_to_pandas={"types_mapper": arrow_types})``."""
    kept = (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or
            pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or
            pa.types.is_fixed_size_list(arrow_type) or pa.types.is_struct(arrow_type) or pa.types.is_map(arrow_type))
    return pd.ArrowDtype(arrow_type) if kept else None


def column(values: list, dtype, index: pd.Index, name: str | None = None) -> pd.Series:
    """``values`` (None for null) as a series of ``dtype``."""
    if isinstance(dtype, pd.ArrowDtype):
        array = pd.arrays.ArrowExtensionArray(pa.array(values, type=dtype.pyarrow_dtype, from_pandas=True))
        return pd.Series(array, index=index, name=name)
    return pd.Series(pd.array(values, dtype=dtype), index=index, name=name)


def empty(dtype, name: str | None = None) -> pd.Series:
    return column([], dtype, pd.RangeIndex(0), name)

"""Rows to dedupe keys (each row's rendered prompt or input) and distinct results back to rows."""

from __future__ import annotations

import json

import pandas as pd

from daskllm.dataframe.calls import record
from daskllm.dataframe.ops import KEY, STRING, BudgetExceeded, RowError
from daskllm.prompts import Text, parse_template, render_value

def render(frame: pd.DataFrame, template: str, slots: tuple) -> pd.Series:
    """Each row's prompt text (the dedupe key); slots render like prompt slots do."""
    segments = parse_template(template)
    columns = {s: frame[s].tolist() for s in slots}
    out = []
    for i in range(len(frame)):
        out.append("".join(seg.text if isinstance(seg, Text) else render_value(columns[seg.name][i])
                           for seg in segments))
    return pd.Series(out, index=frame.index, dtype=STRING, name=KEY)



def lookup(keys: pd.Series, own: pd.DataFrame | None, shared: pd.DataFrame | None, op_name: str,
           on_error: str) -> pd.DataFrame:
    """Each row's value and error: from its own partition's results, else from the table of
    results that several partitions share (see ``dedupe``)."""
    if len(keys):
        record(op_name, rows=len(keys))
    values, errors = {}, {}
    for table in (shared, own):  # own last: it wins where both hold a key (they agree)
        if table is not None:
            values.update(zip(table[KEY], table["value"]))
            errors.update(zip(table[KEY], table["error"]))
    value = [values.get(k) if isinstance(k, str) else None for k in keys]
    error = [errors.get(k) if isinstance(k, str) else None for k in keys]
    error = [None if e is None or e is pd.NA else e for e in error]
    if on_error == "raise":
        for index, e in zip(keys.index, error):
            if e is not None:
                raise (BudgetExceeded if e.startswith("budget exhausted") else RowError)(
                    f"{op_name}: row {index!r}: {e}")
    return pd.DataFrame({"value": pd.Series(value, index=keys.index, dtype=object),
                         "error": pd.Series(error, index=keys.index, dtype=STRING)})


def pair_keys(frame: pd.DataFrame) -> pd.Series:
    """A rerank input as one dedupe key: the query and its documents, as JSON."""
    query, docs = frame.columns
    for index, ds in zip(frame.index, frame[docs]):
        if isinstance(ds, str) or not hasattr(ds, "__iter__"):
            raise RowError(f"rerank: row {index!r}: {docs!r} must hold a list of documents, got "
                           f"{type(ds).__name__} (dask turns object columns into strings unless "
                           f"dataframe.convert-string is off; parquet list columns stay lists)")
    keys = [json.dumps([str(q), [str(d) for d in ds]]) for q, ds in zip(frame[query], frame[docs])]
    return pd.Series(keys, index=frame.index, dtype=STRING, name=KEY)

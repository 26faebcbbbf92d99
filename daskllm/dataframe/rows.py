"""Rows to dedupe keys (each row's rendered prompt or input) and distinct results back to rows."""

from __future__ import annotations

import json

import pandas as pd

from daskllm.dataframe.calls import record
from daskllm.dataframe.cells import ROW_ERROR, cells, is_null, render_cell, render_field
from daskllm.dataframe.ops import KEY, STRING, BudgetExceeded, RowError
from daskllm.dataframe.schema import column
from daskllm.prompts import Text, parse_template

RENDERED = pd.DataFrame({KEY: pd.Series([], dtype=STRING), ROW_ERROR: pd.Series([], dtype=STRING)})


def render(frame: pd.DataFrame, template: str, slots: tuple, nulls: str) -> pd.DataFrame:
    """Each row's prompt text (the dedupe key), or a null key and the reason it has none."""
    segments = parse_template(template)
    columns = {s: cells(frame[s]) for s in slots}
    keys, errors = [], []
    for i in range(len(frame)):
        parts, error = [], None
        for seg in segments:
            text, error = (seg.text, None) if isinstance(seg, Text) else render_field(columns[seg.name][i], seg.name,
                                                                                        nulls)
            if text is None:
                parts = None
                break
            parts.append(text)
        keys.append(None if parts is None else "".join(parts))
        errors.append(error)
    return rendered(keys, errors, frame.index)


def render_column(frame: pd.DataFrame, field: str, nulls: str) -> pd.DataFrame:
    """Each row's text in ``field`` as its key (embed, search), under the same rules."""
    keys, errors = zip(*(render_field(v, field, nulls) for v in cells(frame[field]))) if len(frame) else ((), ())
    return rendered(list(keys), list(errors), frame.index)


def pair_keys(frame: pd.DataFrame, nulls: str) -> pd.DataFrame:
    """A rerank input as one dedupe key: the query and its documents (null ones left out), as JSON."""
    query, docs = frame.columns
    keys, errors = [], []
    for q, ds in zip(frame[query].tolist(), frame[docs].tolist()):
        text, error = render_field(q, query, nulls)
        if text is not None and (isinstance(ds, (str, bytes)) or not hasattr(ds, "__iter__")):
            if is_null(ds):
                text, error = None, (f"field {docs!r} is null" if nulls == "error" else None)
            else:
                text, error = None, (f"field {docs!r} must hold a list of documents, got {type(ds).__name__} (dask "
                                     f"turns object columns into strings unless dataframe.convert-string is off; "
                                     f"parquet list columns stay lists)")
        if text is not None:
            try:
                keys.append(json.dumps([text, [render_cell(d) for d in ds if not is_null(d)]]))
            except ValueError as exc:
                keys.append(None)
                error = f"field {docs!r}: {exc}"
        else:
            keys.append(None)
        errors.append(error)
    return rendered(keys, errors, frame.index)


def rendered(keys: list, errors: list, index: pd.Index) -> pd.DataFrame:
    return pd.DataFrame({KEY: pd.Series(keys, index=index, dtype=STRING),
                         ROW_ERROR: pd.Series(errors, index=index, dtype=STRING)})


def lookup(rows: pd.DataFrame | pd.Series, own: pd.DataFrame | None, shared: pd.DataFrame | None, op_name: str,
           on_error: str, dtype=None) -> pd.DataFrame:
    """Each row's value (of ``dtype``, else objects) and error: from its own partition's results,
    else from the table of results that several partitions share (see ``dedupe``); a row
    without a key has its render error."""
    if isinstance(rows, pd.Series):  # keys alone (the cascade's lookups): no row has a render error
        rows = rendered(rows.tolist(), [None] * len(rows), rows.index)
    keys = rows[KEY]
    if len(keys):
        record(op_name, rows=len(keys))
    values, errors = {}, {}
    for table in (shared, own):  # own last: it wins where both hold a key (they agree)
        if table is not None:
            values.update(zip(table[KEY], table["value"]))
            errors.update(zip(table[KEY], table["error"]))
    value = [values.get(k) if isinstance(k, str) else None for k in keys]
    error = [errors.get(k) if isinstance(k, str) else e for k, e in zip(keys, rows[ROW_ERROR])]
    error = [None if e is None or e is pd.NA else e for e in error]
    if on_error == "raise":
        for index, e in zip(keys.index, error):
            if e is not None:
                raise (BudgetExceeded if e.startswith("budget exhausted") else RowError)(
                    f"{op_name}: row {index!r}: {e}")
    value = column(value, dtype, keys.index) if dtype is not None else pd.Series(value, index=keys.index,
                                                                                  dtype=object)
    return pd.DataFrame({"value": value, "error": pd.Series(error, index=keys.index, dtype=STRING)})


def kept(values: pd.Series) -> pd.Series:
    """A filter's mask: the rows the model said yes to (a skipped or failed row is dropped)."""
    return values.fillna(False).astype(bool)

"""How a table cell becomes prompt text: the null and type rules every operator shares.

A null cell (None, NaN, pd.NA, NaT) is never rendered: its row gets a null result, or a row
error under ``nulls="error"``. Other cells render by type (docs/dataframe.md, "Nulls and
types"); a value that has no faithful text (bytes that are not UTF-8, a string that is not
valid Unicode, an object of unknown type) is a row error naming its field.
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
from collections.abc import Mapping

import numpy as np
import pandas as pd

NULLS = ("skip", "error")
ROW_ERROR = "_daskllm_row_error"  # beside a row's key: why it has none (a null field under nulls="error", no text)


class CellError(ValueError):
    """A cell cannot be rendered into a prompt; the message says why."""


def check_nulls(nulls: str) -> str:
    if nulls not in NULLS:
        raise ValueError(f"nulls must be 'skip' or 'error', got {nulls!r}")
    return nulls


def is_null(value) -> bool:
    """A missing cell: None, NaN, pd.NA, NaT (a list or array is a value, even an empty one)."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    if isinstance(value, (float, np.floating)):
        return math.isnan(value)
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return bool(np.isnat(value))
    if isinstance(value, decimal.Decimal):
        return value.is_nan()
    return False


def cells(column: pd.Series) -> list:
    """A column's values as Python values, but a float32 (or float16) as itself: its text is
    its own shortest one (0.1), not that of the float64 it widens to (0.10000000149011612)."""
    if column.dtype.kind == "f" and column.dtype.itemsize < 8 and not isinstance(column.dtype, pd.ArrowDtype):
        return list(column.to_numpy())
    return column.tolist()


def render_cell(value) -> str:
    """A non-null cell's text. Raises :class:`CellError` for a value with no faithful text."""
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if math.isinf(value):
            raise CellError(f"{value!r} is not a finite number")
        # The shortest text that reads back as this float (at its own precision): 0.1, 1.0.
        return str(value) if isinstance(value, np.floating) else repr(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        try:
            return _unicode(value.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise CellError(f"bytes are not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if isinstance(value, (pd.Timestamp, datetime.datetime, np.datetime64)):
        return pd.Timestamp(value).isoformat()
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, (pd.Timedelta, datetime.timedelta, np.timedelta64)):
        return str(pd.Timedelta(value))
    if isinstance(value, Mapping):
        return _unicode(json.dumps({str(k): _json(v) for k, v in value.items()}, ensure_ascii=False))
    if isinstance(value, (list, tuple, np.ndarray)):
        # One item per line, as a prompt slot renders a list; null items are left out.
        return "\n".join(render_cell(v) for v in value if not is_null(v))
    text = getattr(value, "text", None)  # a search hit
    if isinstance(text, str):
        return _unicode(text)
    raise CellError(f"cannot render a {type(value).__name__} into a prompt (convert the column to str first)")


def render_field(value, field: str, nulls: str) -> tuple[str | None, str | None]:
    """``(text, None)``, or ``(None, error)`` for a cell that is not rendered: a null (an
    error only under ``nulls="error"``) or a value with no text. Errors name the field."""
    if is_null(value):
        return None, (f"field {field!r} is null" if nulls == "error" else None)
    try:
        return render_cell(value), None
    except CellError as exc:
        return None, f"field {field!r}: {exc}"


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CellError(f"text is not valid Unicode ({exc.reason} at position {exc.start})") from None
    return text


def _json(value):
    """A dict's value as JSON: nulls as null, numbers and flags as themselves, the rest as text."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if is_null(value):
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and not math.isinf(value):
        return float(value)
    return render_cell(value)

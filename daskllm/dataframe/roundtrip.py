"""Plain ``pd.read_parquet`` / ``dd.read_parquet`` of the nested Arrow columns the accessor writes.

A parquet file written from pandas stores each column's dtype by name (``str(dtype)``), and
reading it back rebuilds the dtype with ``pandas.api.types.pandas_dtype(name)``. pandas can
rebuild ``ArrowDtype`` only from flat names (``int64[pyarrow]``), so the lists, fixed-size
lists and structs of embeddings, search hits, reranked documents and schema answers fail
(pandas issues 57411, 59738; fixed upstream by pandas PR 66758, not yet released). This module
registers a lookup that reads those names back into the same ``ArrowDtype`` (a pyarrow type's
``str`` is the grammar below), so a file round trips with no reader option in any process that
has imported daskllm. A name it cannot read is left to pandas, which raises as before.
"""

from __future__ import annotations

import re

import pandas as pd
import pyarrow as pa
from pandas.api.extensions import ExtensionDtype, register_extension_dtype

_NAME = re.compile(r"[a-z_]+[0-9]*")
NESTED = ("list", "large_list", "fixed_size_list", "struct", "map")


def arrow_type(text: str) -> pa.DataType:
    """The pyarrow type whose ``str`` is ``text``; ValueError if it is not one."""
    typ, end = _type(text, 0)
    if end != len(text):
        raise ValueError(f"unexpected {text[end:]!r} in arrow type {text!r}")
    return typ


def _type(s: str, i: int) -> tuple[pa.DataType, int]:
    m = _NAME.match(s, i)
    if m is None:
        raise ValueError(f"no type name at {s[i:]!r}")
    if m.group() not in NESTED or not s.startswith("<", m.end()):
        return _scalar(s, i)
    name, i = m.group(), m.end() + 1
    if name == "map":
        key, i = _type(s, i)
        i = _expect(s, i, ", ")
        value, i = _type(s, i)
        return pa.map_(key, value), _expect(s, i, ">")
    fields = []
    while True:
        colon = s.find(": ", i)
        if colon < 0:
            raise ValueError(f"no field name at {s[i:]!r}")
        field_name, i = s[i:colon], colon + 2
        typ, i = _type(s, i)
        nullable = not s.startswith(" not null", i)
        i += 0 if nullable else len(" not null")
        fields.append(pa.field(field_name, typ, nullable))
        if s.startswith(">", i):
            i += 1
            break
        i = _expect(s, i, ", ")
    if name == "struct":
        return pa.struct(fields), i
    (item,) = fields
    if name == "fixed_size_list":
        m = re.compile(r"\[(\d+)\]").match(s, i)
        if m is None:
            raise ValueError(f"fixed_size_list without a size in {s!r}")
        return pa.list_(item, int(m.group(1))), m.end()
    return (pa.list_ if name == "list" else pa.large_list)(item), i


def _scalar(s: str, i: int) -> tuple[pa.DataType, int]:
    """A flat type, up to the ``,`` or ``>`` that ends it (``timestamp[us, tz=UTC]`` holds one)."""
    depth, j = 0, i
    while j < len(s) and not (depth == 0 and (s[j] in ",>" or s.startswith(" not null", j))):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(s[j], 0)
        j += 1
    text = s[i:j]
    try:
        return pa.type_for_alias(text), j
    except ValueError:  # parametrized: timestamp[us, tz=UTC], duration[s], decimal128(5, 2)
        try:
            return pd.ArrowDtype.construct_from_string(f"{text}[pyarrow]").pyarrow_dtype, j
        except (TypeError, NotImplementedError) as exc:
            raise ValueError(f"unknown arrow type {text!r}") from exc


def _expect(s: str, i: int, token: str) -> int:
    if not s.startswith(token, i):
        raise ValueError(f"expected {token!r} at {s[i:]!r} in {s!r}")
    return i + len(token)


class NestedArrowName(ExtensionDtype):
    """Never a column's dtype: only its ``construct_from_string`` is used, by pandas' dtype
    registry, to read a nested ``ArrowDtype`` name (``list<item: string>[pyarrow]``)."""

    name = "daskllm-nested-arrow"
    type = object

    @classmethod
    def construct_array_type(cls):
        raise NotImplementedError("a lookup of ArrowDtype names, not a dtype")

    @classmethod
    def construct_from_string(cls, string: str) -> pd.ArrowDtype:
        if not isinstance(string, str) or not string.endswith("[pyarrow]") or "<" not in string:
            raise TypeError(f"not a nested arrow type name: {string!r}")
        try:
            return pd.ArrowDtype(arrow_type(string.removesuffix("[pyarrow]")))
        except ValueError as exc:
            raise TypeError(str(exc)) from None


def register() -> None:
    """Put the lookup first in pandas' registry: ``ArrowDtype`` answers a name with a size
    (``fixed_size_list<...>[384]``) with NotImplementedError, which ends the registry's search.
    The registry is pandas' own (private): where a pandas release moves it, nothing is
    registered and reading such a file needs ``arrow_types`` as before."""
    try:
        from pandas.core.dtypes.base import _registry
    except ImportError:
        return
    if NestedArrowName not in _registry.dtypes:
        register_extension_dtype(NestedArrowName)
        _registry.dtypes.remove(NestedArrowName)
        _registry.dtypes.insert(0, NestedArrowName)

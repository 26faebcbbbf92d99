"""Nulls, column types, row errors and stable output schemas of the ``.llm`` accessor.

The rendering rules are pure logic (tested on pandas frames); everything else runs on a
multi-process cluster with the tiny LLM and MiniLM."""

from __future__ import annotations

import datetime
import decimal
import json

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import daskllm
from daskllm.dataframe import RowError
from daskllm.dataframe.cells import ROW_ERROR
from daskllm.dataframe.ops import KEY
from daskllm.dataframe.rows import render
from daskllm.worker.failures import CallError

from helpers import cold_start

STRING = pd.ArrowDtype(pa.string())


def plain(series: pd.Series) -> list:
    return [None if v is pd.NA else v for v in series.tolist()]


def keys(values, dtype=None, nulls="skip") -> tuple[list, list]:
    """What ``render`` makes of a column holding ``values``: each row's key and row error."""
    frame = pd.DataFrame({"v": pd.Series(values, dtype=dtype)})
    out = render(frame, "v={v}", ("v",), nulls)
    return ([None if k is pd.NA else k for k in out[KEY]], [None if e is pd.NA else e for e in out[ROW_ERROR]])


# --- how each column type renders (pure logic) ------------------------------------------------


@pytest.mark.parametrize("values, dtype, expected", [
    (["a", None, "b{c}"], STRING, ["v=a", None, "v=b{c}"]),
    (["a", np.nan, None], object, ["v=a", None, None]),
    ([1, None, 30], "Int64", ["v=1", None, "v=30"]),  # not "1.0": the column's ints stay ints
    ([1, 2], "int64", ["v=1", "v=2"]),
    ([0.1, np.nan, 1.0], "float64", ["v=0.1", None, "v=1.0"]),
    ([0.1, None], "float32", ["v=0.1", None]),  # the float32's own shortest text, not 0.10000000149
    ([True, None, False], "boolean", ["v=true", None, "v=false"]),
    ([["x", "y"], None, []], object, ["v=x\ny", None, "v="]),
    ([["x", None, "y"]], pd.ArrowDtype(pa.list_(pa.string())), ["v=x\ny"]),  # null items are left out
    ([{"a": 1, "b": [1.5, None]}], object, ['v={"a": 1, "b": [1.5, null]}']),
    (["red", None, "blue"], "category", ["v=red", None, "v=blue"]),
    ([pd.Timestamp("2024-01-02 03:04:05"), pd.NaT], "datetime64[ns]", ["v=2024-01-02T03:04:05", None]),
    ([pd.Timestamp("2024-01-02", tz="UTC")], None, ["v=2024-01-02T00:00:00+00:00"]),
    ([datetime.date(2024, 1, 2), None], object, ["v=2024-01-02", None]),
    ([decimal.Decimal("1.10"), None], pd.ArrowDtype(pa.decimal128(5, 2)), ["v=1.10", None]),
    ([b"bytes", None], object, ["v=bytes", None]),
    ([1, "x", 2.5, None, True], object, ["v=1", "v=x", "v=2.5", None, "v=true"]),  # a mixed column
])
def test_each_column_type_renders_by_its_rule_and_nulls_render_nothing(values, dtype, expected):
    assert keys(values, dtype) == (expected, [None] * len(expected))


def test_nulls_error_names_the_field_and_unrenderable_values_are_row_errors():
    assert keys(["a", None, pd.NA], STRING, nulls="error") == (["v=a", None, None],
                                                               [None, "field 'v' is null", "field 'v' is null"])
    rendered, errors = keys([b"\xff", "bad \ud800", object(), float("inf"), "ok"], object)
    assert rendered == [None] * 4 + ["v=ok"]
    assert errors[0] == "field 'v': bytes are not UTF-8 text (invalid start byte at byte 0)"
    assert errors[1].startswith("field 'v': text is not valid Unicode")
    assert errors[2] == "field 'v': cannot render a object into a prompt (convert the column to str first)"
    assert errors[3] == "field 'v': inf is not a finite number"
    # The first field that has no text is the one named.
    frame = pd.DataFrame({"a": ["x", None], "b": [None, "y"]})
    out = render(frame, "{a} {b}", ("a", "b"), "error")
    assert out[ROW_ERROR].tolist() == ["field 'b' is null", "field 'a' is null"]


def test_bad_nulls_option_fails_at_build_time():
    ddf = dd.from_pandas(pd.DataFrame({"q": ["a"]}), npartitions=1)
    with pytest.raises(ValueError, match="nulls must be 'skip' or 'error'"):
        ddf.llm.map("{q}", nulls="drop", model="tiny")


# --- on a cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with llm_cluster(n_workers=2, threads_per_worker=4) as client:
        yield client


@pytest.fixture(autouse=True)
def cold(request):
    if "client" in request.fixturenames:
        cold_start(request.getfixturevalue("client"))


def untidy() -> pd.DataFrame:
    """Text with None, NaN and pd.NA, nullable ints, a categorical; labelled by a non-default index."""
    return pd.DataFrame({
        "t": np.array(["json", None, "csv", np.nan, "json", "paths", pd.NA, "csv"], dtype=object),
        "n": pd.array([1, 2, None, 4, 1, 6, 7, None], dtype="Int64"),
        "c": pd.Categorical(["a", "b", "a", None, "a", "b", "b", "a"]),
    }, index=range(100, 108))


def test_null_fields_get_null_results_and_are_never_sent_to_the_model(client):
    df = untidy()
    ddf = dd.from_pandas(df, npartitions=3)
    with daskllm.usage() as u:
        out = ddf.llm.map("About {t} ({n}, {c}):", max_tokens=4, out="a", on_error="null").compute()
    full = df["t"].notna() & df["n"].notna() & df["c"].notna()
    assert out["a"].notna().tolist() == full.tolist() and out["a_error"].isna().all()
    # Only the rows with every field are prompts: (json, 1, a) twice, (paths, 6, b): two calls.
    assert u.operators["map"]["distinct"] == 2 and u.operators["map"]["executed"] == 2
    # Each answer is the one its row's text gets alone (ints render as ints: "1", not "1.0").
    alone = dd.from_pandas(pd.DataFrame({"p": ["About json (1, a):", "About paths (6, b):"]}), npartitions=1)
    expected = dict(zip(["json", "paths"], alone.llm.map("{p}", max_tokens=4, out="a").compute()["a"]))
    assert out.loc[full, "a"].tolist() == [expected[t] for t in df.loc[full, "t"]]


def test_nulls_error_names_the_row_and_the_field(client):
    ddf = dd.from_pandas(untidy(), npartitions=3)
    with pytest.raises(RowError, match=r"map: row 10[136]: field 't' is null"):
        ddf.llm.map("About {t}:", max_tokens=2, nulls="error").compute()
    out = ddf.llm.map("About {t} {n}:", max_tokens=2, out="a", nulls="error", on_error="null").compute()
    assert plain(out["a_error"]) == [None, "field 't' is null", "field 'n' is null", "field 't' is null", None,
                                       None, "field 't' is null", "field 'n' is null"]
    assert out["a"].notna().tolist() == [True, False, False, False, True, True, False, False]
    with pytest.raises(RowError, match=r"agg: row 10[136]: field 't' is null"):
        ddf.llm.agg("{t}", max_tokens=2, nulls="error").compute()


def test_filter_topk_embed_and_rerank_skip_null_rows(client):
    ddf = dd.from_pandas(untidy(), npartitions=3)
    kept = ddf.llm.filter("Is {t} a format?").compute()
    assert set(kept.index) <= {100, 102, 104, 105, 107}
    rated = ddf.llm.topk("Rate {t}", 8).compute()
    assert sorted(rated.index) == [100, 102, 104, 105, 107] and rated["rating"].dtype == "Int64"
    vectors = ddf.llm.embed("t", out="v").compute()["v"]
    assert vectors.isna().tolist() == [False, True, False, True, False, False, True, False]
    assert vectors[100] == vectors[104] and len(vectors[100]) == 384
    with dask.config.set({"dataframe.convert-string": False}):  # keep the lists lists
        docs = dd.from_pandas(pd.DataFrame({"q": ["csv", None, "json"], "d": [["a", None, "b"], ["a"], None]}),
                              npartitions=1)
        ranked = docs.llm.rerank("q", "d").compute()["d_reranked"]
    assert sorted(ranked[0]) == ["a", "b"] and ranked[1:].isna().all()


def test_a_mixed_type_column_renders_each_value_or_names_the_row_it_cannot(client):
    with dask.config.set({"dataframe.convert-string": False}):  # keep the objects objects
        ddf = dd.from_pandas(pd.DataFrame({"v": [1, "x", 2.5, None, object(), True]}, index=list("abcdef")),
                             npartitions=2)
        out = ddf.llm.map("Say {v}:", max_tokens=2, out="a", on_error="null").compute()
        with pytest.raises(RowError, match=r"map: row 'e': field 'v': cannot render a object"):
            ddf.llm.map("Say {v}:", max_tokens=2).compute()
    assert out["a"].notna().tolist() == [True, True, True, False, False, True]
    assert out["a_error"].isna().tolist() == [True, True, True, True, False, True]


def test_invalid_unicode_fails_its_row_alone(client):
    texts = ["json", "bad \ud800 text", "csv", "paths"]
    with dask.config.set({"dataframe.convert-string": False}):  # pyarrow cannot hold a lone surrogate
        ddf = dd.from_pandas(pd.DataFrame({"t": pd.Series(texts, index=[7, 8, 9, 10], dtype=object)}), npartitions=1)
        out = ddf.llm.map("About {t}:", max_tokens=2, out="a", on_error="null").compute()
        vectors = ddf.llm.embed("t", out="v", on_error="null").compute()
    assert out["a"].isna().tolist() == [False, True, False, False]
    assert out.loc[8, "a_error"].startswith("field 't': text is not valid Unicode")
    assert vectors["v"].isna().tolist() == [False, True, False, False]


def test_a_graph_error_names_the_item_in_the_users_list_after_dedupe_and_sorting(client):
    items = ["b", "b", "a", "word " * 3000, "a", "c"]
    node = daskllm.generate(daskllm.prompt("Q {x}", x=daskllm.batch(items)), max_tokens=2)
    with pytest.raises(CallError, match=r"generate item 3: prompt has \d+ tokens"):
        node.compute()


# --- stable output schemas ------------------------------------------------------------------


def frame_with_gaps() -> dd.DataFrame:
    """Three partitions: one with text, one all null, one empty."""
    df = pd.DataFrame({"t": pd.Series(["json", "csv", None, None, "gone"], dtype=STRING),
                       "docs": pd.Series([["a", "b"], ["c"], None, None, ["d"]],
                                         dtype=pd.ArrowDtype(pa.list_(pa.string())))})
    ddf = dd.from_pandas(df, npartitions=3)
    assert ddf.divisions == (0, 2, 4, 4)
    return ddf.map_partitions(lambda part: part[part.index < 4], meta=ddf._meta)


OPERATORS = {
    "map": lambda ddf, index: ddf.llm.map("About {t}:", max_tokens=3, out="a"),
    "map-errors": lambda ddf, index: ddf.llm.map("About {t}:", max_tokens=3, out="a", on_error="null",
                                                 nulls="error"),
    "filter": lambda ddf, index: ddf.llm.filter("Is {t} a format?"),
    "extract": lambda ddf, index: ddf.llm.extract("{t}", {"s": str, "i": int, "f": float, "b": bool},
                                                  max_tokens=4, on_error="null"),
    "embed": lambda ddf, index: ddf.llm.embed("t", out="v"),
    "search": lambda ddf, index: ddf.llm.search(index, "t", k=2, out="hits"),
    "rerank": lambda ddf, index: ddf.llm.rerank("t", "docs", k=1, out="best"),
    "topk": lambda ddf, index: ddf.llm.topk("Rate {t}", 3),
    "choices": lambda ddf, index: ddf.llm.map("About {t}:", choices=["json", "csv", "other"], out="kind"),
    "schema": lambda ddf, index: ddf.llm.map("About {t}:", schema=FLAT, max_tokens=12, out="info", on_error="null"),
    "schema-nested": lambda ddf, index: ddf.llm.map("About {t}:", schema=NESTED, max_tokens=24, out="info",
                                                    on_error="null"),
    "schema-open": lambda ddf, index: ddf.llm.map("About {t}:", schema=OPEN, max_tokens=12, out="info",
                                                  on_error="null"),
}
FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}
# Nested (a $ref, a list, a string enum, an optional value): every type fixed, so a struct.
NESTED = {"type": "object", "additionalProperties": False, "required": ["tags", "owner", "kind", "n"],
          "properties": {"tags": {"type": "array", "items": {"type": "string"}}, "owner": {"$ref": "#/$defs/Owner"},
                         "kind": {"enum": ["a", "b"]}, "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
          "$defs": {"Owner": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                              "additionalProperties": False}}}
OPEN = {"type": "object", "properties": {"name": {"type": "string"}}}  # other keys allowed: JSON text
CSV = ("map", "map-errors", "filter", "extract", "topk", "choices", "schema-open")  # flat types: CSV holds them, read with dtypes

EXPECTED = {
    "map": {"a": STRING},
    "map-errors": {"a": STRING, "a_error": STRING},
    "extract": {"s": STRING, "i": pd.Int64Dtype(), "f": pd.Float64Dtype(), "b": pd.BooleanDtype(),
                "extract_error": STRING},
    "embed": {"v": pd.ArrowDtype(pa.list_(pa.float32(), 384))},
    "search": {"hits": pd.ArrowDtype(pa.list_(pa.struct([("id", pa.int64()), ("score", pa.float64()),
                                                         ("text", pa.string())])))},
    "rerank": {"best": pd.ArrowDtype(pa.list_(pa.string()))},
    "topk": {"rating": pd.Int64Dtype()},
    "choices": {"kind": pd.CategoricalDtype(["json", "csv", "other"])},
    "schema": {"info": pd.ArrowDtype(pa.struct([("name", pa.string()), ("n", pa.int64())])), "info_error": STRING},
    "schema-nested": {"info": pd.ArrowDtype(pa.struct([("tags", pa.list_(pa.string())),
                                                       ("owner", pa.struct([("name", pa.string())])),
                                                       ("kind", pa.string()), ("n", pa.int64())])),
                      "info_error": STRING},
    "schema-open": {"info": STRING, "info_error": STRING},
}


@pytest.fixture(scope="module")
def index(client):
    index = daskllm.ShardedIndex.from_texts(client, "df-types-docs", ["json: encode JSON", "csv: CSV files",
                                                                       "pathlib: paths"])
    yield index
    index.drop()


def same_values(back: pd.DataFrame, written: pd.DataFrame) -> None:
    """Equal values and dtypes; a text column comes back as pandas' own string dtype (the name
    ``string[pyarrow]`` that parquet stores means that dtype to pandas), with the same values."""
    back = back.rename_axis(written.index.name)
    for column, dtype in written.dtypes.items():
        if dtype == STRING:
            assert back[column].dtype == "string", (column, back[column].dtype)
            back[column] = back[column].astype(STRING)
    pd.testing.assert_frame_equal(back, written, check_index_type=False)


@pytest.mark.parametrize("name", list(OPERATORS))
def test_every_operator_has_a_fixed_arrow_schema_and_reads_back_with_no_option(client, index, name, tmp_path):
    out = OPERATORS[name](frame_with_gaps(), index)
    for column, dtype in EXPECTED.get(name, {}).items():
        assert out.dtypes[column] == dtype, (column, out.dtypes[column])
    parts = [p.compute() for p in out.partitions]  # each partition, even the empty and the all-null one
    for part in parts:
        assert part.dtypes.to_dict() == out.dtypes.to_dict()
    computed = pd.concat(parts)
    if name == "map-errors":
        assert plain(computed["a_error"]) == [None, None, "field 't' is null", "field 't' is null"]
    if name == "schema-open":  # each answer's JSON text, as json.dumps lays it out
        texts = [t for t in plain(computed["info"]) if t is not None]
        assert texts and all(json.dumps(json.loads(t)) == t and isinstance(json.loads(t), dict) for t in texts)
    out.to_parquet(tmp_path / name)
    same_values(dd.read_parquet(tmp_path / name).compute(), computed)  # no reader option
    same_values(pd.read_parquet(tmp_path / name), computed)
    if name in CSV:
        columns = ["t", *EXPECTED.get(name, {})]  # not the input's list column: CSV has no lists
        out[columns].to_csv(tmp_path / f"{name}-csv")
        parts = sorted((tmp_path / f"{name}-csv").iterdir())
        dtypes = {c: "string" if d == STRING else d for c, d in computed[columns].dtypes.items()}
        same_values(pd.concat(pd.read_csv(p, index_col=0, dtype=dtypes) for p in parts), computed[columns])


def test_a_schema_gives_the_arrow_type_it_fixes_or_json_text():
    from pydantic import BaseModel, ConfigDict

    from daskllm.dataframe.ops import JSON_TEXT, as_arrow, schema_dtype

    class Owner(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        year: int | None = None

    class Repo(BaseModel):
        model_config = ConfigDict(extra="forbid")
        owners: list[Owner]
        stars: float

    class Loose(BaseModel):  # pydantic's default: other keys allowed
        name: str

    assert schema_dtype(Repo.model_json_schema()) == pd.ArrowDtype(pa.struct([
        ("owners", pa.list_(pa.struct([("name", pa.string()), ("year", pa.int64())]))), ("stars", pa.float64())]))
    assert schema_dtype(Loose.model_json_schema()) == JSON_TEXT
    assert schema_dtype({"type": "array", "items": {"enum": ["a", "b"]}}) == pd.ArrowDtype(pa.list_(pa.string()))
    assert schema_dtype({"type": "string"}) == JSON_TEXT  # a lone scalar: its JSON text, as any text column here
    text = as_arrow(pd.Series(["a", {"b": 1}, None]), JSON_TEXT)
    assert text[:2].tolist() == ['"a"', '{"b": 1}'] and pd.isna(text[2]) and text.dtype == JSON_TEXT
    assert schema_dtype({"type": "object", "additionalProperties": False,
                         "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}) == JSON_TEXT


def test_the_nested_arrow_type_names_parquet_stores_read_back_as_the_same_type():
    from daskllm.dataframe.roundtrip import arrow_type

    types = [pa.list_(pa.float32(), 384), pa.list_(pa.string()), pa.map_(pa.int64(), pa.float64()),
             pa.list_(pa.struct([("id", pa.int64()), ("score", pa.float64()), ("text", pa.string())])),
             pa.struct([("a name", pa.list_(pa.timestamp("us", tz="UTC"))), ("b", pa.struct([("c", pa.bool_())]))]),
             pa.large_list(pa.field("x", pa.int8(), nullable=False)), pa.list_(pa.list_(pa.float64(), 2))]
    for t in types:
        assert arrow_type(str(t)) == t
        assert pd.api.types.pandas_dtype(str(pd.ArrowDtype(t))) == pd.ArrowDtype(t)
    assert pd.api.types.pandas_dtype("string[pyarrow]") == pd.StringDtype("pyarrow")  # pandas' own names unchanged
    with pytest.raises(TypeError, match="not understood"):
        pd.api.types.pandas_dtype("list<item: nonsense>[pyarrow]")

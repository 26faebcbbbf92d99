"""The ``.llm`` dataframe accessor on a multi-process cluster with the tiny LLM and MiniLM."""

from __future__ import annotations

import contextlib
import logging

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import daskllm
from daskllm.dataframe import Budget, BudgetExceeded, Op, RowError
from daskllm.dataframe.ops import costs as _costs, extract_fields as _extract_fields, full_template as _template, yes_no as _yes_no
from daskllm.engines import SamplingParams
from daskllm.prompts import Slot, parse_template

from helpers import cold_start

QUESTIONS = ["How do I read JSON?", "How do I parse CSV?", "How do I sort a list?", "How do I open a file?"]
TEMPLATE = "Answer in one line. Q: {q}\nA:"


def table(repeat: int = 4, npartitions: int = 3) -> dd.DataFrame:
    """Rows with many duplicate prompts (each question `repeat` times), pyarrow strings."""
    df = pd.DataFrame({"q": QUESTIONS * repeat, "n": range(len(QUESTIONS) * repeat)})
    df["q"] = df["q"].astype(pd.ArrowDtype(pa.string()))
    return dd.from_pandas(df, npartitions=npartitions)


def naive(question: str, max_tokens: int = 6, chat: bool = True, **kw) -> str:
    """One call, as a user would make it: the row's prompt as a user message of the model's
    chat template (what the accessor does for a model that has one), or as bare text."""
    p = daskllm.chat([{"role": "user", "content": TEMPLATE}], q=question) if chat else daskllm.prompt(TEMPLATE, q=question)
    node = daskllm.generate(p, max_tokens=max_tokens, **kw)
    return daskllm.compute(node, passes=[], granularity="query", result_cache=False)[0]


@pytest.fixture(scope="module")
def client(llm_cluster, tiny_model_dir):
    with llm_cluster(n_workers=2, threads_per_worker=4) as client:
        yield client


@pytest.fixture(autouse=True)
def cold(client):
    cold_start(client)


def test_map_runs_each_distinct_prompt_once_and_matches_the_naive_calls(client):
    with daskllm.usage() as u:
        out = table().llm.map(TEMPLATE, max_tokens=6, out="answer").compute()
    assert list(out.columns) == ["q", "n", "answer"] and len(out) == 16
    assert isinstance(out["answer"].dtype, pd.ArrowDtype)
    expected = {q: naive(q) for q in QUESTIONS}
    assert out["answer"].tolist() == [expected[q] for q in out["q"]]
    stats = u.operators["map"]
    assert stats["rows"] == 16 and stats["distinct"] == 4 and stats["executed"] == 4
    assert u.executed["generate"] == 4 and u.decode_tokens == 4 * 6


def test_map_without_chat_sends_the_bare_prompt(client):
    out = table(repeat=1).llm.map(TEMPLATE, max_tokens=6, out="answer", chat=False).compute()
    assert out["answer"].tolist() == [naive(q, chat=False) for q in out["q"]]
    assert out["answer"].tolist() != [naive(q) for q in out["q"]]


def test_an_unread_column_is_never_generated(client):
    mapped = table().llm.map(TEMPLATE, max_tokens=6, out="answer")
    with daskllm.usage() as u:
        kept = mapped[["n"]].compute()
    assert len(kept) == 16
    assert u.executed.get("generate", 0) == 0 and "map" not in u.operators


def test_a_budget_stops_before_going_over_and_keeps_what_finished(client):
    budget = Budget(tokens=60)
    with pytest.raises(BudgetExceeded, match=r"row \d+: budget exhausted"):
        table().llm.map(TEMPLATE, max_tokens=6, budget=budget).compute()
    assert budget.used()["tokens"] <= 60

    budget = Budget(calls=2)
    out = table(npartitions=1).llm.map(TEMPLATE, max_tokens=6, out="a", on_error="null", budget=budget).compute()
    done = out["a"].notna()
    assert out.loc[done, "q"].nunique() == 2 and budget.used()["calls"] == 2
    assert out.loc[~done, "a_error"].str.startswith("budget exhausted").all()


@contextlib.contextmanager
def scheduler_errors():
    """The error records Dask logs in this process meanwhile: the scheduler's (a LocalCluster's
    scheduler runs here), e.g. "Exception while handling op variable_get"."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("distributed")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_spent_budget_refuses_every_row_at_once_without_scheduler_errors(client):
    """Budget(tokens=0) over hundreds of rows: each partition asks once and every row fails with
    the budget's reason; the scheduler logs no error (a Variable.get timing out did, per row)."""
    rows = dd.from_pandas(pd.DataFrame({"q": [f"Question number {i}?" for i in range(300)]}), npartitions=3)
    budget = Budget(tokens=0)
    with scheduler_errors() as errors:
        out = rows.llm.map(TEMPLATE, max_tokens=4, out="a", on_error="null", budget=budget).compute()
        assert budget.used() == {"tokens": 0, "calls": 0}
    assert len(out) == 300 and out["a"].isna().all()
    assert out["a_error"].str.startswith("budget exhausted (0 of 0 tokens").all()
    assert not errors, [r.getMessage() for r in errors]


def test_a_budget_that_fits_exactly_n_calls_lets_exactly_n_through_across_partitions(client):
    questions = [f"Question number {i}?" for i in range(40)]
    op = Op("generate", "tiny", "map", TEMPLATE, SamplingParams(max_tokens=4), chat=True)
    cost = _costs(pd.DataFrame({"q": questions}), op)
    common = max(set(cost), key=cost.count)
    same = [q for q, c in zip(questions, cost) if c == common]  # rows of one cost: N of them fit N x cost
    assert len(same) >= 12
    rows = dd.from_pandas(pd.DataFrame({"q": same}), npartitions=4)
    for budget in (Budget(calls=5), Budget(tokens=5 * common)):
        out = rows.llm.map(TEMPLATE, max_tokens=4, out="a", on_error="null", budget=budget).compute()
        assert out["a"].notna().sum() == 5 and budget.used() == {"tokens": 5 * common, "calls": 5}
        assert out.loc[out["a"].isna(), "a_error"].str.startswith("budget exhausted").all()


def test_on_error_raise_names_the_row_and_null_keeps_the_others(client):
    df = pd.DataFrame({"q": QUESTIONS + ["word " * 5000]}, index=[10, 11, 12, 13, 14])
    ddf = dd.from_pandas(df, npartitions=2)
    with pytest.raises(RowError, match=r"row 14: prompt has \d+ tokens"):
        ddf.llm.map(TEMPLATE, max_tokens=4).compute()
    out = ddf.llm.map(TEMPLATE, max_tokens=4, out="a", on_error="null").compute()
    assert out["a"].isna().tolist() == [False] * 4 + [True]
    assert "prompt has" in out.loc[14, "a_error"] and out.loc[10:13, "a_error"].isna().all()
    assert out.loc[10, "a"] == naive(QUESTIONS[0], max_tokens=4)


def test_filter_keeps_the_rows_the_model_says_yes_to(client):
    predicate = "Is this about files? {q}"
    kept = table().llm.filter(predicate).compute()
    answers = {q: daskllm.generate(daskllm.chat([{"role": "user", "content": predicate + "\nAnswer yes or no:"}], q=q),
                                   max_tokens=1, allowed_token_ids=_yes_no("tiny")).compute() for q in QUESTIONS}
    # One token: a word's first token (the tiny tokenizer may spell "Yes" in pieces).
    assert all(a.strip()[:1].lower() in ("y", "n") for a in answers.values())
    assert sorted(kept["n"]) == [n for n, q in enumerate(QUESTIONS * 4) if answers[q].strip().lower().startswith("y")]


def test_filter_keeps_rows_where_its_answers_are_co_aligned_with_the_table(client):
    # One partition (or dedupe="local"): the answers come from the table's own partitions, and
    # dask-expr's filter pushdown once took the mask's astype for the table and returned the mask.
    predicate = "Is this about files? {q}"
    expected = table(repeat=1).llm.filter(predicate).compute()  # a shared-results table: never co-aligned
    assert list(expected.columns) == ["q", "n"]
    for kept in (table(repeat=1, npartitions=1).llm.filter(predicate),
                 table(repeat=1).llm.filter(predicate, dedupe="local")):
        out = kept.compute()
        assert isinstance(out, pd.DataFrame) and list(out.columns) == ["q", "n"]
        assert out["n"].tolist() == expected["n"].tolist()
    # An operator after the filter reads the table's columns (it was handed the mask: KeyError 'q').
    out = table(repeat=1, npartitions=1).llm.filter(predicate).llm.map("Q: {q}", max_tokens=2, out="a").compute()
    assert list(out.columns) == ["q", "n", "a"] and out["n"].tolist() == expected["n"].tolist()


def test_extract_parses_json_fields_and_reports_rows_that_do_not(client):
    assert _extract_fields('Sure: {"module": "json", "year": "2001"} done', (("module", "str"), ("year", "int"))) \
        == {"module": "json", "year": 2001}
    with pytest.raises(ValueError, match="no field 'year'"):
        _extract_fields('{"module": "json"}', (("module", "str"), ("year", "int")))
    # Under the fields' grammar even random weights (tiny) write JSON, but not a closed object in
    # 8 tokens: every row says its answer was cut.
    out = table().llm.extract("Which module? {q}", {"module": str, "year": int}, max_tokens=8,
                              on_error="null").compute()
    assert list(out.columns) == ["q", "n", "module", "year", "extract_error"]
    assert out["module"].isna().all() and out["extract_error"].str.contains("JSON").all()
    with pytest.raises(RowError, match=r"extract: row \d+: output cut at max_tokens=8 before the JSON closed"):
        table().llm.extract("Which module? {q}", {"module": str}, max_tokens=8).compute()


def test_extract_takes_field_names_with_braces_as_data(client):
    assert _extract_fields('Sure: {"{x}": "3", "b": "}"}', (("{x}", "int"), ("b", "str"))) == {"{x}": 3, "b": "}"}
    op = Op("extract", "tiny", "extract", "Which module? {q}", SamplingParams(max_tokens=8), fields=(("{x}", "int"),))
    assert "keys {x}:" in _template(op).replace("{{", "{").replace("}}", "}")
    assert [s.name for s in parse_template(_template(op)) if isinstance(s, Slot)] == ["q"]  # not a field "x"
    out = table(repeat=1).llm.extract("Which module? {q}", {"{x}": int}, max_tokens=8, on_error="null").compute()
    assert list(out.columns) == ["q", "n", "{x}", "extract_error"]
    assert out["{x}"].isna().all() and out["extract_error"].str.contains("JSON").all()  # cut at 8 tokens


def test_embed_and_search_columns(client):
    docs = ["json: encode and decode JSON", "csv: read and write CSV files", "pathlib: filesystem paths",
            "heapq: heap queue", "sorted: return a new sorted list"]
    index = daskllm.ShardedIndex.from_texts(client, "df-docs", docs)
    try:
        out = table(repeat=1, npartitions=2).llm.embed("q").llm.search(index, "q", k=2).compute()
        vectors = np.stack(out["q_embedding"].tolist())
        expected = np.stack(daskllm.embed(QUESTIONS).compute())
        assert np.allclose(vectors, expected, atol=1e-6)
        direct = index.search(QUESTIONS, k=2)
        assert [[h["id"] for h in hits] for hits in out["q_hits"]] == [[h.id for h in hits] for hits in direct]
    finally:
        index.drop()


def test_parquet_round_trip(client, tmp_path):
    out = table().llm.map(TEMPLATE, max_tokens=6, out="answer")
    out.to_parquet(tmp_path / "answers")
    back = dd.read_parquet(tmp_path / "answers").compute()
    assert back["answer"].tolist() == out.compute()["answer"].tolist()
    assert isinstance(back["answer"].dtype, pd.ArrowDtype) or str(back["answer"].dtype).startswith("string")


def test_bad_arguments_fail_at_build_time(client):
    ddf = table()
    with pytest.raises(KeyError, match=r"\['missing'\] are not columns"):
        ddf.llm.map("Q: {missing}")
    with pytest.raises(ValueError, match="on_error"):
        ddf.llm.map(TEMPLATE, on_error="ignore")
    with pytest.raises(ValueError, match="field types"):
        ddf.llm.extract(TEMPLATE, {"x": list})
    with pytest.raises(ValueError, match="non-negative"):
        Budget(tokens=-1)


def test_rerank_orders_each_rows_documents(client):
    docs = [["csv: read and write CSV files", "json: encode and decode JSON", "heapq: heap queue"]] * 4
    with dask.config.set({"dataframe.convert-string": False}):  # keep the lists lists
        ddf = dd.from_pandas(pd.DataFrame({"q": QUESTIONS, "docs": docs}), npartitions=2)
        out = ddf.llm.rerank("q", "docs", k=2).compute()
    with pytest.raises(RowError, match="must hold a list"):
        dd.from_pandas(pd.DataFrame({"q": QUESTIONS, "docs": ["a"] * 4}), npartitions=1).llm.rerank(
            "q", "docs").compute()
    for q, ranked in zip(out["q"], out["docs_reranked"]):
        assert ranked == daskllm.rerank(q, docs[0], k=2).compute()
    assert len(out) == 4


def test_sim_join_pairs_rows_with_their_most_similar_rows(client):
    left = dd.from_pandas(pd.DataFrame({"q": QUESTIONS, "n": range(4)}), npartitions=2)
    right = dd.from_pandas(pd.DataFrame({"doc": ["json: encode and decode JSON", "csv: read and write CSV files",
                                                 "sorted: return a new sorted list", "open: open a file"],
                                         "n": range(4)}), npartitions=2)
    out = left.llm.sim_join(right, "q", "doc", k=2).compute()
    assert list(out.columns) == ["q", "n", "doc", "n_right", "similarity"] and len(out) == 8
    vq = np.stack(daskllm.embed(QUESTIONS).compute())
    vd = np.stack(daskllm.embed(right["doc"].compute().tolist()).compute())
    sims = (vq / np.linalg.norm(vq, axis=1, keepdims=True)) @ (vd / np.linalg.norm(vd, axis=1, keepdims=True)).T
    for i, q in enumerate(QUESTIONS):
        best = out[out["q"] == q]
        assert best["n_right"].tolist() == list(np.argsort(-sims[i], kind="stable")[:2])
        assert np.allclose(best["similarity"], np.sort(sims[i])[::-1][:2], atol=1e-5)


def test_topk_keeps_the_best_rated_rows(client):
    with daskllm.usage() as u:
        best = table(repeat=2).llm.topk("How useful is this question? {q}", 3).compute()
    rated = table(repeat=2).llm.map("How useful is this question? {q}", max_tokens=1, out="r").compute()
    assert len(best) == 3 and best["rating"].between(0, 9).all()
    assert best["rating"].is_monotonic_decreasing
    assert u.operators["topk"]["executed"] == 4  # 8 rows, 4 distinct questions
    assert len(rated) == 8


def test_agg_summarizes_the_table_as_a_tree(client):
    ddf = table(repeat=2, npartitions=4)
    with daskllm.usage() as u:
        summary = ddf.llm.agg("Q: {q}", max_tokens=8, split_every=2).compute()
    assert isinstance(summary, str) and summary
    # 4 partition summaries, then 2, then 1 (split_every=2): 7 summary calls.
    assert u.operators["agg"]["executed"] == 7


def test_agg_takes_rows_with_braces_as_data(client):
    """Rows (and the summaries made of them) are values, never parsed as a template."""
    frame = pd.DataFrame({"q": ["{not a slot}", "a } b {", "{{x}}", "{0} and {q}"]})
    summary = dd.from_pandas(frame, npartitions=2).llm.agg("Row: {q}", max_tokens=4, split_every=2).compute()
    assert isinstance(summary, str) and summary


def test_series_accessor(client):
    s = table()["q"]
    mapped = s.llm.map(TEMPLATE, max_tokens=6).compute()
    expected = {q: naive(q) for q in QUESTIONS}
    assert mapped.tolist() == [expected[q] for q in s.compute()]
    assert len(s.llm.embed().compute()) == 16
    with pytest.raises(ValueError, match="named series"):
        dd.from_pandas(pd.Series(["a"]), npartitions=1).llm


def test_dask_progress_bar_follows_an_llm_job(client, capsys):
    from distributed import progress

    out = table().llm.map(TEMPLATE, max_tokens=6, out="answer").persist()
    progress(out)  # the text bar, as in a terminal; returns when the job is done
    captured = capsys.readouterr()
    assert "100%" in captured.out + captured.err
    assert len(out.compute()) == 16


def test_budget_reservations_match_what_the_engine_counts(client):
    """A budget charges prompt tokens + max_tokens per call: exactly the tokens the engine sees."""
    budget = Budget(tokens=10_000)
    with daskllm.usage() as u:
        table(repeat=1).llm.filter("Is this about files? {q}", budget=budget).compute()
    assert budget.used()["tokens"] == u.prefill_tokens + 4 * 1 and budget.used()["calls"] == 4

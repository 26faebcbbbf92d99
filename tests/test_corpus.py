"""The stdlib documentation corpus and the question-set loaders."""

from __future__ import annotations

import json
import pathlib
import sys

import dask.config
import pandas as pd
import pyarrow as pa
import pytest

from daskllm import corpus, datasets
from daskllm.corpus import COLUMNS, KINDS, stdlib_docs, stdlib_docs_ddf

STRING = pd.ArrowDtype(pa.string())


@pytest.fixture(scope="module")
def docs(stdlib_corpus) -> pd.DataFrame:
    return stdlib_docs()


def _row(docs: pd.DataFrame, qualname: str) -> dict:
    match = docs[docs["qualname"] == qualname]
    assert len(match) == 1, f"{qualname} should appear exactly once in the corpus"
    return match.iloc[0].to_dict()


# ---------------------------------------------------------------- corpus


def test_table_shape(docs):
    assert len(docs) > 3000
    assert tuple(docs.columns) == COLUMNS
    assert docs["qualname"].is_unique
    assert list(docs["qualname"]) == sorted(docs["qualname"])
    assert list(docs["id"]) == list(range(len(docs)))
    assert list(docs.index) == list(range(len(docs)))
    assert (docs["doc"].str.strip().str.len() > 0).all()
    assert (docs["first_sentence"].str.len() > 0).all()
    assert set(docs["kind"]) <= set(KINDS)
    assert {"module", "class", "function", "method", "property"} <= set(docs["kind"])
    # every qualname lies under its module
    assert all(q == m or q.startswith(m + ".") for m, q in zip(docs["module"], docs["qualname"]))


def test_dtypes(docs):
    assert docs["id"].dtype == "int64"
    for column in COLUMNS[1:]:
        assert docs[column].dtype == STRING, column


def test_known_entries(docs):
    dumps = _row(docs, "json.dumps")
    assert dumps["kind"] == "function"
    assert dumps["module"] == "json"
    assert "obj" in dumps["signature"]
    assert dumps["first_sentence"].startswith("Serialize ``obj``")
    assert _row(docs, "collections.OrderedDict")["kind"] == "class"
    assert _row(docs, "pathlib.Path.exists")["kind"] == "method"
    assert _row(docs, "json")["kind"] == "module"
    assert _row(docs, "builtins.ValueError")["kind"] == "exception"
    assert _row(docs, "datetime.datetime.now")["kind"] == "classmethod"
    assert _row(docs, "os.stat_result.st_mtime")["kind"] == "property"
    # defined in a submodule, documented under the package that exports it
    assert _row(docs, "json.JSONDecoder.decode")["kind"] == "method"
    assert not (docs["qualname"] == "json.decoder.JSONDecoder.decode").any()
    # defined in a C accelerator module, documented under its public module
    assert _row(docs, "io.StringIO")["module"] == "io"
    assert _row(docs, "operator.add")["kind"] == "function"
    assert _row(docs, "os.listdir")["module"] == "os"
    # public submodules are walked
    for module in (
        "email.mime.text",
        "urllib.parse",
        "xml.etree.ElementTree",
        "concurrent.futures",
    ):
        assert _row(docs, module)["kind"] == "module"


def test_excluded_modules_are_absent(docs):
    top_level = {module.split(".")[0] for module in docs["module"]}
    for excluded in (
        "test",
        "idlelib",
        "tkinter",
        "turtle",
        "antigravity",
        "this",
        "lib2to3",
        "posix",
    ):
        assert excluded not in top_level
    parts = {part for module in docs["module"] for part in module.split(".")}
    assert not {part for part in parts if part.startswith("_")}
    assert not {"test", "tests", "__main__"} & parts


def test_signatures_show_no_addresses_or_paths(docs):
    signatures = docs["signature"]
    assert not signatures.str.contains(" at 0x", regex=False).any()
    assert not signatures.str.contains(sys.executable, regex=False).any()
    assert "environ=<_Environ object>" in _row(docs, "cgi.FieldStorage")["signature"]


def test_second_call_is_cached(stdlib_corpus, monkeypatch):
    mtime = stdlib_corpus.stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the corpus was rebuilt although it is cached")

    monkeypatch.setattr(corpus, "_build_in_subprocess", no_rebuild)
    first = stdlib_docs()
    second = stdlib_docs()
    assert corpus.corpus_path() == stdlib_corpus
    assert stdlib_corpus.stat().st_mtime_ns == mtime
    pd.testing.assert_frame_equal(first, second)


def test_returned_frames_are_independent(docs):
    frame = stdlib_docs()
    frame.loc[0, "doc"] = "changed"
    assert stdlib_docs().loc[0, "doc"] == docs.loc[0, "doc"]


def test_limit(docs):
    limited = stdlib_docs(limit=10)
    pd.testing.assert_frame_equal(limited, docs.head(10))
    assert len(stdlib_docs(limit=0)) == 0
    with pytest.raises(ValueError, match="limit"):
        stdlib_docs(limit=-1)


def test_dask_dataframe(docs):
    ddf = stdlib_docs_ddf(npartitions=4)
    assert ddf.npartitions == 4
    assert len(ddf) == len(docs)
    assert ddf.dtypes["qualname"] == STRING
    computed = ddf.compute()
    pd.testing.assert_frame_equal(computed, docs)


def test_fresh_build_is_identical_and_isolated(docs, tmp_path):
    """A build in an empty cache reproduces the table, without importing the stdlib here."""
    before = set(sys.modules)
    with dask.config.set({"daskllm.models.cache-dir": str(tmp_path)}):
        path = corpus.corpus_path()
        rebuilt = stdlib_docs()
    assert path.parent == tmp_path / "corpus"
    assert path.name.startswith(f"stdlib-{sys.version_info[0]}.{sys.version_info[1]}.")
    assert not list(path.parent.glob(".*tmp-*")), "the staging file was left behind"
    pd.testing.assert_frame_equal(rebuilt, docs)
    imported_here = set(sys.modules) - before
    assert not {"imaplib", "nntplib", "mailbox", "curses", "xmlrpc.server"} & imported_here


def test_first_sentence():
    assert corpus.first_sentence("Return x, e.g. 3. More text.") == "Return x, e.g. 3."
    assert corpus.first_sentence("f(x) -> int\n\nCompute it.  Then more.") == "Compute it."
    assert (
        corpus.first_sentence("One line\ncontinued here.\n\nSecond.") == "One line continued here."
    )


# ---------------------------------------------------------------- question sets


@pytest.fixture(scope="module")
def data_dir() -> pathlib.Path:
    directory = datasets.default_data_dir()
    if directory is None or not directory.is_dir():
        pytest.skip(
            "the shared question sets are absent (no $DASKLLM_DATA_DIR and no ../shared/data "
            "next to the repository)"
        )
    return directory


@pytest.mark.parametrize(
    ("name", "rows", "extra"),
    [("hotpotqa", 1487, ["level"]), ("parallelqa", 113, ["branch"]), ("movies", 500, [])],
)
def test_load_real_question_sets(data_dir, name, rows, extra):
    frame = datasets.load_questions(name, data_dir)
    assert len(frame) == rows
    assert list(frame.columns) == ["id", "question", "answer", *extra]
    for column in ("id", "question", "answer"):
        assert frame[column].dtype == STRING
    assert frame["id"].is_unique
    assert (frame["question"].str.len() > 0).all()
    if name == "hotpotqa":
        assert set(frame["level"]) <= {"easy", "medium", "hard"}
    if name == "parallelqa":
        assert frame["branch"].dtype == "int64"
        assert (frame["branch"] >= 2).all()


def test_load_by_file_stem(data_dir):
    by_stem = datasets.load_questions("parallelqa_dataset", data_dir)
    pd.testing.assert_frame_equal(by_stem, datasets.load_questions("parallelqa", data_dir))


def test_unknown_set():
    with pytest.raises(ValueError, match="unknown question set"):
        datasets.load_questions("squad", "/nonexistent")


def test_missing_file_names_path_and_set(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        datasets.load_questions("hotpotqa", tmp_path)
    message = str(error.value)
    assert str(tmp_path / "hotpotqa_comparison.json") in message
    assert "hotpotqa" in message


@pytest.mark.parametrize(
    ("rows", "pattern"),
    [
        (
            [
                {"id": "1", "question": "q?", "answer": "a", "branch": 2},
                {"id": "2", "answer": "b", "branch": 3},
            ],
            r"row 1: field 'question'",
        ),
        ([{"id": "1", "question": "q?", "answer": "a", "branch": "two"}], r"row 0: field 'branch'"),
        ([{"id": "1", "question": "q?", "answer": None, "branch": 2}], r"row 0: field 'answer'"),
        ([{"id": "1", "question": "q?", "answer": "a", "branch": 2}] * 2, r"row 1: field 'id'"),
        ({"id": "1"}, r"JSON array"),
    ],
)
def test_malformed_file(tmp_path, rows, pattern):
    (tmp_path / "parallelqa_dataset.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=pattern):
        datasets.load_questions("parallelqa", tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "movie_recommendations_formatted.json").write_text("[{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        datasets.load_questions("movies", tmp_path)


def test_default_data_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DASKLLM_DATA_DIR", str(tmp_path))
    assert datasets.default_data_dir() == tmp_path


def test_stdlib_questions(docs):
    questions = datasets.stdlib_questions(50)
    assert len(questions) == 50
    assert list(questions.columns) == ["id", "question", "answer", "kind"]
    assert questions["id"].is_unique
    assert set(questions["answer"]) <= set(docs["qualname"])
    for row in questions.itertuples():
        source = docs.loc[row.id]
        assert source["qualname"] == row.answer
        assert source["first_sentence"] in row.question
    pd.testing.assert_frame_equal(questions, datasets.stdlib_questions(50))
    assert set(datasets.stdlib_questions(50, seed=1)["id"]) != set(questions["id"])

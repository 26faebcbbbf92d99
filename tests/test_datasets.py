"""daskllm.datasets: one loader for the corpus and every question set, and its scorer."""

from __future__ import annotations

import pandas as pd
import pytest

from daskllm import datasets
from helpers import daskllm_command


@pytest.fixture(scope="module")
def docs(stdlib_corpus) -> pd.DataFrame:
    return datasets.load("stdlib-docs")


@pytest.mark.parametrize(("answer", "module", "named"), [
    ("Use json.load() from the json module.", "json", True),
    ("The JSON module", "json", True),
    ("jsonschema can do it", "json", False),
    ("os.path.join joins paths", "os", True),
    ("posix.stat", "os", False),
    ("the concurrent.futures module", "concurrent.futures", True),
    ("", "json", False),
])
def test_names_module(answer, module, named):
    assert datasets.names_module(answer, module) is named


def test_module_questions_have_one_module_answer_that_the_question_does_not_give(docs):
    questions = datasets.load("stdlib-modules", 300, seed=0)
    assert list(questions.columns) == ["id", "question", "answer", "qualname", "kind"]
    assert len(questions) == 300 and questions["id"].is_unique
    rows = docs.set_index("id").loc[questions["id"]]
    assert (rows["module"].to_numpy() == questions["answer"].to_numpy()).all()
    assert (rows["qualname"].to_numpy() == questions["qualname"].to_numpy()).all()
    for question, answer, sentence, kind in zip(questions["question"], questions["answer"],
                                                rows["first_sentence"], questions["kind"]):
        assert question.startswith("Which Python standard-library module has") and question.endswith(sentence)
        assert kind in ("function", "class", "exception") and kind in question
        assert "." not in answer and not answer.startswith("_")
        assert answer not in ("posixpath", "ntpath", "genericpath")
        assert not datasets.names_module(question, answer), question
    # each sentence has one source row in the whole corpus
    assert docs["first_sentence"].isin(rows["first_sentence"]).sum() == len(rows)


def test_generated_sets_are_deterministic_and_bounded():
    first = datasets.load("stdlib-modules", 20, seed=3)
    pd.testing.assert_frame_equal(first, datasets.module_questions(20, seed=3))
    assert set(datasets.load("stdlib-modules", 20, seed=4)["id"]) != set(first["id"])
    with pytest.raises(ValueError, match=r"more than the \d+ module questions"):
        datasets.load("stdlib-modules", 10**6)
    with pytest.raises(ValueError, match="say how many questions"):
        datasets.load("stdlib-objects")
    with pytest.raises(ValueError, match="non-negative integer"):
        datasets.load("stdlib-modules", -1)


def test_howto_answers_are_corpus_modules(docs):
    howto = datasets.load("stdlib-howto")
    assert len(howto) == len(datasets.HOWTO) == 16 and howto["id"].is_unique
    assert set(howto["answer"]) <= set(docs["module"])
    assert list(datasets.load("stdlib-howto", 3)["question"]) == [q for q, _ in datasets.HOWTO[:3]]


def test_catalog_lists_what_load_loads_and_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("DASKLLM_DATA_DIR", str(tmp_path))
    entries = {info.name: info for info in datasets.catalog()}
    assert set(entries) == {"stdlib-docs", "stdlib-howto", "stdlib-modules", "stdlib-objects",
                            "hotpotqa", "parallelqa", "movies"}
    assert not entries["hotpotqa"].available and entries["hotpotqa"].location is None
    with pytest.raises(FileNotFoundError, match="hotpotqa_comparison.json"):
        datasets.load("hotpotqa")
    (tmp_path / "movie_recommendations_formatted.json").write_text(
        '[{"id": 7, "question": "Which film?", "answer": "Heat"}]')
    assert {info.name: info for info in datasets.catalog()}["movies"].available
    movies = datasets.load("movies")
    assert movies.to_dict("records") == [{"id": "7", "question": "Which film?", "answer": "Heat"}]
    with pytest.raises(ValueError, match="unknown dataset 'squad'.*stdlib-howto"):
        datasets.load("squad")


def test_real_sets_load_through_the_same_call():
    if datasets.default_data_dir() is None:
        pytest.skip("../shared/data is not here")
    hotpot = datasets.load("hotpotqa", 10)
    assert len(hotpot) == 10 and {"id", "question", "answer", "level"} <= set(hotpot.columns)


def test_cli_lists_and_shows_datasets(stdlib_corpus):
    def daskllm(*args):
        return daskllm_command("datasets", *args)

    listing = daskllm("list")
    assert listing.exit_code == 0 and "stdlib-modules" in listing.stdout and "hotpotqa" in listing.stdout
    shown = daskllm("show", "stdlib-howto", "-n", "2")
    assert shown.exit_code == 0
    assert "How do I read a JSON file into a dict?" in shown.stdout and "argparse" in shown.stdout
    assert "SHA-256" not in shown.stdout
    bad = daskllm("show", "squad")
    assert bad.exit_code == 1 and "unknown dataset 'squad'" in bad.stderr and bad.exception is not None
    assert isinstance(bad.exception, SystemExit)  # a ClickException: a message, no traceback

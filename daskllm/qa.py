"""Question sets: the real ones in the shared data dir, and ones generated from the corpus.

The real sets (``../shared/data/`` next to the repository; see its README) come
from the public LLMCompiler repository and are never copied into this one. The
caller passes their directory, so nothing here depends on where they live;
``default_data_dir`` finds the usual place, and returns None when the files are
absent, so code that uses them can skip or fall back to ``stdlib_questions``,
which needs no files at all.

=========== ===================================== ===== ===========================
name        file                                  rows  extra columns
=========== ===================================== ===== ===========================
hotpotqa    hotpotqa_comparison.json              1487  level (easy/medium/hard)
parallelqa  parallelqa_dataset.json               113   branch (number of sub-questions)
movies      movie_recommendations_formatted.json  500
=========== ===================================== ===== ===========================

Every set loads into a DataFrame with ``id``, ``question`` and ``answer`` string
columns (``pd.ArrowDtype(pa.string())``), plus its extra columns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random

_DATA_DIR_ENV = "DASKLLM_DATA_DIR"


@dataclasses.dataclass(frozen=True)
class QuestionSet:
    name: str
    file_name: str
    rows: int  # as documented in the data README; the loader does not enforce it
    extra_fields: tuple[tuple[str, type], ...] = ()

    @property
    def stem(self) -> str:
        return pathlib.PurePath(self.file_name).stem


QUESTION_SETS: dict[str, QuestionSet] = {
    qs.name: qs
    for qs in (
        QuestionSet("hotpotqa", "hotpotqa_comparison.json", 1487, (("level", str),)),
        QuestionSet("parallelqa", "parallelqa_dataset.json", 113, (("branch", int),)),
        QuestionSet("movies", "movie_recommendations_formatted.json", 500),
    )
}


def _question_set(name: str) -> QuestionSet:
    for qs in QUESTION_SETS.values():
        if name in (qs.name, qs.stem, qs.file_name):
            return qs
    known = ", ".join(f"{qs.name} ({qs.stem})" for qs in QUESTION_SETS.values())
    raise ValueError(f"unknown question set {name!r}; known sets: {known}")


def default_data_dir() -> pathlib.Path | None:
    """$DASKLLM_DATA_DIR if set, else ``<repo root>/../shared/data`` if it exists, else None."""
    from_env = os.environ.get(_DATA_DIR_ENV)
    if from_env:
        return pathlib.Path(from_env).expanduser()
    repo_root = pathlib.Path(__file__).resolve().parent.parent
    shared = repo_root.parent / "shared" / "data"
    return shared if shared.is_dir() else None


def _check_row(path: pathlib.Path, index: int, row, qs: QuestionSet) -> dict:
    def bad(field: str, problem: str) -> ValueError:
        return ValueError(f"{path}: row {index}: field {field!r} {problem}")

    if not isinstance(row, dict):
        raise ValueError(  # noqa: TRY004  (a malformed file is a ValueError, like bad JSON)
            f"{path}: row {index}: expected a JSON object, got {type(row).__name__}"
        )
    record = {}
    row_id = row.get("id")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or row_id == "":
        raise bad("id", f"must be a non-empty string or an integer, got {row_id!r}")
    record["id"] = str(row_id)
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise bad("question", f"must be a non-empty string, got {question!r}")
    record["question"] = question
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise bad("answer", f"must be a string or a number, got {answer!r}")
    record["answer"] = str(answer)
    for field, expected in qs.extra_fields:
        value = row.get(field)
        if isinstance(value, bool) or not isinstance(value, expected):
            raise bad(
                field, f"must be {'an integer' if expected is int else 'a string'}, got {value!r}"
            )
        record[field] = value
    return record


def load_questions(name: str, data_dir: str | os.PathLike):
    """One real question set from ``data_dir`` as a pandas DataFrame (see the module doc).

    ``name`` is the set's short name (hotpotqa, parallelqa, movies) or its file stem.
    Raises FileNotFoundError when the file is missing, ValueError (naming the row
    and field) when it is malformed.
    """
    import pandas as pd
    import pyarrow as pa

    qs = _question_set(name)
    path = pathlib.Path(data_dir).expanduser() / qs.file_name
    if not path.is_file():
        raise FileNotFoundError(
            f"question set {qs.name!r} not found: no file {str(path)!r} "
            f"(see ../shared/data/README.md; set ${_DATA_DIR_ENV} to its directory)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, list):
        raise ValueError(  # noqa: TRY004
            f"{path}: expected a JSON array of rows, got {type(data).__name__}"
        )
    records = [_check_row(path, index, row, qs) for index, row in enumerate(data)]
    seen: dict[str, int] = {}
    for index, record in enumerate(records):
        first = seen.setdefault(record["id"], index)
        if first != index:
            raise ValueError(
                f"{path}: row {index}: field 'id' repeats row {first}'s id {record['id']!r}"
            )
    columns = ["id", "question", "answer"] + [field for field, _ in qs.extra_fields]
    string = pd.ArrowDtype(pa.string())
    frame = pd.DataFrame(
        {
            column: pd.Series([record[column] for record in records], dtype=string)
            for column in ("id", "question", "answer")
        }
    )
    for field, expected in qs.extra_fields:
        values = [record[field] for record in records]
        frame[field] = pd.Series(values, dtype="int64" if expected is int else string)
    return frame[columns]


_KIND_NOUNS = {
    "module": "module",
    "class": "class",
    "exception": "exception",
    "function": "function",
    "method": "method",
    "classmethod": "class method",
    "staticmethod": "static method",
    "property": "attribute",
}
_MIN_QUERY_WORDS = 4


def stdlib_questions(n: int, seed: int = 0):
    """``n`` questions generated from the stdlib documentation table, for retrieval tests.

    Each asks which object does what its docstring's first sentence says; the answer
    is that row's ``qualname`` and ``id`` is that row's id, so a retriever over the
    corpus should rank that row first. Only first sentences that occur once in the
    corpus and have at least a few words are used, so every question has one answer.
    Columns: id (int64), question, answer, kind. Deterministic for a seed and Python.
    """
    import pandas as pd
    import pyarrow as pa

    from daskllm.corpus import stdlib_docs

    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    docs = stdlib_docs()
    sentences = docs["first_sentence"].astype(object)
    unique = ~sentences.duplicated(keep=False)
    informative = sentences.str.split().str.len() >= _MIN_QUERY_WORDS
    eligible = docs[unique & informative]
    if n > len(eligible):
        raise ValueError(f"n={n} is more than the {len(eligible)} questions the corpus can give")
    picks = random.Random(seed).sample(range(len(eligible)), n)
    chosen = eligible.iloc[picks]
    questions = [
        f"Which standard-library {_KIND_NOUNS[kind]} does the following: {sentence}"
        for kind, sentence in zip(chosen["kind"], chosen["first_sentence"])
    ]
    string = pd.ArrowDtype(pa.string())
    return pd.DataFrame(
        {
            "id": chosen["id"].to_numpy(dtype="int64"),
            "question": pd.Series(questions, dtype=string),
            "answer": pd.Series(list(chosen["qualname"]), dtype=string),
            "kind": pd.Series(list(chosen["kind"]), dtype=string),
        }
    )

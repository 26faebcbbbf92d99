"""Datasets: one loader for the standard-library corpus and every question set daskllm uses.

``load(name, ...)`` returns a pandas DataFrame; ``catalog()`` lists what there is (and whether
it is available here). The catalogue with each set's recipe is ``datasets/README.md``.

============== ========= ==================================================================
name           kind      what
============== ========= ==================================================================
stdlib-docs    corpus    the running Python's standard-library documentation, one row per
                         public object (``daskllm.corpus``; built once, cached)
stdlib-howto   questions 16 hand-written developer questions ("How do I read a JSON file
                         into a dict?"); answer: the module that does the job
stdlib-modules generated "Which Python standard-library module has a function that does
                         the following: <docstring sentence>"; answer: the module
stdlib-objects generated "Which standard-library function does the following: <sentence>";
                         answer: the object's qualified name (a retrieval target)
hotpotqa       questions 1,487 comparison questions (``level``) from ``../shared/data``
parallelqa     questions 113 multi-part questions (``branch``) from ``../shared/data``
movies         questions 500 movie recommendation questions from ``../shared/data``
============== ========= ==================================================================

The real sets (``../shared/data/`` next to the repository; see its README) come from the
public LLMCompiler repository and are never copied into this one: ``load`` reads them from
``data_dir``, else ``$DASKLLM_DATA_DIR``, else ``../shared/data`` beside the checkout, and
raises FileNotFoundError naming where it looked when they are absent. Every question set has
``id``, ``question`` and ``answer`` string columns (``pd.ArrowDtype(pa.string())``; the
generated ones have an int64 ``id``, the corpus row's), plus its extra columns.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import random
import re
import sys

from daskllm.corpus import stdlib_docs

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


def load_questions(name: str, data_dir: str | os.PathLike | None = None):
    """One real question set from ``data_dir`` (default: :func:`default_data_dir`) as a pandas
    DataFrame (see the module doc).

    ``name`` is the set's short name (hotpotqa, parallelqa, movies) or its file stem.
    Raises FileNotFoundError when the file is missing, ValueError (naming the row
    and field) when it is malformed.
    """
    import pandas as pd
    import pyarrow as pa

    qs = _question_set(name)
    if data_dir is None:
        data_dir = default_data_dir()
        if data_dir is None:
            raise FileNotFoundError(
                f"question set {qs.name!r} not found: no ../shared/data beside the checkout and "
                f"${_DATA_DIR_ENV} is not set (see datasets/README.md)"
            )
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


def _check_count(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")


def _informative_rows(docs):
    """Rows whose first sentence occurs once in the corpus and has a few words: one answer each."""
    sentences = docs["first_sentence"].astype(object)
    unique = ~sentences.duplicated(keep=False)
    informative = sentences.str.split().str.len() >= _MIN_QUERY_WORDS
    return docs[unique & informative]


def _sample(rows, n: int, seed: int, what: str):
    _check_count(n)
    if n > len(rows):
        raise ValueError(f"n={n} is more than the {len(rows)} {what} the corpus can give")
    return rows.iloc[random.Random(seed).sample(range(len(rows)), n)]


def _generated_frame(rows, questions: list[str], **columns):
    """A generated set: the corpus rows' int64 ids, the questions, then string ``columns``."""
    import pandas as pd
    import pyarrow as pa

    string = pd.ArrowDtype(pa.string())
    frame = {"id": rows["id"].to_numpy(dtype="int64"), "question": pd.Series(questions, dtype=string)}
    return pd.DataFrame({**frame, **{name: pd.Series(list(values), dtype=string) for name, values in columns.items()}})


def stdlib_questions(n: int, seed: int = 0):
    """``n`` questions generated from the stdlib documentation table, for retrieval tests.

    Each asks which object does what its docstring's first sentence says; the answer
    is that row's ``qualname`` and ``id`` is that row's id, so a retriever over the
    corpus should rank that row first. Only first sentences that occur once in the
    corpus and have at least a few words are used, so every question has one answer.
    Columns: id (int64), question, answer, kind. Deterministic for a seed and Python.
    """
    _check_count(n)
    chosen = _sample(_informative_rows(stdlib_docs()), n, seed, "questions")
    questions = [
        f"Which standard-library {_KIND_NOUNS[kind]} does the following: {sentence}"
        for kind, sentence in zip(chosen["kind"], chosen["first_sentence"])
    ]
    return _generated_frame(chosen, questions, answer=chosen["qualname"], kind=chosen["kind"])


# Modules users import under another name (os.path) or never import themselves.
_NOT_IMPORTED_AS_SUCH = frozenset({"genericpath", "ntpath", "posixpath", "nturl2path", "opcode"})
_MODULE_QUESTION_KINDS = ("function", "class", "exception")


def names_module(answer: str, module: str) -> bool:
    """Does ``answer`` name ``module`` as a word (``os`` is not named by ``posix`` or ``os.path``'s
    ``path``; ``os.path`` names ``os``)? Case-insensitive: the scorer of the module-answer sets."""
    return re.search(rf"(?<![\w.]){re.escape(module)}(?!\w)", answer, flags=re.IGNORECASE) is not None


def module_questions(n: int, seed: int = 0):
    """``n`` questions generated from the corpus whose answer is a module name.

    Each describes a module-level function, class or exception of a top-level public module by
    its docstring's first sentence and asks which module has it: "Which Python standard-library
    module has a function that does the following: Return the base name of pathname path."
    A sentence that names its own module is not used (it would give the answer away), nor one
    that occurs twice in the corpus. Columns: id (the corpus row, int64), question, answer (the
    module), qualname, kind. Score an answer with :func:`names_module`. Deterministic for a seed.
    """
    _check_count(n)
    rows = _informative_rows(stdlib_docs())
    module = rows["module"].astype(object)
    top_level = ~module.str.contains(".", regex=False) & ~module.str.startswith("_")
    own_object = rows["qualname"].astype(object) == module + "." + rows["qualname"].astype(object).str.rsplit(".", n=1).str[-1]
    eligible = rows[top_level & ~module.isin(_NOT_IMPORTED_AS_SUCH) & own_object
                    & rows["kind"].isin(_MODULE_QUESTION_KINDS)]
    eligible = eligible[[not names_module(sentence, name)
                         for sentence, name in zip(eligible["first_sentence"], eligible["module"])]]
    chosen = _sample(eligible, n, seed, "module questions")
    questions = [f"Which Python standard-library module has {'an' if kind == 'exception' else 'a'} {kind} that does "
                 f"the following: {sentence}" for kind, sentence in zip(chosen["kind"], chosen["first_sentence"])]
    return _generated_frame(chosen, questions, answer=chosen["module"], qualname=chosen["qualname"],
                            kind=chosen["kind"])


# Developer questions and the module that does the job (the demo's questions).
HOWTO = (
    ("How do I read a JSON file into a dict?", "json"),
    ("How do I parse command-line arguments?", "argparse"),
    ("How do I compute the SHA-256 hash of a file?", "hashlib"),
    ("How do I run a shell command and capture its output?", "subprocess"),
    ("How do I make a temporary directory that is removed afterwards?", "tempfile"),
    ("How do I copy a whole directory tree?", "shutil"),
    ("How do I parse a date string like 2024-05-01?", "datetime"),
    ("How do I count how often each word occurs in a list?", "collections"),
    ("How do I compress a file with gzip?", "gzip"),
    ("How do I read rows from a CSV file?", "csv"),
    ("How do I cache the results of an expensive function?", "functools"),
    ("How do I find all files matching *.txt in a folder?", "glob"),
    ("How do I generate a random password?", "secrets"),
    ("How do I split a shell command line into arguments?", "shlex"),
    ("How do I wrap long text to 70 columns?", "textwrap"),
    ("How do I merge several sorted lists into one sorted list?", "heapq"),
)


def howto_questions():
    """The hand-written developer questions (:data:`HOWTO`): id, question, answer (the module)."""
    import pandas as pd
    import pyarrow as pa

    string = pd.ArrowDtype(pa.string())
    return pd.DataFrame({"id": pd.Series([f"howto-{i}" for i in range(len(HOWTO))], dtype=string),
                         "question": pd.Series([q for q, _ in HOWTO], dtype=string),
                         "answer": pd.Series([m for _, m in HOWTO], dtype=string)})


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """One entry of :func:`catalog`."""

    name: str
    kind: str  # corpus, questions (fixed rows) or generated (n and seed pick the rows)
    description: str
    source: str
    location: str | None  # the file it reads, where there is one and it is here; else None
    available: bool


def catalog() -> list[DatasetInfo]:
    """Every dataset :func:`load` knows, and whether it can be loaded here."""
    data_dir = default_data_dir()
    python = f"the running Python {sys.version_info.major}.{sys.version_info.minor}'s standard library"
    entries = [
        DatasetInfo("stdlib-docs", "corpus", "documentation of every public standard-library object",
                    python, None, True),
        DatasetInfo("stdlib-howto", "questions", f"{len(HOWTO)} developer how-to questions; answer: a module",
                    "daskllm (hand-written)", None, True),
        DatasetInfo("stdlib-modules", "generated", "which module has the object a docstring sentence describes",
                    python, None, True),
        DatasetInfo("stdlib-objects", "generated", "which object a docstring sentence describes; answer: its name",
                    python, None, True),
    ]
    for qs in QUESTION_SETS.values():
        path = data_dir / qs.file_name if data_dir is not None else None
        here = path is not None and path.is_file()
        entries.append(DatasetInfo(qs.name, "questions", f"{qs.rows:,} questions ({qs.file_name})",
                                   "LLMCompiler (../shared/data)", str(path) if here else None, here))
    return entries


def load(name: str, n: int | None = None, *, seed: int = 0, data_dir: str | os.PathLike | None = None):
    """The dataset ``name`` (see :func:`catalog`) as a pandas DataFrame.

    ``n``: how many rows; required for the generated sets (which ``seed`` draws), optional
    for the others (their first ``n`` rows). ``data_dir``: where the shared question sets
    are (default :func:`default_data_dir`).
    """
    generated = {"stdlib-modules": module_questions, "stdlib-objects": stdlib_questions}
    if n is not None:
        _check_count(n)
    if name in generated:
        if n is None:
            raise ValueError(f"dataset {name!r} is generated: say how many questions (n=...)")
        return generated[name](n, seed=seed)
    if name == "stdlib-docs":
        return stdlib_docs(limit=n)
    if name == "stdlib-howto":
        frame = howto_questions()
    elif any(name in (qs.name, qs.stem, qs.file_name) for qs in QUESTION_SETS.values()):
        frame = load_questions(name, data_dir)
    else:
        known = ", ".join(info.name for info in catalog())
        raise ValueError(f"unknown dataset {name!r}; known: {known}")
    return frame if n is None else frame.head(n).reset_index(drop=True)

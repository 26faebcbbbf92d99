"""What each operator asks the model and how its answer is read: the operator record, the
instruction suffixes, answer constraints, output parsing and per-call token costs."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass

import pandas as pd
import pyarrow as pa

from daskllm.budget import Budget
from daskllm.engines import SamplingParams, StructuredOutput
from daskllm.models import resolve
from daskllm.dataframe.cells import render_cell
from daskllm.prompts import Text, parse_template, tokenizer_for

STRING = pd.ArrowDtype(pa.string())
KEY = "_daskllm_key"
# A table job's conditional call (an operator after a filter runs on the rows it keeps): the
# filter calls its row needs a yes from, as "number:hash of the prompt" joined by ";".
WHEN = "_daskllm_when"


class RowError(ValueError):
    """A row's LLM call failed; the message names the row's index."""


class BudgetExceeded(RowError):
    """A budget would be exceeded: the work was not started."""


# --- operators -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One LLM operator: what each distinct input becomes. Picklable: it travels to workers."""

    kind: str  # generate | filter | extract | embed | search
    model: str
    name: str  # for usage and errors: map, filter, extract, embed, search
    template: str | None = None
    sampling: SamplingParams | None = None
    fields: tuple = ()  # extract: (name, type name)
    index: object = None  # search: a detached ShardedIndex
    k: int = 5
    budget: Budget | None = None
    chat: bool = False  # the prompt goes to the model as a user message in its chat template



@functools.cache
def max_len(model: str) -> int:
    config = json.loads((resolve(model) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)



def prompt_ids(distinct: pd.DataFrame, op: Op) -> list[list[int]]:
    """Per input of an LLM operator: the prompt token ids the engine will see (the whole prompt
    string, tokenized as daskllm prompts are)."""
    tok = tokenizer_for(op.model)
    segments = parse_template(full_template(op))
    out = []
    for row in distinct.to_dict("records"):
        text = "".join(seg.text if isinstance(seg, Text) else render_cell(row[seg.name]) for seg in segments)
        if op.chat:
            text = tok.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
        out.append(tok.encode(text, not op.chat))
    return out


def costs(distinct: pd.DataFrame, op: Op, ids: list | None = None) -> list:
    """Per input: tokens to reserve (prompt + output), an error message, or None (no LLM).
    ``ids``: the inputs' prompt token ids, where already known (else they are rendered)."""
    if op.kind in ("embed", "search", "rerank"):
        return [None] * len(distinct)
    limit = max_len(op.model)
    out = []
    for ids in prompt_ids(distinct, op) if ids is None else ids:
        n = len(ids)
        if n + 1 > limit:
            out.append(f"prompt has {n} tokens; model {op.model!r} holds at most {limit} including one generated")
        else:
            out.append(n + op.sampling.max_tokens)
    return out



def full_template(op: Op) -> str:
    """The prompt template a call really uses: the user's, plus the operator's instruction."""
    # Field names are data (JSON keys), never template fields: a name like "{n}" is text.
    return op.template + SUFFIX.get(op.kind, "").format(fields=", ".join(literal(f) for f, _ in op.fields))


def literal(text: str) -> str:
    """``text`` as template text that stands for itself: its braces are escaped."""
    return text.replace("{", "{{").replace("}", "}}")


SUFFIX = {"filter": "\nAnswer yes or no:",
           "extract": "\nAnswer with one JSON object with the keys {fields}:\n",
           "rate": "\nRate this from 0 (not at all) to 9 (fully), one digit:"}


@functools.cache
def yes_no(model: str) -> tuple[int, ...]:
    """The tokens a filter's answer may start with: yes or no, nothing else."""
    return tokenizer_for(model).answer_tokens(("yes", "no"))


@functools.cache
def digits(model: str) -> tuple[int, ...]:
    """The tokens a rating may start with: the digits 0-9, nothing else."""
    return tokenizer_for(model).answer_tokens(tuple(str(d) for d in range(10)))


def parse(output, op: Op):
    constraint = op.sampling.structured if op.sampling is not None else None
    if op.kind == "generate" and constraint is not None:
        return parse_constrained(output, constraint, op.sampling.max_tokens)
    if op.kind == "filter":
        if isinstance(output, dict):  # asked with logprobs (a cascade's proxy): its P(yes)
            return yes_probability(output, op.model)
        return output.strip().lower().startswith("y")
    if op.kind == "rate":
        return int(output.strip()[:1])
    if op.kind == "extract":
        try:
            return extract_fields(output, op.fields)
        except ValueError:
            if constraint is not None:  # under the grammar only a cut output fails to parse
                raise ValueError(cut_message(output, op.sampling.max_tokens, "the JSON closed")) from None
            raise
    if op.kind == "search":
        return [{"id": int(h.id), "score": float(h.score), "text": h.text} for h in output]
    return output


def parse_constrained(output: str, constraint: StructuredOutput, max_tokens: int):
    """A constrained answer: a JSON schema's value (a dict), or the text of a choice or regex.
    The grammar makes a complete answer parse, so one that does not was cut by max_tokens."""
    if constraint.kind == "json_schema":
        try:
            return json.loads(output)
        except json.JSONDecodeError:
            raise ValueError(cut_message(output, max_tokens, "the JSON closed")) from None
    if constraint.kind == "choice" and output not in constraint.value:
        raise ValueError(cut_message(output, max_tokens, "it completed a choice"))
    return output


def cut_message(output: str, max_tokens: int, what: str) -> str:
    return f"output cut at max_tokens={max_tokens} before {what}: {output.strip()[:80]!r}"


def fields_schema(fields: tuple) -> dict:
    """The JSON schema of an extract's answer: one object with every field, of its type."""
    return {"type": "object", "properties": {name: {"type": JSON_TYPES[kind]} for name, kind in fields},
            "required": [name for name, _ in fields], "additionalProperties": False}


def constraint_options(constraint: StructuredOutput | None) -> dict:
    """A constraint as generate()'s keyword arguments (schema=, choices= or regex=)."""
    if constraint is None:
        return {}
    name = {"json_schema": "schema", "choice": "choices", "regex": "regex"}[constraint.kind]
    return {name: constraint.value}


def schema_dtype(schema: dict) -> pd.ArrowDtype:
    """A column's dtype for answers to ``schema``: the struct or list type the schema fixes
    (objects whose keys are all declared and closed become structs, arrays lists, ``$ref``,
    optional values and string enums resolved), so parquet stores named typed fields; for any
    other schema (an object open to other keys, a union of types, a lone scalar), the answers'
    JSON text. A text column of a schema's answers always holds JSON (see :func:`as_arrow`)."""
    arrow = _arrow_type(schema, schema.get("$defs") or schema.get("definitions") or {}, 0)
    nested = arrow is not None and (pa.types.is_struct(arrow) or pa.types.is_list(arrow))
    return pd.ArrowDtype(arrow) if nested else JSON_TEXT


JSON_TEXT = STRING


def _arrow_type(schema, defs: dict, depth: int) -> pa.DataType | None:
    if not isinstance(schema, dict) or depth > 32:
        return None
    if isinstance(ref := schema.get("$ref"), str):
        name = ref.rsplit("/", 1)[-1]
        return _arrow_type(defs.get(name), defs, depth + 1)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options is not None:  # Optional[X]: X, nullable (every Arrow field is)
        real = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
        return _arrow_type(real[0], defs, depth + 1) if len(real) == 1 else None
    kind = schema.get("type")
    if isinstance(kind, list):
        real = [k for k in kind if k != "null"]
        kind = real[0] if len(real) == 1 else None
    if "enum" in schema and kind is None:
        kind = "string" if all(isinstance(v, str) for v in schema["enum"]) else None
    if kind in ARROW_TYPES:
        return ARROW_TYPES[kind]
    if kind == "array":
        item = _arrow_type(schema.get("items"), defs, depth + 1)
        return pa.list_(item) if item is not None else None
    if kind == "object":
        properties = schema.get("properties")
        if not properties or schema.get("additionalProperties") is not False:  # other keys: no fixed fields
            return None
        fields = [(name, _arrow_type(p, defs, depth + 1)) for name, p in properties.items()]
        return pa.struct(fields) if all(t is not None for _, t in fields) else None
    return None


def as_arrow(values: pd.Series, dtype: pd.ArrowDtype) -> pd.Series:
    """Parsed answers (dicts, lists, None for a failed row) as a column of ``dtype``: the
    struct or list type their schema fixes, or (``JSON_TEXT``) their JSON text (pandas has no
    astype from objects to either)."""
    objects = values.tolist()
    if pa.types.is_string(dtype.pyarrow_dtype):
        objects = [None if v is None else json.dumps(v) for v in objects]
    return pd.Series(pd.arrays.ArrowExtensionArray(pa.array(objects, type=dtype.pyarrow_dtype)),
                     index=values.index, name=values.name)


def yes_probability(output: dict, model: str) -> float:
    """P(yes) of a constrained one-token answer: the mass of the tokens that start "yes" among
    the allowed ones (its record holds every allowed token's logprob)."""
    yes = tokenizer_for(model).answer_starts("yes")
    return min(1.0, sum(math.exp(lp) for t, lp in output["top_logprobs"][0].items() if t in yes))


def extract_fields(text: str, fields: tuple) -> dict:
    snippet = text.strip()[:80]
    starts = [m.start() for m in re.finditer(r"\{", text)]
    if not starts:
        raise ValueError(f"output has no JSON object: {snippet!r}")
    # The first complete object: a key or value may hold braces ('{"{n}": 1}'), so the object
    # ends where JSON says, not at the first "}".
    first_error, obj = None, None
    for start in starts:
        try:
            obj, _ = _JSON.raw_decode(text, start)
        except json.JSONDecodeError as exc:
            first_error = first_error or exc
            continue
        if isinstance(obj, dict):
            break
        obj = None
    if obj is None:
        raise ValueError(f"output does not parse as JSON ({first_error}): {snippet!r}")
    out = {}
    for name, kind in fields:
        if name not in obj:
            raise ValueError(f"output has no field {name!r}: {snippet!r}")
        try:
            out[name] = CASTS[kind](obj[name])
        except (TypeError, ValueError):
            raise ValueError(f"field {name!r} is not {kind}: {obj[name]!r}") from None
    return out


_JSON = json.JSONDecoder()
CASTS = {"str": str, "int": int, "float": float, "bool": bool}
JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
ARROW_TYPES = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}

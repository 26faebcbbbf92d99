"""Prompts whose structure stays visible: static text segments and slots filled by other nodes.

``prompt("You are terse.\\nQ: {question}\\nA:", question=node)`` keeps the static text apart
from the slot, so the rewrite passes can see which prefix is known before its inputs are
(Helium's templated prompts), and prefill it early (Teola's partial prefill).

A prompt's token ids are what the model's tokenizer gives for the whole rendered string
(``tokenizer(text).input_ids``; for a chat, ``apply_chat_template(..., tokenize=True)``), so
daskllm, transformers and vLLM see the same ids for the same text. Parts given as token ids
(:func:`tokens`) are kept as they are, and the text between them is tokenized whole. Shared
prefixes are found on those whole-string ids (the longest common token prefix); a prompt
still waiting for an upstream output knows only the ids of its leading text that no
continuation can change (:meth:`PromptTokenizer.stable_prefix`).
"""

from __future__ import annotations

import functools
import hashlib
import string
import threading
from dataclasses import dataclass
from typing import Any

from daskllm.models import resolve

SENTINEL = "\x00daskllm-slot-{}\x00"


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class Slot:
    name: str


@dataclass(frozen=True, slots=True)
class Tokens:
    """Token ids made by ``model``'s tokenizer: only meaningful to models sharing it."""

    ids: tuple[int, ...]
    model: str


Segment = Text | Slot | Tokens


def tokens(ids, model: str) -> Prompt:
    """A prompt part given as token ids (from ``model``'s tokenizer)."""
    ids = tuple(ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError("tokens() takes non-negative int token ids")
    return Prompt((Tokens(ids, model),), {})


@functools.cache
def tokenizer_fingerprint(model: str) -> str:
    """Two models can share token ids only if this matches."""
    path = resolve(model)
    files = [path / n for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt") if (path / n).exists()]
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest() if files else str(path)


@dataclass(frozen=True)
class Prompt:
    """Static text and named slots; ``values`` fill the slots (str, list batch, node or delayed)."""

    segments: tuple[Segment, ...]
    values: dict[str, Any]
    chat: tuple[tuple[str, Any], ...] | None = None  # (role, content) messages, rendered with the model's template

    def slots(self) -> list[str]:
        return [s.name for s in self.segments if isinstance(s, Slot)]


def parse_template(template: str) -> list[Segment]:
    segments: list[Segment] = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        if literal:
            segments.append(Text(literal))
        if field is not None:
            if not field.isidentifier() or spec or conversion:
                raise ValueError(f"template field {{{field}}} must be a plain name like {{question}}")
            segments.append(Slot(field))
    return segments


def prompt(*parts, **values) -> Prompt:
    """Build a prompt from parts: template strings with ``{name}`` fields, nodes, delayed values.

    ``prompt("Q: {q}\\nA:", q=questions)`` or ``prompt("Context:\\n", search_node, "\\nQ: ", q)``.
    A field with no value is an error naming it.
    """
    segments: list[Segment] = []
    values = dict(values)
    for i, part in enumerate(parts):
        if isinstance(part, Prompt):
            if part.chat is not None:
                raise ValueError("a chat prompt cannot be nested inside another prompt")
            segments.extend(part.segments)
            clash = set(part.values) & set(values)
            if clash:
                raise ValueError(f"prompt parts both fill the fields {sorted(clash)}")
            values.update(part.values)
        elif isinstance(part, str):
            segments.extend(parse_template(part))
        else:
            name = f"_part{i}"
            segments.append(Slot(name))
            values[name] = part
    return _checked(Prompt(tuple(_merge_text(segments)), values))


def chat(messages: list[dict], **values) -> Prompt:
    """Chat messages (``{"role": ..., "content": str | Prompt}``), rendered with the model's chat template."""
    rendered: list[tuple[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
        content = message["content"]
        if isinstance(content, str):  # a template: its fields are filled from ``values``
            content = Prompt(tuple(_merge_text(parse_template(content))), {})
        elif not isinstance(content, Prompt):
            content = prompt(content)
        if any(isinstance(seg, Tokens) for seg in content.segments):
            raise ValueError(f"message {i}: token ids cannot go inside a chat message (the chat template renders "
                             f"text); give its text, or build the whole prompt from token ids with tokens()")
        clash = set(content.values) & set(values)
        if clash:
            raise ValueError(f"message {i} fills fields {sorted(clash)} given elsewhere too")
        values.update(content.values)
        rendered.append((message["role"], content.segments))
    segments = [s for _, segs in rendered for s in segs]
    return _checked(Prompt(tuple(segments), values, chat=tuple(rendered)))


def _merge_text(segments: list[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for s in segments:
        if isinstance(s, Text) and out and type(out[-1]) is Text:
            out[-1] = Text(out[-1].text + s.text)
        elif not (isinstance(s, Text) and not s.text):
            out.append(s)
    return out


def _checked(p: Prompt) -> Prompt:
    missing = [name for name in p.slots() if name not in p.values]
    if missing:
        raise ValueError(f"prompt field {{{missing[0]}}} has no value; fields given: {sorted(p.values) or 'none'}")
    return p


def as_prompt(value) -> Prompt:
    """A prompt from what ``generate`` was given: a str is literal text (templates need ``prompt``)."""
    if isinstance(value, Prompt):
        return value
    if isinstance(value, str):
        return Prompt((Text(value),), {})
    return prompt(value)


def render_chat(p: Prompt, tokenizer) -> tuple[Segment, ...]:
    """Apply the model's chat template, keeping slots as slots."""
    if p.chat is None:
        return p.segments
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model has no chat template; use a plain prompt")
    names: list[str] = []
    messages = []
    for role, segments in p.chat:
        text = ""
        for s in segments:
            if isinstance(s, Text):
                text += s.text
            else:
                text += SENTINEL.format(len(names))
                names.append(s.name)
        messages.append({"role": role, "content": text})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    segments: list[Segment] = []
    rest = rendered
    for i, name in enumerate(names):
        before, _, rest = rest.partition(SENTINEL.format(i))
        segments += [Text(before), Slot(name)]
    segments.append(Text(rest))
    return tuple(_merge_text(segments))


# What may follow a prompt's known leading text: a letter, a space, a digit, punctuation,
# a line break. The ids that every one of these leaves in place stay whatever really follows
# (byte-level BPE merges only within a pre-token, and whitespace splits on what comes next).
_CONTINUATIONS = ("a", " a", "A", " A", "1", " 1", ".", ",", "\n", " ", "\t", "'", '"', "é")


class InvalidText(ValueError):
    """Text no tokenizer can take: it is not valid Unicode (e.g. a lone surrogate, ``"\\ud800"``)."""


def check_text(text: str) -> str:
    """``text`` if it can be encoded (as UTF-8, as tokenizers need); else an :class:`InvalidText`
    naming the bad character and where it is (a tokenizer's own error says neither)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidText(f"text is not valid Unicode: {text[exc.start:exc.end]!r} at position {exc.start} "
                          f"({exc.reason})") from None
    return text


def encode_parts(parts, special: bool, tokenize) -> tuple[int, ...]:
    """A prompt's ids from its parts: text (str) runs tokenized whole, token-id tuples as they are.

    ``tokenize(text, special)`` is the model's tokenizer; ``special`` adds its special tokens
    (e.g. BOS) as ``tokenizer(text)`` does, which a chat template's rendered text already has.
    Text that cannot be encoded is an :class:`InvalidText`.
    """
    if all(isinstance(p, str) for p in parts):
        return tuple(tokenize(check_text("".join(parts)), special))
    ids = list(tokenize("", True)) if special else []
    run: list[str] = []
    for part in parts:
        if isinstance(part, str):
            run.append(part)
            continue
        if run:
            ids += tokenize(check_text("".join(run)), False)
            run = []
        ids += part
    if run:
        ids += tokenize(check_text("".join(run)), False)
    return tuple(ids)


class PromptTokenizer:
    """Whole-string tokenization with a model's tokenizer (client side and worker side alike)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.prefix_ids = tuple(self._encode("", True))  # e.g. BOS
        self.model_id = getattr(tokenizer, "name_or_path", "")

    def _encode(self, text: str, special: bool) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=special).ids
        return self.tokenizer.encode(text, add_special_tokens=special)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one tokenizer per model, kept for the process
    def encode(self, text: str, special: bool = False) -> tuple[int, ...]:
        """``text``'s ids; with ``special``, exactly ``tokenizer(text).input_ids``."""
        return tuple(self._encode(text, special))

    def encode_parts(self, parts, special: bool) -> tuple[int, ...]:
        return encode_parts(parts, special, self.encode)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None

    def answer_starts(self, word: str) -> frozenset[int]:
        """The first tokens of an answer spelling ``word``: with or without a leading space (a
        completion continues a line, a chat answer starts afresh), lower case or capitalized."""
        variants = {word, word.lower(), word.capitalize()}
        return frozenset(ids[0] for v in variants for ids in (self.encode(v), self.encode(" " + v)) if ids)

    def answer_tokens(self, words) -> tuple[int, ...]:
        """The tokens a constrained answer naming one of ``words`` may start with (for
        ``allowed_token_ids``); an error if two words share one, as they could not be told apart."""
        starts = [self.answer_starts(w) for w in words]
        if any(a & b for i, a in enumerate(starts) for b in starts[i + 1:]):
            raise ValueError(f"the answers {list(words)} do not start with distinct tokens of {self.model_id!r}")
        return tuple(sorted(frozenset().union(*starts)))

    @functools.lru_cache(maxsize=16384)  # noqa: B019 - see encode
    def stable_prefix(self, parts: tuple, special: bool) -> tuple[int, ...]:
        """The ids that begin every prompt starting with ``parts``, whatever text follows."""
        known = self.encode_parts(parts, special)
        for continuation in _CONTINUATIONS:
            longer = self.encode_parts((*parts, continuation), special)
            same = next((i for i, (a, b) in enumerate(zip(known, longer)) if a != b), min(len(known), len(longer)))
            known = known[:same]
        return known


def tokenizer_for(model: str) -> PromptTokenizer:
    with _tokenizer_lock:  # transformers' lazy imports race when first used from several threads
        return _tokenizer_for(model)


@functools.cache
def _tokenizer_for(model: str) -> PromptTokenizer:
    from transformers import AutoTokenizer  # heavy: loaded with the first tokenizer, not with daskllm

    return PromptTokenizer(AutoTokenizer.from_pretrained(resolve(model)))


_tokenizer_lock = threading.RLock()

# Every name daskllm takes from transformers' lazy module. Resolving one for the first time is
# not thread-safe (two threads can see a half-imported submodule: "cannot import name ...").
_TRANSFORMERS_NAMES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                       "AutoTokenizer", "GenerationConfig", "LlamaConfig", "LlamaForCausalLM",
                       "PreTrainedTokenizerFast")


def import_transformers() -> None:
    """Resolve transformers' lazy names once, in one thread, before a worker's engine loading
    and its tasks use them from several."""
    with _tokenizer_lock:
        import transformers
        import transformers.modeling_rope_utils  # noqa: F401
        import transformers.utils.logging  # noqa: F401

        for name in _TRANSFORMERS_NAMES:
            getattr(transformers, name)


def render_value(value) -> str:
    """How an upstream output fills a slot: text as is, lists one item per line, hits by their text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "\n".join(render_value(v) for v in value)
    text = getattr(value, "text", None)
    if isinstance(text, str):
        return text
    return str(value)

"""How a generation's text becomes items: splitters and the emitter that checks them.

A split generation (``generate(..., split="lines")``) is a *stream*: its value is the list
of items its text splits into. A splitter finds the complete items in a growing text; items
must be stable (once returned, an item stays the same as more text arrives).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from dask.base import tokenize

class Splitter:
    """Complete items in ``text``; ``final`` when the generation has ended.

    Items must be stable: once returned, an item stays the same as more text arrives.
    """

    fingerprint: str

    def items(self, text: str, final: bool) -> list:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<splitter {self.fingerprint}>"


class Delimited(Splitter):
    """Items separated by ``sep``, stripped; empty ones dropped."""

    def __init__(self, sep: str):
        if not isinstance(sep, str) or not sep:
            raise ValueError(f"a delimiter must be a non-empty str, got {sep!r}")
        self.sep = sep
        self.fingerprint = "lines" if sep == "\n" else f"delimited:{sep!r}"

    def items(self, text: str, final: bool) -> list[str]:
        pieces = text.split(self.sep)
        if not final:
            pieces = pieces[:-1]  # the last piece may still grow
        return [p.strip() for p in pieces if p.strip()]


class WordGroups(Splitter):
    """Every ``n`` complete words are an item (the remaining words, at the end, are the last).

    Useful where a model's output has no reliable delimiter (small or random-weight models)
    and a stream still needs items of a known size.
    """

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"words(n): n must be a positive int, got {n!r}")
        self.n = n
        self.fingerprint = f"words:{n}"

    def items(self, text: str, final: bool) -> list[str]:
        # A word is complete once whitespace follows it (or the generation ended).
        found = text.split() if final else re.findall(r"\S+(?=\s)", text)
        groups = [" ".join(found[i:i + self.n]) for i in range(0, len(found), self.n)]
        return groups if final else groups[:len(found) // self.n]


class JSONArray(Splitter):
    """Elements of a JSON array, each as soon as the comma or bracket after it arrives."""

    fingerprint = "json"

    def items(self, text: str, final: bool) -> list:
        start = text.find("[")
        if start < 0:
            if final:
                raise ValueError(f"output is not a JSON array: {text[:80]!r}")
            return []
        out, depth, in_string, escaped, begin = [], 0, False, False, start + 1
        for i in range(start, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "[{":
                depth += 1
            elif c in "]}":
                depth -= 1
                if depth == 0:  # the array closed
                    self._add(out, text[begin:i], last=True)
                    return out
            elif c == "," and depth == 1:
                self._add(out, text[begin:i], last=False)
                begin = i + 1
        if final:
            raise ValueError(f"output ends inside a JSON array after {len(out)} elements: ...{text[-80:]!r}")
        return out

    @staticmethod
    def _add(out: list, piece: str, last: bool) -> None:
        if last and not piece.strip():
            return  # "[]" or a trailing comma
        try:
            out.append(json.loads(piece))
        except json.JSONDecodeError as exc:
            raise ValueError(f"JSON array element {len(out)} does not parse: {piece.strip()[:80]!r} ({exc})") from None


class Parsed(Splitter):
    """A user parser: ``fn(text, final) -> list`` of the complete items in ``text``."""

    def __init__(self, fn: Callable[[str, bool], list]):
        self.fn = fn
        self.fingerprint = f"parser:{tokenize(fn)}"

    def items(self, text: str, final: bool) -> list:
        return list(self.fn(text, final))


def splitter(spec) -> Splitter:
    """``"lines"``, ``"json"``, a :class:`Splitter` (e.g. :func:`delimited`) or ``fn(text, final)``."""
    if isinstance(spec, Splitter):
        return spec
    if spec == "lines":
        return Delimited("\n")
    if spec == "json":
        return JSONArray()
    if callable(spec):
        return Parsed(spec)
    raise ValueError(f"split must be 'lines', 'json', daskllm.delimited(sep) or a parser fn(text, final) -> list, "
                     f"got {spec!r}")


def delimited(sep: str) -> Splitter:
    """Split a generation into the pieces between ``sep`` (e.g. ``";"``)."""
    return Delimited(sep)


def words(n: int) -> Splitter:
    """Split a generation into groups of ``n`` words."""
    return WordGroups(n)


class ItemEmitter:
    """Turns a growing text into new items, checking that items already sent never change."""

    def __init__(self, split: Splitter, send: Callable[[int, Any], None]):
        self.split, self.send, self.sent = split, send, []

    def update(self, text: str, final: bool = False) -> list:
        items = self.split.items(text, final)
        if items[:len(self.sent)] != self.sent:
            changed = next(i for i, (a, b) in enumerate(zip(self.sent, items + [None] * len(self.sent))) if a != b)
            raise ValueError(f"the splitter changed item {changed} after sending it: {self.sent[changed]!r} -> "
                             f"{(items + [None] * len(self.sent))[changed]!r}; a splitter must only add items")
        for i in range(len(self.sent), len(items)):
            self.send(i, items[i])
        self.sent = items
        return items

"""The LLM IR: immutable nodes with a structural hash.

A :class:`Node` is one operator (a task type of :mod:`daskllm.ops`) applied to one
input (a scalar node) or to a batch of inputs from one template (a batched node of
``width`` items; inputs line up item by item, scalars broadcast). Nodes form a networkx
DiGraph; the rewrite passes work on it and :mod:`daskllm.plan.lower` turns it into a Dask
graph. Nodes are immutable, and each has a structural hash over its operator, parameters,
template and inputs: the same work built twice is the same node (and the same Dask key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import uuid
from array import array
from dataclasses import dataclass
from typing import Any

from dask.base import tokenize

_counter = itertools.count()


def stable_hash(*parts) -> str:
    """A hash that is the same in every process (unlike ``hash`` of a str)."""
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(_encode(part))
        h.update(b"\x1f")
    return h.hexdigest()


def _encode(value) -> bytes:
    kind = type(value)
    if kind is str:
        return b"s" + value.encode("utf-8", "surrogatepass")  # any str hashes; invalid text fails as a call
    if kind is tuple or kind is list:
        # Token ids, the common case, are encoded in one go. array("q") takes exactly what has
        # __index__, so a sequence that begins otherwise (a prompt's text parts) skips the
        # attempt: a raised TypeError costs more than the encoding.
        if not value or hasattr(type(value[0]), "__index__"):
            try:
                return b"i" + array("q", value).tobytes()
            except (TypeError, OverflowError):
                pass
        return b"(" + b",".join([_encode(v) for v in value]) + b")"
    if isinstance(value, bytes):
        return b"b" + value
    if isinstance(value, (int, float, bool)) or value is None:
        return b"r" + repr(value).encode()
    if isinstance(value, dict):
        return b"{" + b",".join(_encode(k) + b":" + _encode(v) for k, v in sorted(value.items())) + b"}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return b"d" + type(value).__name__.encode() + _encode(dataclasses.astuple(value))
    if hasattr(value, "tobytes"):
        return b"a" + str(getattr(value, "shape", "")).encode() + value.tobytes()
    return b"t" + str(tokenize(value)).encode()


class Node:
    """One operator over one input or a batch of inputs.

    What users hold is a :class:`~daskllm.runtime.collection.LazyNode`: this node, and a Dask
    collection (computing it plans, lowers and submits); the planner sees only this class.
    """

    __slots__ = ("op", "inputs", "params", "template", "chat", "width", "value", "label", "hash")

    def __init__(self, op: str, *, inputs: dict[str, Node] | None = None, params: dict | None = None,
                 template: tuple | None = None, chat: tuple | None = None, width: int | None = None,
                 value: Any = None, identity: Any = None, nonce: bool = False):
        self.op = op
        self.inputs = dict(inputs or {})
        self.params = dict(params or {})
        self.template = template
        self.chat = chat
        self.width = width
        self.value = value  # what a value node holds (const, delayed, persisted) or a pmap's spec
        self.label = f"{op}-{next(_counter)}"
        self.hash = stable_hash(op, self.params_for_hash(), _template_key(template), _template_key_chat(chat), width,
                                sorted((k, v.hash) for k, v in self.inputs.items()), identity,
                                uuid.uuid4().hex if nonce else "")

    def params_for_hash(self) -> dict:
        return {k: getattr(v, "fingerprint", v) for k, v in self.params.items()}

    @property
    def key(self) -> str:
        return f"{self.op}-{self.hash}"

    @property
    def batched(self) -> bool:
        return self.width is not None

    @property
    def n(self) -> int:
        return 1 if self.width is None else self.width

    def __repr__(self) -> str:
        shape = f"batch of {self.width}" if self.batched else "scalar"
        model = self.params.get("model") or self.params.get("index_name") or ""
        return f"<daskllm.{self.op} {shape}{' ' + str(model) if model else ''} key={self.key[:24]}>"

    def __len__(self) -> int:
        if not self.batched:
            raise TypeError(f"{self.label} is a single call, not a batch")
        return self.width

    def __reduce__(self):
        raise TypeError("daskllm nodes are lazy; pass them to daskllm builders or dask.delayed functions, "
                        "or compute them first")


def _template_key(template):
    if template is None:
        return None
    return tuple((type(s).__name__, getattr(s, "text", None) or getattr(s, "name", None) or getattr(s, "ids", None),
                  getattr(s, "model", None)) for s in template)


def _template_key_chat(chat):
    if chat is None:
        return None
    return tuple((role, _template_key(segments)) for role, segments in chat)


@dataclass(frozen=True, slots=True)
class Dyn:
    """Item ``index`` of an upstream node's output (0 for a scalar node): a call's input not
    known before running."""

    node: Node
    index: int


def item_of(node: Node, i: int) -> int:
    """The item of ``node`` that call ``i`` of a consumer reads (scalars broadcast)."""
    return i if node.batched else 0

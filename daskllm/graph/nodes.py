"""The LLM IR: typed nodes that are also Dask collections.

A :class:`Node` is one operator (generate, prefill, embed, search, rerank) applied to one
input (a scalar node) or to a batch of inputs from one template (a batched node of
``width`` items; inputs line up item by item, scalars broadcast). Nodes form a networkx
DiGraph; the rewrite passes work on it and :mod:`daskllm.graph.lower` turns it into a Dask
graph. Nodes are immutable, and each has a structural hash over its operator, parameters,
template and inputs: the same work built twice is the same node (and the same Dask key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import uuid
from array import array
import weakref
from typing import Any

import dask
from dask.base import DaskMethodsMixin

_counter = itertools.count()
# Output key -> node, so the optimizer can see the IR behind the keys it is asked for.
_registry: weakref.WeakValueDictionary[str, Node] = weakref.WeakValueDictionary()

LLM_OPS = ("generate", "prefill")
BATCHABLE_OPS = ("generate", "embed", "search", "rerank")


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
        return b"s" + value.encode()
    if kind is tuple or kind is list:
        try:  # token ids: the common case, encoded in one go
            return b"i" + array("q", value).tobytes()
        except (TypeError, OverflowError):
            return b"(" + b",".join(_encode(v) for v in value) + b")"
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
    return b"t" + str(dask.base.tokenize(value)).encode()


class Node(DaskMethodsMixin):
    """One operator over one input or a batch of inputs; a Dask collection."""

    __slots__ = ("op", "inputs", "params", "template", "chat", "width", "value", "label", "hash")

    def __init__(self, op: str, *, inputs: dict[str, Node] | None = None, params: dict | None = None,
                 template: tuple | None = None, chat: tuple | None = None, width: int | None = None,
                 value: Any = None, nonce: bool = False):
        self.op = op
        self.inputs = dict(inputs or {})
        self.params = dict(params or {})
        self.template = template
        self.chat = chat
        self.width = width
        self.value = value
        self.label = f"{op}-{next(_counter)}"
        self.hash = stable_hash(op, self.params_for_hash(), _template_key(template), _template_key_chat(chat), width,
                                sorted((k, v.hash) for k, v in self.inputs.items()), self._value_key(),
                                uuid.uuid4().hex if nonce else "")
        _registry[self.key] = self

    def params_for_hash(self) -> dict:
        return {k: getattr(v, "fingerprint", v) for k, v in self.params.items()}

    def _value_key(self):
        if self.op == "delayed":
            return self.value.key
        if self.op == "persisted":
            return self.value[1]
        if self.op == "const":
            return self.value
        return None

    @property
    def key(self) -> str:
        return f"{self.op}-{self.hash}"

    @property
    def batched(self) -> bool:
        return self.width is not None

    @property
    def streaming(self) -> bool:
        """A stream: a split generation or a pmap; builders given one work item by item."""
        return self.op == "pmap" or (self.op == "generate" and self.params.get("split") is not None)

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

    # --- the Dask collection protocol ----------------------------------------------------------

    def __dask_graph__(self):
        from daskllm.graph.lower import submitted

        return submitted([self]).graph

    def __dask_keys__(self):
        from daskllm.graph.lower import lowered

        return [lowered([self]).outputs[self.key]]

    def __dask_layers__(self):
        return tuple(self.__dask_graph__().layers)

    def __dask_tokenize__(self):
        return self.key

    def __dask_postcompute__(self):
        return _finalize, (self.key,)

    def __dask_postpersist__(self):
        return _persisted, (self.__dask_keys__()[0], self.width)

    @staticmethod
    def __dask_optimize__(dsk, keys, **kwargs):
        from daskllm.graph.lower import optimize

        return optimize(dsk, keys)

    __dask_scheduler__ = staticmethod(dask.threaded.get)

    def compute(self, **kwargs):
        from daskllm.api import compute

        return compute(self, **kwargs)[0]

    def persist(self, **kwargs):
        from daskllm.graph.lower import overrides

        with overrides(kwargs):
            return super().persist(**kwargs)


class Joint(DaskMethodsMixin):
    """Several nodes planned and lowered together, on the client: one collection for Dask.

    Dask 2026 may run collection optimizers on the scheduler, so joint planning (CSE and
    shared prefixes across outputs) is done here, before submission; ``daskllm.compute``
    and ``node.compute`` go through it.
    """

    __slots__ = ("nodes", "lowered")

    def __init__(self, nodes: list[Node]):
        from daskllm.graph.lower import submitted

        self.nodes = list(dict.fromkeys(nodes))
        self.lowered = submitted(self.nodes)

    def __dask_graph__(self):
        return self.lowered.graph

    def __dask_keys__(self):
        return [self.lowered.outputs[n.key] for n in self.nodes]

    def __dask_layers__(self):
        return tuple(self.lowered.graph.layers)

    def __dask_tokenize__(self):
        return tuple(self.__dask_keys__())

    def __dask_postcompute__(self):
        return tuple, ()

    @staticmethod
    def __dask_optimize__(dsk, keys, **kwargs):
        return dsk  # lowered already

    def submit(self, client, **options) -> list:
        """One future per node (in order), for work started from inside a task."""
        return client.get(self.lowered.graph, self.__dask_keys__(), sync=False, **options)

    __dask_scheduler__ = staticmethod(dask.threaded.get)


def _finalize(results, key):
    from daskllm.graph.lower import remember

    remember(key, results[0])  # computing locally; on a cluster this runs on a worker and does nothing
    return results[0]


def _persisted(dsk, key, width):
    """A node standing for an already computed (persisted) value."""
    node = Node("persisted", value=(dict(dsk), key), width=width)
    return node


def _template_key(template):
    if template is None:
        return None
    return tuple((type(s).__name__, getattr(s, "text", None) or getattr(s, "name", None) or getattr(s, "ids", None),
                  getattr(s, "model", None)) for s in template)


def _template_key_chat(chat):
    if chat is None:
        return None
    return tuple((role, _template_key(segments)) for role, segments in chat)


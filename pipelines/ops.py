"""The operations a reference pipeline is written in, and the two ways to run them.

A pipeline is a function of ``ops``. With :class:`Lazy` (what ``build`` uses) each operation
is a daskllm builder: the pipeline is a graph of nodes, planned, rewritten and placed as a
whole when computed. With :class:`Eager` each operation computes right away, with the naive
plan, and returns values: that is how a plain program over an LLM client runs. The
benchmark's baselines are these two run differently (see ``bench/harness.py``):

- ``sequential``: Eager, one query at a time, nothing in parallel (each call waits for the last);
- ``opwise``: Eager over the whole batch (one operator at a time, a barrier after each;
  per-item functions run for all items at once, as a UDF over the batch would), every call of
  an operator sent to the engines together (``NAIVE``);
- ``dask``: Lazy, computed with no rewrites, one task per call, placement off, every ready
  call dispatched (``NAIVE``);
- ``opwise-held`` / ``dask-held``: the same with each waiting call holding a Dask thread
  (``NAIVE_HELD``), as a plain Dask task calling a model does;
- ``daskllm``: Lazy, everything on.

Batches: a slot given a list (or a batch) makes one call per item; ``gather`` turns a
batch into one value (a slot given it sees the whole list). ``map`` runs ``fn(item, ops, *args)``
on every item of a split stream (per call). ``each`` runs ``fn(ops, *args)`` once per query,
each batch argument (a list, or a node with one value per query) replaced by that query's
value: per-query work whose shape depends on values, such as a branch taken or not; its
value per query is ``[result]``. Both build with the ``ops`` they are given, so the same
code is lazy inside a lazy pipeline and eager inside an eager one. Functions given to
``map`` and ``each`` live at module level (they travel to workers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import daskllm

# The plan a call gets in the naive baselines: no rewrites, one task per call, no reuse. A task
# waiting on its engine holds no Dask thread, so every ready call reaches the engines at once
# (full width: what Helium's OpWise and LangGraph's batch dispatch).
NAIVE = {"passes": [], "granularity": "query", "result_cache": False, "release_threads": True}
# The same with each waiting call holding its Dask thread, as a plain Dask task calling a model
# does: at most a worker's threads of calls reach its engine at once.
NAIVE_HELD = {**NAIVE, "release_threads": False}


@dataclass(frozen=True)
class Lazy:
    """Operations that build daskllm nodes.

    ``model``: None is daskllm's default (``daskllm.model``). ``ignore_eos``: every call
    generates its ``max_tokens`` (benchmarks on random-weight models, whose end-of-text is
    noise, use it for a fixed amount of work); by default a call stops where the model does.
    ``chat``: a template is sent as a user message in the model's chat template (None: where
    the model has one; an instruction-tuned model answers that, and often nothing to bare text).
    """

    model: str | None = None
    ignore_eos: bool = False
    chat: bool | None = None
    eager = False

    def _model(self, model: str | None) -> str:
        return model or self.model or daskllm.config.get("model")

    def _prompt(self, template: str, model: str, slots: dict):
        from daskllm.prompts import tokenizer_for

        chat = self.chat if self.chat is not None else tokenizer_for(model).has_chat_template
        return daskllm.chat([{"role": "user", "content": template}], **slots) if chat else \
            daskllm.prompt(template, **slots)

    def generate(self, template: str, *, model: str | None = None, max_tokens: int = 16, split=None, **slots):
        model = self._model(model)
        return daskllm.generate(self._prompt(template, model, slots), model=model, max_tokens=max_tokens,
                                ignore_eos=self.ignore_eos, split=split)

    def choose(self, template: str, options: tuple[str, ...], *, model: str | None = None, **slots):
        """One of ``options`` (single words), the model's pick: generation limited to their first tokens."""
        model = self._model(model)
        return daskllm.generate(self._prompt(template, model, slots), model=model, max_tokens=1,
                                allowed_token_ids=first_tokens(model, tuple(options)))

    def search(self, index, queries, k: int = 3):
        return daskllm.search(index, queries, k=k)

    def rerank(self, query, docs, k: int | None = None):
        return daskllm.rerank(query, docs, k=k)

    def map(self, stream, fn, *args):
        return daskllm.pmap(stream, fn, self, *args)

    def each(self, fn, *args):
        # A pmap over one dummy item per query: batched arguments are per call, so fn sees
        # its query's values.
        args = [daskllm.batch(a) if isinstance(a, list) else a for a in args]
        widths = {a.width if hasattr(a, "width") else len(a) for a in args
                  if isinstance(a, daskllm.batch) or getattr(a, "batched", False)}
        if len(widths) > 1:
            raise ValueError(f"each(): batch arguments of different sizes {sorted(widths)}")
        stream = daskllm.batch([[0]] * widths.pop()) if widths else [0]
        return daskllm.pmap(stream, _call, fn, self, *args)

    def collect(self, stream):
        return daskllm.collect(stream)

    def gather(self, batch):
        return daskllm.gather(batch)


def _call(_, fn, ops, *args):
    return fn(ops, *args)


@functools.cache
def first_tokens(model: str, options: tuple[str, ...]) -> tuple[int, ...]:
    """The tokens an answer naming one of ``options`` may start with."""
    from daskllm.prompts import tokenizer_for

    return tokenizer_for(model).answer_tokens(options)


def picked(text: str, options: tuple[str, ...]) -> str:
    """Which option a ``choose`` output names (its first letters)."""
    word = text.strip().lower()
    return next((o for o in options if word and o.lower().startswith(word)), options[-1])


class Items:
    """A list that fills one prompt slot (one item per line) rather than making a batch:
    what an eager search, rerank, gather or stream gives, as its lazy node would."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (Items, list)) else NotImplemented

    def __repr__(self) -> str:
        return f"Items({self.items!r})"

    def __dask_tokenize__(self):
        import dask.base

        return "pipelines.Items", dask.base.tokenize(self.items)

    def __str__(self) -> str:
        from daskllm.prompts import render_value

        return render_value(self.items)


def plain(value):
    """A pipeline's output with Items as lists: eager and lazy runs compare equal."""
    if isinstance(value, (Items, list, tuple)):
        return [plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Eager:
    """The same operations, each computed at once (naive plan) and returning values.

    ``parallel``: ``map`` and ``each`` run their function for every item at once (in
    threads), as a UDF over a batch would; otherwise one item after another.
    """

    model: str | None = None
    settings: dict = field(default_factory=lambda: dict(NAIVE))
    parallel: bool = True
    ignore_eos: bool = False
    chat: bool | None = None
    eager = True

    @property
    def lazy(self) -> Lazy:
        return Lazy(self.model, self.ignore_eos, self.chat)

    def _apply(self, fn, arguments: list[tuple]) -> list:
        if not self.parallel or len(arguments) < 2:
            return [fn(*a) for a in arguments]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(arguments)) as pool:  # every item at once: they wait on engines
            return list(pool.map(lambda a: fn(*a), arguments))

    def _run(self, node):
        return daskllm.compute(node, **self.settings)[0]

    def _lists(self, node):
        """A node whose value per call is a list, as Items (per call for a batch)."""
        value = self._run(node)
        return [Items(v) for v in value] if node.batched else Items(value)

    def generate(self, template: str, *, model: str | None = None, max_tokens: int = 16, split=None, **slots):
        node = self.lazy.generate(template, model=model, max_tokens=max_tokens, split=split, **slots)
        return self._run(node) if split is None else self._lists(node)

    def choose(self, template: str, options: tuple[str, ...], *, model: str | None = None, **slots):
        return self._run(self.lazy.choose(template, options, model=model, **slots))

    def search(self, index, queries, k: int = 3):
        return self._lists(daskllm.search(index, queries, k=k))

    def rerank(self, query, docs, k: int | None = None):
        return Items(self._run(daskllm.rerank(query, list(docs), k=k)))

    def map(self, stream, fn, *args):
        rows = [stream] if isinstance(stream, Items) else list(stream)
        flat = [(item, self, *args) for items in rows for item in items]
        results = iter(self._apply(fn, flat))
        mapped = [Items([next(results) for _ in items]) for items in rows]
        return mapped[0] if isinstance(stream, Items) else mapped

    def each(self, fn, *args):
        widths = {len(a) for a in args if isinstance(a, list)}
        if len(widths) > 1:
            raise ValueError(f"each(): batch arguments of different sizes {sorted(widths)}")
        if not widths:
            return Items([fn(self, *args)])
        calls = [(self, *[a[i] if isinstance(a, list) else a for a in args]) for i in range(widths.pop())]
        return [Items([r]) for r in self._apply(fn, calls)]

    def collect(self, stream):
        return stream

    def gather(self, batch):
        return Items(batch)

"""What a pmap runs for each item: its stages, its spec, and the errors that name an item.

Ancestry (Alto's nested tags): the (parent id, index) frames of the item whose sub-pipeline
is being built; pmap() records them, so nested pmaps know where they are.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable

from dask.base import tokenize

# The (parent id, index) frames of the item whose sub-pipeline is being built: pmap() records
# them, so nested pmaps know where they are without users handling tags (Alto).
ANCESTRY: contextvars.ContextVar[tuple] = contextvars.ContextVar("daskllm_ancestry", default=())


def format_ancestry(frames) -> str:
    return " > ".join(f"{parent}[{index}]" for parent, index in frames) or "(top level)"


class ItemError(RuntimeError):
    """An item's sub-pipeline failed. ``ancestry`` names the item; ``results`` holds every
    other item's result (the failed slots hold their errors), so finished work is kept."""

    def __init__(self, message: str, ancestry: tuple = (), results: list | None = None):
        super().__init__(message)
        self.ancestry, self.results = tuple(ancestry), results

    def __reduce__(self):
        return type(self), (self.args[0], self.ancestry, self.results)


class StreamError(RuntimeError):
    """The decode feeding a stream failed or disappeared."""


# --- pmap stages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One step of an item's sub-pipeline: ``fn(item, *args)``.

    ``lazy_ok``: fn accepts a lazy value (a node or delayed) in place of the item, as
    daskllm's builders do; then the previous step's output feeds it without being computed
    first, and the two run as one graph.
    """

    fn: Callable
    nargs: int = 0
    lazy_ok: bool = False

    @property
    def fingerprint(self) -> str:
        return tokenize(getattr(self.fn, "fingerprint", None) or self.fn, self.nargs, self.lazy_ok)


@dataclass(frozen=True)
class PmapSpec:
    stages: tuple[Stage, ...]
    errors: str = "raise"  # "raise" | "keep"
    sticky: bool = False  # every item of one parent on one worker (stateful consumers)
    ancestry: tuple = ()  # frames of the item this pmap was built for (nested pmaps)
    # Set at lowering. How the lazy work an item's stages return is planned and submitted
    # from the worker: ``submit(client, lazy_values, planning, **restrictions) -> Submitted``.
    # It is the runtime's function, handed down (the worker never imports the planner), and
    # ``planning`` is the submitting computation's settings and cluster view, so nested work
    # is planned the same way (passes, result cache; e.g. an ablation).
    submit: Callable | None = None
    planning: Any = None


@dataclass(frozen=True)
class Submitted:
    """What a nested submission started: one future per lazy value, in order; the calls its
    plans asked for (by op) and their task keys (for :func:`daskllm.usage`)."""

    futures: list
    requested: dict
    task_keys: set

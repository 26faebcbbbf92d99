"""Per-call failures in a task of many calls: a bad call fails alone, named as the user knows it.

A task runs a shard of calls: several items of a user's batch, maybe of several nodes the
stage pass consolidated. A call that cannot run (its prompt is longer than the model holds,
its text cannot be encoded, its input is null because an upstream call failed) is a failure
*outcome*: the exception it raised, kept in its slot while the other calls run. What the
task returns is decided by its :class:`Origins`, which lowering gives it: with
``on_error="raise"`` it raises a :class:`CallError` naming the call's builder, its index in
the user's batch and why; with ``"null"`` a failed call's value is None.

Only a ``ValueError`` (a ``RequestError`` is one) is a call's own failure; anything else (an
engine that died) fails the task as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

ON_ERROR = ("raise", "null")


class CallError(ValueError):
    """A call failed; the message names its builder, its index in the batch, and why."""


class NullInput(ValueError):
    """A call's input is null: the upstream call it reads failed (under ``on_error="null"``)."""

    def __init__(self, message: str = "its input is null (an upstream call failed)"):
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Origins:
    """Where a task's calls come from, for their errors, and what a failed one becomes.

    ``op``: the builder (generate, embed, search, rerank); ``index``: per call of the task, its
    index in its node's batch (None for a node of one call); ``on_error``: raise or null.
    """

    op: str
    index: tuple[int | None, ...]
    on_error: str = "raise"

    def name(self, j: int) -> str:
        i = self.index[j]
        return self.op if i is None else f"{self.op} item {i}"

    def settle(self, outcomes: list) -> list:
        """The task's value from its calls' outcomes: a failure raises or becomes None."""
        out = []
        for j, outcome in enumerate(outcomes):
            if failed(outcome):
                if self.on_error == "raise":
                    raise CallError(f"{self.name(j)}: {reason(outcome)}") from outcome
                outcome = None
            out.append(outcome)
        return out


def failed(outcome) -> bool:
    return isinstance(outcome, ValueError)


def reason(exc: BaseException) -> str:
    """Why a call failed. An engine names a bad prompt by its position in the batch it was
    given ("prompt 3: ..."), which is not the user's: the reason is then its cause alone."""
    cause = exc.__cause__
    if isinstance(cause, ValueError) and str(exc).endswith(str(cause)):
        return str(cause)
    return str(exc)


def attempt(fn: Callable, values: Sequence) -> list:
    """Per value, ``fn(value)`` or the ValueError it raised."""
    out = []
    for value in values:
        try:
            out.append(fn(value))
        except ValueError as exc:
            out.append(exc)
    return out


def ok(outcomes: Sequence) -> list:
    """The outcomes that are not failures, in order."""
    return [o for o in outcomes if not failed(o)]


def raise_others(outcomes: list) -> list:
    """``outcomes``, if every exception among them is a call's own failure; else that exception
    (an engine that failed is no call's fault: the task fails)."""
    for o in outcomes:
        if isinstance(o, BaseException) and not failed(o):
            raise o
    return outcomes


def merge(outcomes: Sequence, results: Sequence) -> list:
    """``outcomes`` with each non-failure replaced, in order, by the next of ``results`` (one
    per :func:`ok` outcome)."""
    it = iter(results)
    return [o if failed(o) else next(it) for o in outcomes]


__all__ = ["ON_ERROR", "CallError", "NullInput", "Origins", "attempt", "failed", "merge", "ok", "raise_others",
           "reason"]

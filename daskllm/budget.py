"""Budgets: a limit on tokens and calls, shared by every partition of every operator given it.

A batch of calls is reserved in one step: each call that still fits, in order, is granted,
and the others are refused at once (their work is never started). The count lives where
every task reaches it in one round trip:

* on a cluster, in a :class:`BudgetLedger` on the scheduler: a handler that runs on the
  scheduler's event loop, so a reservation is atomic without a lock. Each client registers
  the ledger on first use (idempotent: a second registration keeps the first and its counts);
* without a cluster, in this process, under a lock.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from distributed import SchedulerPlugin, get_client

HANDLER = "daskllm_budget_reserve"


@dataclass(frozen=True)
class Grant:
    """What a reservation got: per call asked for, whether it was granted; and the budget's use after it."""

    granted: tuple[bool, ...]
    tokens_used: int
    calls_used: int


@dataclass(frozen=True)
class Budget:
    """A limit on tokens (prompt + max output, reserved before each call) and/or calls, shared by
    every partition of every operator given it. Work that would go over is never started."""

    tokens: int | None = None
    calls: int | None = None
    name: str = field(default_factory=lambda: f"daskllm-budget-{uuid.uuid4().hex[:12]}")

    def __post_init__(self):
        for what in ("tokens", "calls"):
            value = getattr(self, what)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"Budget({what}=...) must be a non-negative int, got {value!r}")

    def reserve(self, needs: Sequence[int]) -> Grant:
        """Reserve one call of ``needs[i]`` tokens for each i, in order: each call that still fits
        is granted (and counted), the others are refused and take nothing."""
        needs = [int(n) for n in needs]
        client = _client()
        if client is None:
            with _local_lock:
                return _grant(_local_books, self.name, self.tokens, self.calls, needs)
        if client.id not in _registered:
            client.register_plugin(BudgetLedger())
            _registered.add(client.id)
        reply = client.sync(getattr(client.scheduler, HANDLER), name=self.name, tokens=self.tokens,
                            calls=self.calls, needs=needs)
        return Grant(tuple(reply["granted"]), reply["tokens_used"], reply["calls_used"])

    def used(self) -> dict:
        """Tokens and calls reserved so far."""
        grant = self.reserve([])
        return {"tokens": grant.tokens_used, "calls": grant.calls_used}


def _grant(books: dict, name: str, tokens: int | None, calls: int | None, needs: list[int]) -> Grant:
    used = books.setdefault(name, [0, 0])  # [tokens, calls]
    granted = []
    for need in needs:
        fits = (tokens is None or used[0] + need <= tokens) and (calls is None or used[1] + 1 <= calls)
        if fits:
            used[0] += need
            used[1] += 1
        granted.append(fits)
    return Grant(tuple(granted), used[0], used[1])


class BudgetLedger(SchedulerPlugin):
    """Every budget's use, on the scheduler; reserved through the scheduler handler ``HANDLER``."""

    name = "daskllm-budgets"
    idempotent = True

    def __init__(self):
        self.books: dict[str, list[int]] = {}

    async def start(self, scheduler) -> None:
        scheduler.handlers[HANDLER] = self.reserve

    def reserve(self, name: str, tokens: int | None, calls: int | None, needs: list[int]) -> dict:
        grant = _grant(self.books, name, tokens, calls, needs)
        return {"granted": list(grant.granted), "tokens_used": grant.tokens_used, "calls_used": grant.calls_used}


_local_books: dict[str, list[int]] = {}
_local_lock = threading.Lock()
_registered: set[str] = set()  # the clients (by id) that have registered the ledger on their scheduler


def _client():
    try:
        return get_client()
    except ValueError:
        return None


__all__ = ["Budget", "BudgetLedger", "Grant"]

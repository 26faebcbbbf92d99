"""The scheduler's copy of every task's usage record, so that a run's counts outlive its workers.

Each worker task that calls an engine records what it executed
(:class:`~daskllm.worker.usage.TaskUsage`) and sends the record to the scheduler as an event
(``USAGE_TOPIC``). Dask's own event log keeps only the last ``low-level-log-length`` (1,000)
events of a topic; :class:`UsageLedger` keeps every record by task key, newest first to go
past a bound, where :func:`daskllm.usage` and the table jobs' progress bar read them. A worker
that dies takes only its in-flight tasks' records with it; the calls those tasks had
finished are in the result store, and the task's next try counts them as this run's
(:meth:`TaskUsage.stored_since`).
"""

from __future__ import annotations

import logging

from distributed import SchedulerPlugin

from daskllm.worker.usage import USAGE_TOPIC, UsageLog

logger = logging.getLogger(__name__)


class UsageLedger(SchedulerPlugin):
    name = "daskllm-usage-ledger"

    def __init__(self, limit: int = 50_000):  # about 1 KB each
        self.records = UsageLog(limit)  # task key -> the record as it travelled (a dict)

    def log_event(self, topic: str, msg) -> None:
        if topic != USAGE_TOPIC:
            return
        try:
            key, usage = msg["key"], msg["usage"]
            known = self.records.get(key)
            # A task run again (its worker died, its result was lost): the newest record is its count.
            if known is None or usage["time"] >= known["time"]:
                self.records[key] = usage
        except Exception:  # noqa: BLE001 - a plugin never fails the scheduler
            logger.warning("malformed usage record ignored", exc_info=True)

    def find(self, keys=None, since: float | None = None, op: str | None = None) -> dict[str, dict]:
        """The records of ``keys``, or those of ``op`` made at or after ``since``."""
        if keys is not None:
            return {k: self.records[k] for k in keys if k in self.records}
        return {k: r for k, r in list(self.records.items())
                if (since is None or r["time"] >= since) and (op is None or r["op"] == op)}


def ledger_records(keys=None, since: float | None = None, op: str | None = None, dask_scheduler=None):
    """On the scheduler (``client.run_on_scheduler``): :meth:`UsageLedger.find`, or None where
    the scheduler runs no ledger (started without daskllm's preload)."""
    ledger = dask_scheduler.plugins.get(UsageLedger.name)
    return None if ledger is None else ledger.find(keys, since, op)

"""The stream wire format, shared by the decode side, the consumer side and the janitor.

One queue per (decode task, consumer task): a consumer reads the streams of all its calls
that one decode task makes through one queue, each envelope naming the call's position in
that decode task. Envelopes ``("item", position, index, payload, run)``, then ``("end",
position, count, None, run)``; ``("error", None, message, None, run)`` if the decode fails.
The envelopes a decode step completes go in one queue message (a list of them).
Payloads are pickled and small; one above ``daskllm.streaming.inline-bytes`` goes as a future
put on the queue just before its envelope (the queue goes through the scheduler). ``run``
tells a recomputed decode (its worker died) from the first.

Queues are named ``daskllm-stream/<decode key>/<consumer key>``.
"""

from __future__ import annotations

from dataclasses import dataclass

QUEUE_PREFIX = "daskllm-stream/"


def queue_name(producer_key: str, consumer_key: str) -> str:
    return f"{QUEUE_PREFIX}{producer_key}/{consumer_key}"


def parse_queue_name(name: str) -> tuple[str, str] | None:
    if not isinstance(name, str) or not name.startswith(QUEUE_PREFIX):
        return None
    producer, _, consumer = name[len(QUEUE_PREFIX):].partition("/")
    return producer, consumer


def stream_id(producer_key: str, pos: int) -> str:
    return f"{producer_key[:20]}:{pos}"


@dataclass(frozen=True)
class Source:
    """Where a pmap task's items come from: values (its calls' lists) or a streamed decode's queue."""

    producer_key: str | None = None  # streamed: the decode task
    positions: tuple[int, ...] = ()  # streamed: per call of the consumer, its position in that task's shard
    deterministic: bool = True


def stream_queues(dask_scheduler=None) -> list[str]:
    """Names of the stream queues on the scheduler (for tests and monitoring: ``client.run_on_scheduler``)."""
    ext = dask_scheduler.extensions.get("queues")
    return sorted(n for n in (ext.queues if ext else {}) if isinstance(n, str) and n.startswith(QUEUE_PREFIX))

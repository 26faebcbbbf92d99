"""Streamed requests: one Dask task per request, its text relayed to the server as it decodes.

The task (:func:`daskllm.worker.execute.run_streamed_call`) runs on a worker holding the
model, placed by the placement plugin like any decode (its annotation names the model and
the prompt's prefix blocks), and sends each engine step's new text as a Dask event on this
server's topic. Dask pushes events to the subscribed client; the relay hands each to its
request's queue. A worker that dies mid-stream makes Dask rerun the task elsewhere; greedy
decoding gives the same text again, and the relay forwards only what the client has not had.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import dask

from daskllm.annotations import DECODE_TASK, TaskAnnotation
from daskllm.engines import SamplingParams
from daskllm.engines.kv_cache import block_hashes
from daskllm import config
from daskllm.worker.execute import run_streamed_call

_DONE = object()


class StreamRelay:
    """Routes the text events of this server's streamed requests to their readers."""

    def __init__(self, client, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.loop = loop
        self.topic = f"daskllm-serve-{uuid.uuid4().hex[:12]}"
        self._readers: dict[str, asyncio.Queue] = {}
        client.subscribe_topic(self.topic, self._on_event)

    def _on_event(self, event) -> None:  # the client's event loop thread
        _, msg = event
        self.loop.call_soon_threadsafe(self._route, msg)

    def _route(self, msg: dict) -> None:
        reader = self._readers.get(msg.get("id"))
        if reader is not None:
            reader.put_nowait(msg)

    async def stream(self, request_id: str, model: str, prompt_ids: list[int], sampling: SamplingParams,
                     dask_priority: int) -> AsyncIterator[str | dict]:
        """Yield the text deltas of one request, then its completion record (a dict)."""
        reader: asyncio.Queue = asyncio.Queue()
        self._readers[request_id] = reader
        bs = config.get("engine.block-size")
        annotation = TaskAnnotation(op=DECODE_TASK, engine="llm", model=model,
                                    prefix=tuple(format(h, "x") for h in block_hashes(prompt_ids, bs)),
                                    prompt_tokens=len(prompt_ids), max_tokens=sampling.max_tokens)
        with dask.annotate(daskllm=annotation.as_dict()):
            future = self.client.submit(run_streamed_call, model, prompt_ids, sampling, self.topic, request_id,
                                        key=f"daskllm-stream-{request_id}", priority=dask_priority, pure=False)
        future.add_done_callback(lambda _: self.loop.call_soon_threadsafe(reader.put_nowait, _DONE))
        have = 0  # characters the reader has had
        try:
            while (msg := await reader.get()) is not _DONE:
                at, delta = msg["at"], msg["delta"]
                if at <= have < at + len(delta):  # a rerun repeats text already sent: skip it
                    yield delta[have - at:]
                    have = at + len(delta)
            record = await self.loop.run_in_executor(None, future.result)
            if len(record["text"]) > have:  # events still in flight when the result came
                yield record["text"][have:]
            yield record
        finally:
            self._readers.pop(request_id, None)
            if not future.done():
                future.cancel()  # the client went away: the engine drops the request

    def close(self) -> None:
        try:
            self.client.unsubscribe_topic(self.topic)
        except Exception:  # noqa: BLE001 - the client may be closing already
            pass

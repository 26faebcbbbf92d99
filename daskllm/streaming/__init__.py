"""Streaming partial outputs: items cut from a decode while it runs, consumed as they arrive.

A split generation (``generate(..., split="lines")``) is a *stream*: its value is the list
of items its text splits into. With the decode-pipelining pass on, the decode task emits
each complete item through a ``distributed.Queue`` as soon as its tokens are decoded, and
the consumer (a :func:`daskllm.pmap` task) starts the item's sub-pipeline right away,
while the decode goes on (Alto's streaming, Teola's partial decoding).

This package holds what both sides share and the scheduler needs: splitters
(:mod:`~daskllm.streaming.split`), pmap stages and item errors
(:mod:`~daskllm.streaming.stages`), the wire format (:mod:`~daskllm.streaming.wire`) and
the queue janitor (:mod:`~daskllm.streaming.janitor`). The two ends run on workers:
:mod:`daskllm.worker.streams` (decode side) and :mod:`daskllm.worker.consumer` (pmap side).
"""

from daskllm.streaming.janitor import StreamJanitor
from daskllm.streaming.split import Delimited, ItemEmitter, JSONArray, Parsed, Splitter, WordGroups, delimited, \
    splitter, words
from daskllm.streaming.stages import ANCESTRY, ItemError, PmapSpec, Stage, StreamError, Submitted, format_ancestry
from daskllm.streaming.wire import Source, stream_queues

__all__ = ["ANCESTRY", "Delimited", "ItemEmitter", "ItemError", "JSONArray", "Parsed", "PmapSpec", "Source",
           "Splitter", "Stage", "StreamError", "StreamJanitor", "Submitted", "WordGroups", "delimited",
           "format_ancestry", "splitter", "stream_queues", "words"]

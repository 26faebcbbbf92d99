"""Online serving: workflows and models behind an OpenAI-compatible HTTP API.

``daskllm serve`` (:mod:`daskllm.serve.command`) or, in a program, :func:`serving`. Layers:
:mod:`~daskllm.serve.openai_api` (the wire format), :mod:`~daskllm.serve.responses_api` (the
Responses API's, as a chat), :mod:`~daskllm.serve.embeddings` (token ids, dimensions and counts of
embeddings), :mod:`~daskllm.serve.consolidate` (micro-batched joint plans), :mod:`~daskllm.serve.relay`
(streamed text), :mod:`~daskllm.serve.service` (what a request does), :mod:`~daskllm.serve.app` (HTTP),
:mod:`~daskllm.serve.server` (uvicorn).
"""

from daskllm.serve.command import serve_command
from daskllm.serve.server import serving
from daskllm.serve.service import Service

__all__ = ["Service", "serve_command", "serving"]

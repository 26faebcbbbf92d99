"""Worker preload for CLI deployments: keep engines resident in a ``dask worker``.

    dask worker tcp://scheduler:8786 --preload daskllm.preload --daskllm-model tiny

(or ``--preload plugins/worker.py`` from a checkout). Options, each repeatable where it
makes sense:

``--daskllm-model NAME_OR_DIR``   an LLM: a recipe name or a local Hugging Face model directory
                                   (or, on llamacpp, a .gguf file)
``--daskllm-embedder NAME_OR_DIR``  an embedding model (e.g. all-MiniLM-L6-v2)
``--daskllm-reranker NAME_OR_DIR``  a reranker: a cross-encoder directory, or an embedding
                                   model for a bi-encoder (sharing the embedder's weights)
``--daskllm-backend torch|vllm|llamacpp|auto|openai``  the engine backend for those models (default:
                                   ``daskllm.engine.backend``, torch); llamacpp = the GGUF
                                   file on llama.cpp (the cpu extra); auto = vLLM if this
                                   worker has a CUDA GPU and vllm imports, else llama.cpp
                                   for a GGUF model where installed, else torch; openai = an
                                   OpenAI-compatible endpoint (``--daskllm-option base_url=...``)
``--daskllm-option KEY=VALUE``    an engine option, e.g. ``kv_cache_tokens=8192``
``--daskllm-threads N``           torch threads for the engine (default: all cores)

A model that cannot be loaded stops the worker at start-up with an error naming it: a
worker never joins the cluster half-configured.

A GPU worker with vLLM: one worker per GPU (or per tensor-parallel group), not daemonic,
since vLLM starts a child process::

    CUDA_VISIBLE_DEVICES=0 DASK_DISTRIBUTED__WORKER__DAEMON=False dask worker tcp://scheduler:8786 \
        --nthreads 16 --preload daskllm.preload --daskllm-backend vllm --daskllm-model /models/llama-3-8b
"""

from __future__ import annotations

import ast

import click

from daskllm.engines import BACKENDS, EngineSpec
from daskllm.worker import PLUGIN_NAME, EngineHost


def _parse_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.replace("-", "_"), value


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--daskllm-model", "models", multiple=True,
              help="LLM to keep resident: recipe name or local HF directory (repeatable).")
@click.option("--daskllm-embedder", "embedders", multiple=True, help="Embedding model to keep resident (repeatable).")
@click.option("--daskllm-reranker", "rerankers", multiple=True, help="Reranker to keep resident (repeatable).")
@click.option("--daskllm-backend", "backend", default=None, type=click.Choice(BACKENDS),
              help="Engine backend (default: daskllm.engine.backend).")
@click.option("--daskllm-option", "options", multiple=True, help="Engine option KEY=VALUE (repeatable).")
@click.option("--daskllm-threads", "threads", type=int, default=None, help="torch threads for the engine.")
async def dask_setup(worker, models, embedders, rerankers, backend, options, threads):
    if not (models or embedders or rerankers):
        raise click.UsageError("give at least one --daskllm-model, --daskllm-embedder or --daskllm-reranker")
    engine_options = dict(_parse_option(o) for o in options)
    specs = EngineSpec.expand(models, embedders, rerankers, backend=backend, llm_options=engine_options)
    defaults = {"num_threads": threads} if threads else {}
    host = EngineHost(specs, **defaults)
    if hasattr(worker, "_pending_plugins"):
        # Dask logs and ignores a preload's exception, so a failed load here would leave a
        # worker without engines in the cluster. Plugins given to the worker at start-up
        # are set up after preloads, and their failure aborts the start: join those.
        worker._pending_plugins = (*worker._pending_plugins, host)
    else:
        try:
            await worker.plugin_add(host, name=PLUGIN_NAME, catch_errors=False)
        except Exception:
            worker.loop.add_callback(worker.close, reason="daskllm engines failed to load", nanny=True)
            raise


async def dask_teardown(worker):
    if PLUGIN_NAME in worker.plugins:
        await worker.plugin_remove(PLUGIN_NAME)

"""``daskllm serve``: an OpenAI-compatible server over a Dask cluster (local, or one it joins)."""

from __future__ import annotations

import gc
import logging
import sys

import click
import dask
from distributed import Client

from daskllm import config
from daskllm.cluster import DASHBOARD_ADDRESS, LocalLLMCluster
from daskllm.engines import BACKENDS
from daskllm.models import DEFAULT_EMBEDDING_MODEL, ModelNotFoundError
from daskllm.serve.server import Interrupted, run, stop_on_signals
from daskllm.serve.service import Service
from daskllm.worker import EngineLoadError
from daskllm.worker.control import wait_held


@click.command("serve")
@click.option("--model", "models", multiple=True,
              help="LLM the workers hold (repeatable; default: daskllm.model). With --scheduler: what the "
                   "cluster's workers already hold is served, and --model is not needed.")
@click.option("--embedder", "embedders", multiple=True,
              help=f"Embedding model for /v1/embeddings (repeatable; default: {DEFAULT_EMBEDDING_MODEL}).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on (0.0.0.0: every interface; then set --api-key).")
@click.option("--port", default=8000, show_default=True, help="Port (0: a free one, printed at start).")
@click.option("--workers", "n_workers", default=2, show_default=True, help="Local worker processes.")
@click.option("--threads", "threads_per_worker", default=16, show_default=True, help="Dask threads per local worker.")
@click.option("--scheduler", default=None, help="Join this Dask scheduler instead of starting a local cluster.")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="Engine backend of the local cluster's workers (default: daskllm.engine.backend). Not with "
                   "--scheduler: there the workers decide (dask llm worker --backend).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=None,
              help="Output limit of a chat or Responses request that sets none (default: what the model's "
                   "context leaves after the prompt; config daskllm.serve.default-max-tokens).")
@click.option("--api-key", envvar="DASKLLM_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` (default: $DASKLLM_API_KEY; none: open).")
@click.option("--window", default=100.0, show_default=True,
              help="Most milliseconds a micro-batch waits for more requests while earlier ones run (it waits a "
                   "tenth of the recent request latency, up to this; never when the cluster is idle).")
@click.option("--max-batch", default=256, show_default=True, help="Most requests planned together.")
@click.option("--no-consolidate", is_flag=True, help="Plan and submit each request alone (for comparison).")
@click.option("--pipelines", is_flag=True,
              help="Serve the reference pipelines at /v1/pipelines/NAME (a source checkout; they search with the default "
                   "embedder).")
@click.option("--dashboard-address", default=DASHBOARD_ADDRESS, show_default=True,
              help="The local cluster's dashboard.")
@click.option("--access-log/--no-access-log", default=None,
              help="A line per request on stderr: method, path, status, model, tokens, latency, request id "
                   "(default: the config key daskllm.serve.access-log, true).")
def serve_command(models, embedders, host, port, n_workers, threads_per_worker, scheduler, backend,
                  default_max_tokens, api_key, window, max_batch, no_consolidate, pipelines, dashboard_address,
                  access_log):
    """Serve LLMs over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/responses,
    /v1/embeddings, /v1/models), with requests consolidated into joint plans on a Dask cluster."""
    if scheduler is not None and backend is not None:
        raise click.UsageError("--backend sets the engines of the local cluster serve starts; with --scheduler the "
                               "workers already hold theirs (start them with: dask llm worker --backend ...)")
    if default_max_tokens is not None:
        dask.config.set({"daskllm.serve.default-max-tokens": default_max_tokens})
    stop_on_signals()
    if access_log is None:
        access_log = bool(config.get("serve.access-log", True))
    _log_to_stderr(access_log)
    cluster = None
    try:
        if scheduler is None:
            cluster = LocalLLMCluster(models=list(models) or None,
                                      embedders=list(embedders) or [DEFAULT_EMBEDDING_MODEL], n_workers=n_workers,
                                      threads_per_worker=threads_per_worker, dashboard_address=dashboard_address,
                                      backend=backend)
        with Client(cluster if cluster is not None else scheduler) as client:
            if cluster is not None:  # "listening" means a worker holds each model
                wait_held(client, cluster.models)
            service = Service(client, consolidate=not no_consolidate, window=window / 1000, max_batch=max_batch,
                              pipelines=pipelines)
            run(service, host=host, port=port, api_key=api_key or None, on_started=_announce, access_log=access_log)
    except Interrupted:
        pass  # the first Ctrl-C or SIGTERM, wherever start-up or serving was: closing is next
    except (ModelNotFoundError, EngineLoadError) as exc:
        raise click.ClickException(f"cannot serve {', '.join(models) or config.get('model')}: {exc}") from None
    finally:
        if cluster is not None:
            cluster.close()
        # The process exits next: its objects need no more collection passes, which with torch's
        # and transformers' modules loaded make the interpreter's exit take seconds.
        gc.freeze()


def _log_to_stderr(access_log: bool) -> None:
    """The server's log on stderr: errors always, each request's line with ``access_log``."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    served = logging.getLogger("daskllm.serve")
    served.addHandler(handler)
    served.setLevel(logging.INFO if access_log else logging.WARNING)
    served.propagate = False  # not twice where the root logger has a handler too


def _announce(url: str) -> None:
    click.echo(f"daskllm serve: listening on {url}")
    sys.stdout.flush()  # a supervisor (or a test) reading the pipe learns the address now

"""``dask llm``: Dask's own command line with daskllm's preloads, as ``dask cuda`` is for dask-cuda.

    dask llm scheduler                                     # dask scheduler + placement, LLM dashboard page
    dask llm worker tcp://scheduler:8786 --model smollm2   # dask worker + resident engines
    dask llm serve --scheduler tcp://scheduler:8786 ...    # daskllm serve: an OpenAI-compatible server

Registered as the ``dask_cli`` entry point ``llm``. Options these commands do not know go to
``dask scheduler`` / ``dask worker`` unchanged (``dask worker --help``). The ``dask`` command loads
every entry point on each start, so this module imports nothing heavy; ``serve`` is imported
only when it runs or is listed. ``python -m daskllm.dask_cli worker ...`` is the same command
(dask-jobqueue's ``worker_command``). This module is also the scheduler preload that ``dask llm
scheduler`` runs (``--preload daskllm.dask_cli``; plugins/scheduler.py is the same).
"""

from __future__ import annotations

import importlib

import click
import dask
from distributed.cli.dask_scheduler import main as dask_scheduler
from distributed.cli.dask_worker import main as dask_worker

from daskllm.cluster import DASHBOARD_ADDRESS, NO_MALLOC_TRIM, discover_gpus, scheduler_plugins, settings_for_vllm
from daskllm.engines import BACKENDS, EngineSpec, runs_vllm
from daskllm.placement import POLICIES

PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}


class _LazyGroup(click.Group):
    """A group whose listed commands named by import path load only when used (``serve`` brings
    the web stack, which ``dask --help`` must not pay for)."""

    lazy = {"serve": "daskllm.serve:serve_command"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, attribute = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def llm() -> None:
    """daskllm: a Dask cluster whose workers keep LLM engines resident."""


def _given(args: tuple[str, ...], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in args)


@llm.command(context_settings=PASS_THROUGH)
@click.option("--placement", default=None, type=click.Choice(POLICIES),
              help="Placement policy (default: daskllm.placement.policy in dask config).")
@click.argument("dask_args", nargs=-1, type=click.UNPROCESSED)
def scheduler(placement: str | None, dask_args: tuple[str, ...]) -> None:
    """`dask scheduler` with daskllm's placement, adaptive target and dashboard page. Other options go to
    `dask scheduler`; the dashboard listens on 127.0.0.1:8787 unless --dashboard-address says
    otherwise (it has no authentication: docs/dashboard.md)."""
    args = list(dask_args)
    if not _given(dask_args, "--dashboard-address"):
        args += ["--dashboard-address", DASHBOARD_ADDRESS]
    args += ["--preload", "daskllm.dask_cli"] + (["--daskllm-placement", placement] if placement else [])
    dask_scheduler.main(args, prog_name="dask llm scheduler")


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--daskllm-placement", "policy", default=None, type=click.Choice(POLICIES),
              help="Placement policy (default: daskllm.placement.policy in dask config).")
def dask_setup(scheduler, policy: str | None) -> None:
    """The scheduler preload: the plugins LocalLLMCluster's scheduler runs."""
    for plugin in scheduler_plugins(policy):
        scheduler.add_plugin(plugin, name=plugin.name)


@llm.command(context_settings=PASS_THROUGH)
@click.argument("address", required=False)
@click.option("--scheduler-file", default=None, help="Scheduler file instead of ADDRESS (as in dask worker).")
@click.option("--model", "models", multiple=True, help="LLM to keep resident: recipe name or HF directory (repeatable).")
@click.option("--embedder", "embedders", multiple=True, help="Embedding model to keep resident (repeatable).")
@click.option("--reranker", "rerankers", multiple=True, help="Reranker to keep resident (repeatable).")
@click.option("--backend", type=click.Choice(BACKENDS), default=None,
              help="Engine backend of the models that name none (default: daskllm.engine.backend; auto: vLLM on "
                   "a CUDA GPU where vllm is installed, else torch, or llama.cpp for a GGUF model).")
@click.option("--option", "options", multiple=True, help="Engine option KEY=VALUE, e.g. kv_cache_tokens=65536 "
              "(repeatable).")
@click.option("--engine-threads", type=int, default=None, help="torch threads per engine (default: all cores).")
@click.argument("dask_args", nargs=-1, type=click.UNPROCESSED)
def worker(address: str | None, scheduler_file: str | None, models: tuple[str, ...], embedders: tuple[str, ...],
           rerankers: tuple[str, ...], backend: str | None, options: tuple[str, ...], engine_threads: int | None,
           dask_args: tuple[str, ...]) -> None:
    """`dask worker ADDRESS` that keeps engines resident (the daskllm.preload worker preload).
    Other options go to `dask worker` (e.g. --nthreads, --nworkers, --memory-limit)."""
    if not (models or embedders or rerankers):
        raise click.UsageError("give at least one --model, --embedder or --reranker")
    if address is not None and address.startswith("-"):  # a dask worker option, taken for ADDRESS
        dask_args, address = (address, *dask_args), None
    # dask worker reads its first positional argument as the scheduler: without one, the
    # preload's options would be taken for it. With a scheduler file the address is ignored.
    # DASK_SCHEDULER_ADDRESS (dask-kubernetes sets it) gives one too.
    address = address or dask.config.get("scheduler-address", None) or ("" if scheduler_file else None)
    if address is None:
        raise click.UsageError("give the scheduler's address first (or --scheduler-file)")
    args = [address, *dask_args] + (["--scheduler-file", scheduler_file] if scheduler_file else [])
    args += ["--preload", "daskllm.preload"]
    for flag, values in (("--daskllm-model", models), ("--daskllm-embedder", embedders),
                         ("--daskllm-reranker", rerankers), ("--daskllm-option", options)):
        args += [a for value in values for a in (flag, value)]
    args += (["--daskllm-backend", backend] if backend else []) + \
        (["--daskllm-threads", str(engine_threads)] if engine_threads else [])
    dask.config.set(NO_MALLOC_TRIM)  # for this process's nannies: Dask's setting slows torch
    specs = EngineSpec.expand(models, embedders, rerankers, backend=backend)
    if runs_vllm(specs):  # non-daemonic workers; 32-token blocks on CPU (auto decided as the workers will)
        settings_for_vllm(on_cpu=not discover_gpus())
    dask_worker.main(args, prog_name="dask llm worker")


if __name__ == "__main__":
    llm(prog_name="dask llm")

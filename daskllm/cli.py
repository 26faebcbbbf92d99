"""The ``daskllm`` command."""

from __future__ import annotations

import json
import pathlib
import runpy
import sys

import click
import pandas as pd

from daskllm import demo as demo_job
from daskllm.cluster import DASHBOARD_ADDRESS
from daskllm.datasets import catalog, load
from daskllm.models import cache_dir, list_recipes, resolve
from daskllm.quiet_start import started
from daskllm.serve import serve_command
from daskllm.worker import calibrations
from daskllm.worker.store import open_store

started()  # the modules are in: Ctrl-C is the commands' own again


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="daskllm")
def main():
    """daskllm: LLM prefill, decode, embed, search and rerank as Dask tasks."""


@main.command()
@click.option("--model", default=None, help="Recipe name or local HF model directory (default: daskllm.model, smollm2).")
@click.option("--workers", "n_workers", default=2, show_default=True, help="Worker processes (one per GPU on GPUs).")
@click.option("--questions", "n_questions", default=12, show_default=True,
              type=click.IntRange(1, 16), help="Questions about the standard library to answer (at most 16).")
@click.option("--max-tokens", default=48, show_default=True, help="Most tokens generated per answer.")
@click.option("--rows", type=click.IntRange(1), default=None,
              help="Rows of the table job (default: every row of its 12 modules, about 400).")
@click.option("--passages", "n_passages", type=click.IntRange(1), default=None,
              help="Documentation passages in the index, the questions' own modules first (default: all "
                   "of its 50 modules, about 1,600).")
@click.option("--dashboard-address", default=DASHBOARD_ADDRESS, show_default=True,
              help="Where the dashboard listens; it has no authentication, so only this machine by default "
                   "(0.0.0.0:8787: every interface, see docs/dashboard.md).")
@click.option("--keep-alive", default=0.0, help="Seconds to keep the cluster (and dashboard) up afterwards.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the summary as JSON.")
def demo(model, n_workers, n_questions, max_tokens, rows, n_passages, dashboard_address, keep_alive, json_path):
    """The main job: a real model answers questions about the standard library with retrieval on a
    local cluster, then a table job; prints what the plan did and the dashboard's address."""
    summary = demo_job.run(model=model, n_workers=n_workers, n_questions=n_questions, max_tokens=max_tokens,
                           rows=rows, dashboard_address=dashboard_address, keep_alive=keep_alive,
                           n_passages=n_passages, echo=click.echo)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=2, default=str)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args):
    """The benchmark harness (bench/harness.py; needs a source checkout). ``daskllm bench --help``."""
    harness = pathlib.Path(__file__).resolve().parent.parent / "bench" / "harness.py"
    if not harness.is_file():
        raise click.ClickException(f"daskllm bench runs bench/harness.py from a source checkout; {harness} is not "
                                   "there (the harness and pipelines/ are not part of the installed package)")
    sys.argv = [str(harness), *args]
    try:
        runpy.run_path(str(harness), run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise


main.add_command(serve_command)


@main.group()
def models():
    """Model recipes (built offline, once) and the model cache."""


@models.command("list")
def models_list():
    """List recipes: parameters, source, license, and whether (and where) they are built."""
    click.echo(f"cache: {cache_dir()}")
    for row in list_recipes():
        state = (f"built, {row.size_bytes / 1e6:,.0f} MB on disk: {row.path}" if row.path is not None
                 else f"cannot build here: {row.problem}" if row.problem else "not built (built on first use)")
        click.echo(f"  {row.name:<9} {row.params / 1e6:8.1f}M params  {state}")
        click.echo(f"            source: {row.source}; license: {row.license}")


@models.command("build")
@click.argument("names", nargs=-1, required=True)
def models_build(names):
    """Build (or find cached) recipe models and print their directories."""
    for name in names:
        click.echo(f"{name}: {resolve(name)}")


@main.group()
def cache():
    """The persistent result store (daskllm.result-store): results of deterministic calls on disk;
    and the calibrations the workers remember (daskllm.calibrations)."""


@cache.command("info")
def cache_info():
    """Where the store is, its entries, its size on disk and its limit."""
    info = open_store(enabled=True).info()
    click.echo(f"location: {info['path']}")
    click.echo(f"enabled: {'yes' if info['enabled'] else 'no (daskllm.result-store.enabled: false)'}")
    click.echo(f"entries: {info['entries']}")
    click.echo(f"size on disk: {info['size_bytes']:,} bytes")
    click.echo(f"limit: {info['size_limit']:,} bytes")
    click.echo(f"calibrations remembered: {calibrations.count()} in {calibrations.calibrations_path()}")


@cache.command("clear")
@click.option("--calibrations", "forget_calibrations", is_flag=True,
              help="Forget the remembered calibrations instead (a new cluster then previews no time until "
                   "daskllm.dataframe.calibrate() runs).")
def cache_clear(forget_calibrations):
    """Remove every stored result."""
    if forget_calibrations:
        forgotten = calibrations.forget_all()
        click.echo(f"cleared {calibrations.calibrations_path()}: {forgotten} calibrations forgotten")
        return
    store = open_store(enabled=True)
    entries = store.info()["entries"]
    store.clear()
    click.echo(f"cleared {store.path}: {entries} entries removed")


@main.group()
def datasets():
    """The corpus and question sets daskllm loads (daskllm.datasets)."""


@datasets.command("list")
def datasets_list():
    """List every dataset, where it comes from, and whether it is available here."""
    for info in catalog():
        state = "available" if info.available else "not here (needs ../shared/data or $DASKLLM_DATA_DIR)"
        click.echo(f"  {info.name:<15} {info.kind:<10} {info.description}")
        click.echo(f"  {'':<15} {'':<10} source: {info.source}; {state}"
                   + (f": {info.location}" if info.location else ""))


@datasets.command("show")
@click.argument("name")
@click.option("-n", "n", type=click.IntRange(0), default=5, show_default=True, help="Rows to show.")
@click.option("--seed", default=0, show_default=True, help="Seed of the generated sets.")
def datasets_show(name, n, seed):
    """Print the first rows of a dataset."""
    try:
        frame = load(name, n, seed=seed)
    except (ValueError, FileNotFoundError) as error:
        raise click.ClickException(str(error)) from None
    with pd.option_context("display.max_colwidth", 100, "display.width", 200):
        click.echo(frame.to_string())


if __name__ == "__main__":
    main()

"""The command line: `daskllm`, and real `dask scheduler` / `dask worker` processes with our preload."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from distributed import Client

from daskllm.engines import EngineSpec, SamplingParams
from daskllm.worker import embed
from daskllm.worker import engine_stats, generate, resident_models
from helpers import scheduler_address

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = ["The scheduler file says where to connect.", "def preload(worker):\n    return", "Dask worker CLI"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scheduler_file(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("cli") / "scheduler.json"
    proc = subprocess.Popen([BIN / "dask", "scheduler", "--scheduler-file", path, "--port", "0", "--no-dashboard",
                             "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        scheduler_address(path, proc)
        yield path
    finally:
        proc.terminate()
        proc.wait(30)


def _worker(scheduler_file, *args, log=subprocess.PIPE) -> subprocess.Popen:
    # The scheduler address goes first, as users write it: with --scheduler-file instead,
    # the dask CLI does not hand the options after --preload to the preload.
    address = json.loads(pathlib.Path(scheduler_file).read_text())["address"]
    return subprocess.Popen([BIN / "dask", "worker", address, "--nthreads", "4", "--no-dashboard",
                             "--preload", REPO / "plugins" / "worker.py", *args],
                            stdout=log, stderr=subprocess.STDOUT, text=True)


def test_cli_worker_with_preload_serves_the_model(scheduler_file, tiny_model_dir, tmp_path):
    log = (tmp_path / "worker.log").open("w")
    worker = _worker(scheduler_file, "--daskllm-model", "tiny", "--daskllm-option", "kv_cache_tokens=2048",
                     "--daskllm-embedder", "all-MiniLM-L6-v2", log=log)
    try:
        with Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            assert list(resident_models(client).values()) == [["tiny"]]
            assert list(resident_models(client, kind="embed").values()) == [["all-MiniLM-L6-v2"]]
            vectors = client.submit(embed, "all-MiniLM-L6-v2", PROMPTS).result()
            assert vectors.shape == (3, 384)
            # Functions from the package: CLI workers cannot import this test module.
            got = [c.token_ids for c in client.gather(client.map(generate, ["tiny"] * 3, PROMPTS, [PARAMS] * 3))]
            stats = list(client.run(engine_stats).values())[0]["tiny"]
        with EngineSpec(model="tiny").load(kv_cache_tokens=2048) as engine:
            assert got == [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
        assert stats["cache_blocks_total"] * 16 == 2048  # --daskllm-option reached the engine
    finally:
        worker.terminate()
        worker.wait(60)
        log.close()


def test_cli_worker_with_unknown_model_never_joins(scheduler_file):
    worker = _worker(scheduler_file, "--daskllm-model", "no-such-model")
    output, _ = worker.communicate(timeout=120)
    assert worker.returncode != 0
    assert "no-such-model" in output
    with Client(scheduler_file=str(scheduler_file), timeout=30) as client:
        assert "no-such-model" not in str(client.scheduler_info()["workers"])
        assert not any("Registered to" in line for line in output.splitlines())


def test_daskllm_help():
    out = subprocess.run([BIN / "daskllm", "--help"], capture_output=True, text=True, check=True).stdout
    assert "demo" in out and "models" in out


def test_serve_backend_is_one_of_the_engines_and_not_for_a_cluster_it_joins():
    from click.testing import CliRunner

    from daskllm.cli import main

    joined = CliRunner().invoke(main, ["serve", "--scheduler", "tcp://127.0.0.1:8786", "--backend", "vllm"])
    assert joined.exit_code == 2 and "with --scheduler the workers already hold theirs" in joined.output
    unknown = CliRunner().invoke(main, ["serve", "--backend", "cuda"])
    assert unknown.exit_code == 2 and "'cuda' is not one of 'torch', 'vllm'" in unknown.output


def test_demo_runs_end_to_end_with_right_readable_answers(tmp_path, smollm2_model_dir):
    """`daskllm demo` as a user runs it (the default model, smollm2), made smaller: it answers,
    the answers name the right modules, every plan gives the same answers, and it prints no
    warning or traceback."""
    import os

    from conftest import DEFAULT_MODEL_ENV

    summary_file = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != DEFAULT_MODEL_ENV}
    run = subprocess.run([BIN / "daskllm", "demo", "--questions", "4", "--rows", "60", "--max-tokens", "32",
                          "--passages", "300",
                          "--dashboard-address", "127.0.0.1:0", "--json", summary_file],
                         capture_output=True, text=True, timeout=400, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Dashboard: http://" in run.stdout and "✓ names json" in run.stdout
    assert not run.stderr.strip(), run.stderr[-3000:]  # no log line, warning or traceback
    assert "Traceback" not in run.stdout and "Warning:" not in run.stdout
    summary = json.loads(summary_file.read_text())
    qa, table = summary["qa"], summary["table"]
    assert summary["model"] == "smollm2" and qa["questions"] == 4 and qa["passages"] == 300
    assert qa["named_module_with_docs"] >= 3  # retrieval puts the right module in front of the model
    assert qa["same_answers_as_naive"] and table["same_answers"]
    assert all(answer.strip() for answer in qa["answers"])
    assert table["rows"] == 60 and table["operators"]["map"]["executed"] < 60  # identical prompts ran once
"""`dask llm scheduler|worker|serve`: Dask's own command line with daskllm's preloads (the
``dask_cli`` entry point ``llm``), as a real cluster is started on several machines."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator

import dask
import pytest
from click.testing import CliRunner
from distributed import Client
from distributed.cli import dask_scheduler, dask_worker

import daskllm
from daskllm.dask_cli import llm
from daskllm.worker import resident_models
from helpers import free_port, wait_for

BIN = pathlib.Path(sys.executable).parent
MALLOC = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
PROMPTS = ["The scheduler file says where to connect.", "dask llm worker", "def preload(worker):\n    return"]


# --- what the commands run (no processes) ---------------------------------------------------------


@pytest.fixture
def launched(monkeypatch) -> list[tuple[str, list[str], object]]:
    """The `dask scheduler` / `dask worker` invocations, recorded instead of run."""
    calls = []
    for name, command in (("scheduler", dask_scheduler.main), ("worker", dask_worker.main)):
        monkeypatch.setattr(command, "main", lambda args, prog_name, name=name: calls.append(
            (name, list(args), dask.config.get(MALLOC))))
    return calls


def run(*args: str) -> str:
    with dask.config.set({MALLOC: 65536}):  # Dask's default, restored after the command changed it
        result = CliRunner().invoke(llm, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_subcommands_help():
    assert "dask worker" in run("worker", "--help") and "--model" in run("worker", "--help")
    assert "--dashboard-address" in run("scheduler", "--help")
    assert "--scheduler" in run("serve", "--help")


def test_scheduler_adds_the_preload_and_a_loopback_dashboard(launched):
    run("scheduler", "--port", "8786")
    run("scheduler", "--dashboard-address=:8787", "--placement", "round_robin")
    assert [args for _, args, _ in launched] == [
        ["--port", "8786", "--dashboard-address", "127.0.0.1:8787", "--preload", "daskllm.dask_cli"],
        ["--dashboard-address=:8787", "--preload", "daskllm.dask_cli", "--daskllm-placement", "round_robin"]]


def test_worker_passes_dask_options_through_and_turns_malloc_trim_off(launched):
    run("worker", "tcp://10.0.0.1:8786", "--model", "smollm2", "--nthreads", "8", "--option", "kv_cache_tokens=65536",
        "--embedder", "all-MiniLM-L6-v2", "--backend", "torch", "--engine-threads", "4")
    run("worker", "--scheduler-file", "/shared/scheduler.json", "--model", "tiny", "--model", "smollm2")
    (_, first, malloc), (_, second, _) = launched
    assert first == ["tcp://10.0.0.1:8786", "--nthreads", "8", "--preload", "daskllm.preload",
                     "--daskllm-model", "smollm2", "--daskllm-embedder", "all-MiniLM-L6-v2",
                     "--daskllm-option", "kv_cache_tokens=65536", "--daskllm-backend", "torch", "--daskllm-threads", "4"]
    assert malloc is None
    # dask worker takes its first positional argument for the scheduler: an empty one, so the
    # preload's options are not taken for it; the scheduler file gives the address.
    assert second == ["", "--scheduler-file", "/shared/scheduler.json", "--preload", "daskllm.preload",
                      "--daskllm-model", "tiny", "--daskllm-model", "smollm2"]


def test_worker_backend_auto_takes_the_vllm_settings_only_where_it_means_vllm(launched, monkeypatch):
    """`--backend auto` is decided as the worker will decide it (vLLM on a CUDA GPU where vllm
    is installed): only then do the workers get vLLM's settings (non-daemonic, for its engine core)."""
    import daskllm.dask_cli as cli
    import daskllm.engines as engines

    applied = []
    monkeypatch.setattr(cli, "settings_for_vllm", lambda on_cpu: applied.append(on_cpu))
    monkeypatch.setattr(cli, "discover_gpus", lambda: [0])
    for gpu_with_vllm in (False, True):
        monkeypatch.setattr(engines, "_cuda_with_vllm", lambda answer=gpu_with_vllm: answer)
        run("worker", "tcp://10.0.0.1:8786", "--model", "tiny", "--backend", "auto")
    run("worker", "tcp://10.0.0.1:8786", "--embedder", "all-MiniLM-L6-v2", "--backend", "vllm")  # no LLM
    assert applied == [False] and len(launched) == 3


def test_worker_takes_the_scheduler_address_from_dask_config(launched):
    # As on dask-kubernetes, which sets DASK_SCHEDULER_ADDRESS and appends --name etc.
    with dask.config.set({"scheduler-address": "tcp://scheduler:8786"}):
        run("worker", "--model", "tiny", "--name", "worker-1", "--dashboard-address", "8788")
    assert launched[0][1][:5] == ["tcp://scheduler:8786", "--name", "worker-1", "--dashboard-address", "8788"]


def _documented() -> list[list[str]]:
    """The `dask llm ...` commands of docs/deployment.md's shell blocks."""
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    blocks = re.findall(r"^```(?:bash|console|sh)\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    lines = [line.split(" #")[0] for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("dask llm ")]


@pytest.mark.parametrize("args", _documented(), ids=" ".join)
def test_the_documented_commands_parse(launched, args):
    if args[0] == "serve":  # would serve: its options exist
        out = run("serve", "--help")
        assert all(a.split("=")[0] in out for a in args if a.startswith("--"))
    else:
        run(*args)
        assert launched


@pytest.mark.parametrize("args, message", [
    (["tcp://10.0.0.1:8786"], "at least one --model"),
    (["--model", "tiny"], "scheduler's address"),
    (["--nthreads", "4", "tcp://10.0.0.1:8786", "--model", "tiny"], "address first"),
    (["tcp://10.0.0.1:8786", "--model", "tiny", "--backend", "vlm"],
     "'vlm' is not one of 'torch', 'vllm', 'llamacpp', 'auto', 'openai'"),
])
def test_worker_usage_errors(launched, args, message):
    result = CliRunner().invoke(llm, ["worker", *args])
    assert result.exit_code == 2 and message in result.output
    assert not launched


# --- real processes -------------------------------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen]]:
    """Starts processes (output to a log file); every one is stopped at the end."""
    started: list[tuple[subprocess.Popen, object]] = []

    def start(*args, log: pathlib.Path) -> subprocess.Popen:
        out = log.open("w")
        proc = subprocess.Popen([str(a) for a in args], stdout=out, stderr=subprocess.STDOUT)
        started.append((proc, out))
        return proc

    yield start
    for proc, _ in reversed(started):
        proc.terminate()
    for proc, out in started:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        out.close()


@pytest.mark.slow
def test_dask_llm_help_lists_the_commands():
    # Through Dask's own command: the dask_cli entry point is installed.
    out = subprocess.run([BIN / "dask", "llm", "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert {"scheduler", "worker", "serve"} <= {line.split()[0] for line in out.split("Commands:")[1].splitlines()
                                                if line.strip()}
    # dask-jobqueue starts workers with `python -m WORKER_COMMAND`
    out = subprocess.run([sys.executable, "-m", "daskllm.dask_cli", "worker", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "Usage: dask llm worker" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cluster_started_with_dask_llm(processes, tmp_path, tiny_model_dir):
    node = daskllm.generate(daskllm.prompt("Say {x}:", x=PROMPTS), max_tokens=8, ignore_eos=True)
    expected = daskllm.compute(node, result_cache=False)[0]  # a local engine in this process
    port, dashboard = free_port(), free_port()
    scheduler = processes(BIN / "dask", "llm", "scheduler", "--host", "127.0.0.1", "--port", port,
                          "--dashboard-address", f"127.0.0.1:{dashboard}", log=tmp_path / "scheduler.log")
    address = f"tcp://127.0.0.1:{port}"
    worker = processes(BIN / "dask", "llm", "worker", address, "--model", "tiny", "--nthreads", "4", "--no-dashboard",
                       "--option", "kv_cache_tokens=2048", log=tmp_path / "worker.log")
    with Client(address, timeout=60) as client:
        wait_for(lambda: client.scheduler_info()["workers"], 120, scheduler, worker)
        assert list(resident_models(client).values()) == [["tiny"]]
        assert list(client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == [None]
        plugins = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
        assert {"daskllm-placement", "daskllm-dashboard", "daskllm-streams", "daskllm-adaptive"} <= set(plugins)
        with urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/llm/metrics.json", timeout=30) as page:
            assert page.status == 200
        assert daskllm.compute(node, result_cache=False)[0] == expected

        # dask llm serve joins the same cluster; it prints its address once it answers.
        log = tmp_path / "serve.log"
        server = processes(BIN / "dask", "llm", "serve", "--scheduler", address, "--port", "0", log=log)
        wait_for(lambda: "daskllm serve: listening on " in log.read_text(), 120, server)
        url = log.read_text().split("daskllm serve: listening on ")[1].split()[0]
        with urllib.request.urlopen(f"{url}/models", timeout=60) as response:
            assert "tiny" in {m["id"] for m in json.load(response)["data"]}

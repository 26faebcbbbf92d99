"""The process's compute thread (daskllm/engines/compute.py): every engine's CPU work runs on
one thread, so torch's OpenMP pool has one team."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from daskllm.engines import compute


def test_work_from_any_thread_runs_on_one_thread():
    with ThreadPoolExecutor(4) as pool:
        names = set(pool.map(lambda _: compute.run(lambda: threading.current_thread().name), range(16)))
    assert len(names) == 1 and names.pop().startswith("daskllm-compute")


def test_nested_calls_run_inline_and_errors_reach_the_caller():
    assert compute.run(lambda: compute.run(lambda: 7) + 1) == 8  # no deadlock
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: 2) == 2  # the thread survives an error


def test_engines_load_and_step_on_the_compute_thread(tiny_model_dir):
    from daskllm.engines import SamplingParams
    from daskllm.engines.embedder import EmbedEngine
    from daskllm.engines.llama import LlamaModel
    from daskllm.engines.torch_engine import TorchEngine

    seen: set[str] = set()
    forward = LlamaModel.forward

    def recording(self, step):
        seen.add(threading.current_thread().name)
        return forward(self, step)

    LlamaModel.forward = recording
    try:
        with TorchEngine("tiny", device="cpu") as engine:
            engine.generate(["a b c"], SamplingParams(max_tokens=3))
    finally:
        LlamaModel.forward = forward
    assert seen and all(name.startswith("daskllm-compute") for name in seen)
    embed = EmbedEngine("minilm", device="cpu")
    try:
        assert embed.embed(["hello"]).shape == (1, embed.dim)
    finally:
        embed.close()

"""How long an engine takes to start: ``TorchEngine(model)`` (or a vLLM engine) to its first token, cold and warm.

    python bench/engine_startup.py --model llama-1b                  # on cuda: cold, then warm
    python bench/engine_startup.py --model tiny --device cpu --json startup.json
    .venv-vllm/bin/python bench/engine_startup.py --backend vllm --model smollm2 --enforce-eager both

Each start runs in a fresh process (nothing compiled or loaded in this one counts), both
sharing one new, empty cache directory: the first start finds it empty (the model's recipe is
built, Triton compiles every kernel), the second finds what the first left there
(``DASKLLM_CACHE_DIR``, and ``TRITON_CACHE_DIR`` inside it unless ``--keep-triton-cache``).
Reported per start: the engine's own phases (``TorchEngine.load_phases``: the model's weights
and prepared products, the KV cache, the CUDA graphs with the kernels they compile), the time
from calling ``TorchEngine`` to the first generated token, and the process's import time.

``--backend vllm`` starts daskllm's vLLM engine as a worker does: a fresh process imports
daskllm, then ``EngineSpec(model, backend="vllm").load(num_threads=T)`` (vllm imported there;
on CPU with 32-token KV blocks) and one prompt's first token. The cold start finds vLLM's
compile cache empty (``VLLM_CACHE_ROOT``, with torch inductor's and Triton's caches, in a new
directory: daskllm's CPU engines otherwise keep it in ``<models cache>/vllm``), the warm one
what the cold one left; the model itself comes from the usual models cache, built already.
``--enforce-eager on|off|both`` picks vLLM's eager mode, torch.compile, or measures both (each
with its own cold and warm start); the default is the engine's own (eager on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b", help="recipe name or model directory (default: llama-1b)")
    p.add_argument("--backend", choices=("torch", "vllm"), default="torch", help="the engine to start (default: torch)")
    p.add_argument("--device", help="torch: cuda or cpu (default: cuda where available)")
    p.add_argument("--engine-kwargs", default="{}", help="more engine arguments, as JSON")
    p.add_argument("--enforce-eager", choices=("default", "on", "off", "both"), default="default",
                   help="vllm: eager, torch.compile, or both, each cold and warm (default: the engine's own)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="vllm: the engine's threads (default: all cores)")
    p.add_argument("--keep-triton-cache", action="store_true",
                   help="leave TRITON_CACHE_DIR as it is (default: inside the new cache directory)")
    p.add_argument("--timeout", type=float, default=240, help="seconds each start may take")
    p.add_argument("--json", metavar="PATH", help="write both starts here")
    p.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> dict:
    """One start in this process: the engine, then one prompt's first token."""
    if args.backend == "vllm":
        return vllm_child(args)
    began = time.perf_counter()
    import torch

    from daskllm.engines.protocol import SamplingParams
    from daskllm.engines.torch_engine import TorchEngine

    imported = time.perf_counter()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = TorchEngine(args.model, device=device, **json.loads(args.engine_kwargs))
    loaded = time.perf_counter()
    engine.generate([[100 + i for i in range(16)]], SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter()
    phases = dict(engine.load_phases)
    engine.close()
    return {"import_s": imported - began, "engine_s": loaded - imported, "first_token_s": first - imported,
            "phases": phases, "device": device}


def vllm_child(args) -> dict:
    """One vLLM start in this process, as a worker's: import daskllm, load the engine, one first token."""
    began = time.perf_counter()
    import daskllm  # noqa: F401 - what a worker imports before its engines
    from daskllm.engines import EngineSpec
    from daskllm.engines.protocol import SamplingParams

    imported = time.perf_counter()
    from daskllm.engines import vllm as vllm_engine

    options = {"num_threads": args.threads, **json.loads(args.engine_kwargs)}
    cpu = vllm_engine.on_cpu()
    if cpu:
        options.setdefault("block_size", vllm_engine.CPU_BLOCK_MULTIPLE)
    engine = EngineSpec(args.model, backend="vllm").load(**options)
    loaded = time.perf_counter()
    engine.generate([[100 + i for i in range(16)]], SamplingParams(max_tokens=1, temperature=0.0))
    first = time.perf_counter()
    eager = engine._engine.vllm_config.model_config.enforce_eager
    engine.close()
    return {"import_s": imported - began, "engine_s": loaded - imported, "first_token_s": first - imported,
            "total_s": first - began, "phases": {}, "device": "cpu" if cpu else "cuda", "enforce_eager": eager}


def start(args, env: dict, engine_kwargs: str | None = None) -> dict:
    """One start in a fresh process (``--child``), its JSON line back."""
    command = [sys.executable, __file__, CHILD, "--model", args.model, "--backend", args.backend,
               "--engine-kwargs", engine_kwargs or args.engine_kwargs, "--threads", str(args.threads)]
    if args.device:
        command += ["--device", args.device]
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise RuntimeError(f"start-up run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["process_s"] = time.perf_counter() - began
    return record


def measure(args) -> dict:
    """A cold start on empty caches, then a warm one on what it left."""
    if args.backend == "vllm":
        return measure_vllm(args)
    with tempfile.TemporaryDirectory(prefix="daskllm-startup-") as tmp:
        env = {**os.environ, "DASKLLM_CACHE_DIR": os.path.join(tmp, "models")}
        if not args.keep_triton_cache:
            env["TRITON_CACHE_DIR"] = os.path.join(tmp, "models", "triton")
        env.pop("DASK_DASKLLM__MODELS__CACHE_DIR", None)  # the configured directory would win over the variable
        cold = start(args, env)
        warm = start(args, env)
    return {"model": args.model, "cold": cold, "warm": warm}


def vllm_modes(args) -> list[str]:
    """The --engine-kwargs of each start pair --enforce-eager asks for."""
    base = json.loads(args.engine_kwargs)
    eager = {"on": [True], "off": [False], "both": [True, False]}.get(args.enforce_eager, [None])
    return [json.dumps(base if e is None else {**base, "enforce_eager": e}) for e in eager]


def measure_vllm(args) -> dict:
    """Per mode: a cold start on an empty compile cache, then a warm one on what it left."""
    modes = {}
    for engine_kwargs in vllm_modes(args):
        with tempfile.TemporaryDirectory(prefix="daskllm-vllm-startup-") as tmp:
            env = {**os.environ, "VLLM_CACHE_ROOT": os.path.join(tmp, "vllm"),
                   "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
            cold = start(args, env, engine_kwargs)
            warm = start(args, env, engine_kwargs)
        modes["eager" if cold["enforce_eager"] else "torch.compile"] = {"cold": cold, "warm": warm}
    return {"model": args.model, "backend": "vllm", "threads": args.threads, "modes": modes}


def markdown_vllm(result: dict) -> str:
    modes = result["modes"]
    device = next(iter(modes.values()))["cold"]["device"]
    header = [f"{name}, {state}" for name in modes for state in ("empty compile cache", "warm")]
    lines = [f"Start-up of a vLLM engine for {result['model']!r} on {device} ({result['threads']} threads), "
             "each in a fresh process\n", "| | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]

    def row(label, key, bold=False):
        cells = [f"{m[state][key]:.1f} s" for m in modes.values() for state in ("cold", "warm")]
        if bold:
            label, cells = f"**{label}**", [f"**{c}**" for c in cells]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("`import daskllm`", "import_s")
    row("`EngineSpec(backend=\"vllm\").load()` (vllm imported there)", "engine_s")
    row("to the first token, after the imports", "first_token_s")
    row("the process's start to the first token", "total_s", bold=True)
    row("(the whole process: interpreter start and close included)", "process_s")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    if result.get("backend") == "vllm":
        return markdown_vllm(result)
    cold, warm = result["cold"], result["warm"]
    phases = list(dict.fromkeys([*cold["phases"], *warm["phases"]]))
    lines = [f"Start-up of `TorchEngine({result['model']!r})` on {cold['device']}, each in a fresh process\n",
             "| | empty caches | warm caches |", "|---|---:|---:|"]
    lines += [f"| {name} | {cold['phases'].get(name, 0):.2f} s | {warm['phases'].get(name, 0):.2f} s |"
              for name in phases]
    lines += [f"| **`TorchEngine()` to the first token** | **{cold['first_token_s']:.2f} s** | "
              f"**{warm['first_token_s']:.2f} s** |",
              f"| (the process's imports before it) | {cold['import_s']:.2f} s | {warm['import_s']:.2f} s |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    result = measure(args)
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

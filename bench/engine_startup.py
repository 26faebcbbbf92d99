"""How long the torch engine takes to start: ``TorchEngine(model)`` to its first token, with empty caches and warm.

    python bench/engine_startup.py --model llama-1b                  # on cuda: cold, then warm
    python bench/engine_startup.py --model tiny --device cpu --json startup.json

Each start runs in a fresh process (nothing compiled or loaded in this one counts), both
sharing one new, empty cache directory: the first start finds it empty (the model's recipe is
built, Triton compiles every kernel), the second finds what the first left there
(``DASKLLM_CACHE_DIR``, and ``TRITON_CACHE_DIR`` inside it unless ``--keep-triton-cache``).
Reported per start: the engine's own phases (``TorchEngine.load_phases``: the model's weights
and prepared products, the KV cache, the CUDA graphs with the kernels they compile), the time
from calling ``TorchEngine`` to the first generated token, and the process's import time.
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
    p.add_argument("--device", help="cuda or cpu (default: cuda where available)")
    p.add_argument("--engine-kwargs", default="{}", help="more TorchEngine arguments, as JSON")
    p.add_argument("--keep-triton-cache", action="store_true",
                   help="leave TRITON_CACHE_DIR as it is (default: inside the new cache directory)")
    p.add_argument("--timeout", type=float, default=240, help="seconds each start may take")
    p.add_argument("--json", metavar="PATH", help="write both starts here")
    p.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> dict:
    """One start in this process: the engine, then one prompt's first token."""
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


def start(args, env: dict) -> dict:
    """One start in a fresh process (``--child``), its JSON line back."""
    command = [sys.executable, __file__, CHILD, "--model", args.model, "--engine-kwargs", args.engine_kwargs]
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
    with tempfile.TemporaryDirectory(prefix="daskllm-startup-") as tmp:
        env = {**os.environ, "DASKLLM_CACHE_DIR": os.path.join(tmp, "models")}
        if not args.keep_triton_cache:
            env["TRITON_CACHE_DIR"] = os.path.join(tmp, "models", "triton")
        env.pop("DASK_DASKLLM__MODELS__CACHE_DIR", None)  # the configured directory would win over the variable
        cold = start(args, env)
        warm = start(args, env)
    return {"model": args.model, "cold": cold, "warm": warm}


def markdown(result: dict) -> str:
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

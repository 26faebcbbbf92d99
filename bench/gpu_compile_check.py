"""Compile every Triton kernel the torch engine launches, for a GPU, on a machine without one.

    python bench/gpu_compile_check.py                        # llama-1b's shapes, Hopper (sm_90)
    python bench/gpu_compile_check.py --model llama-8b --arch 80 --json compile.json

A forward pass of the model's shapes (one layer of them: every layer launches the same kernels)
runs on CPU tensors through the Triton backend, with Triton pointed at a stand-in for the CUDA
driver that names the target GPU, inside ``triton_kernels.compile_only``: each launch compiles
its kernel for that GPU (Triton's own compiler and ptxas, as on the GPU itself) and runs
nothing. The steps walked are the engine's: decode steps of 1, 16 and ``--max-seqs`` sequences
(the small ones split over the context), a mixed step, and prefills up to
``--max-tokens``, so every tier of every product's plan is compiled.

Per compiled kernel it reports the instruction its products use (from Triton's GPU IR:
``wgmma`` is Hopper's warp-group MMA, ``mma.sync`` the older one), the shared memory it
needs, and its registers and spills (``cuobjdump`` on the cubin, where Triton ships it). Exit
status 1 if a kernel does not compile, needs more shared memory than the GPU has, or if the
configs of one product's plan do not all use one instruction kind (what keeps a row's bits
independent of its batch: see triton_kernels/matmul.py).

What only a GPU can tell (the bits, the speed) is checked by bench/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("gpu_compile_check compiles for a GPU: unset TRITON_INTERPRET")

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}  # bytes a block may have
SMS = 132  # an H100's or H200's: where decode steps of few sequences split over the context


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b", help="a recipe of daskllm.models (default: llama-1b)")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100/H200) or 80 (A100)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--max-seqs", type=int, default=256, help="the largest decode step (default: 256)")
    p.add_argument("--max-tokens", type=int, default=8192, help="the largest prefill step (default: 8192)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compiler threads")
    p.add_argument("--json", metavar="PATH", help="write every kernel's record here")
    return p.parse_args(argv)


class TargetDriver:
    """What Triton asks the CUDA driver when it compiles, answered for a GPU that is not here."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def one_layer_model(name: str, directory: pathlib.Path):
    """The recipe's shapes with one layer, its weights drawn at load (a dummy-weight recipe)."""
    from daskllm import models

    recipe = dataclasses.replace(models.RECIPES[name], name=f"{name}-compile-check", num_hidden_layers=1,
                                 dummy_weights=True)
    models.RECIPES[recipe.name] = recipe  # dummy_weights() finds the recipe by name
    recipe.build_into(directory)
    return directory


def steps(max_seqs: int, max_tokens: int, block_size: int, max_len: int):
    """(label, StepInput) of the engine's step kinds: decodes, mixed, prefills (tables over fresh blocks)."""
    from daskllm.engines.backends import StepInput

    def step(parts):  # parts: [(new tokens, cached tokens)]
        ids, positions, slots, seqs, rows, block = [], [], [], [], [], 0
        for new, cached in parts:
            total = cached + new
            table = list(range(block, block + -(-total // block_size)))
            block += len(table)
            row = len(ids)
            ids += [7] * new
            positions += range(cached, total)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
            seqs.append((row, new, cached, table))
            rows.append(row + new - 1)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
        return StepInput(as_tensor(ids), as_tensor(positions), as_tensor(slots), seqs, rows), block

    context = min(max_len - 1, 2000)
    kinds = [(f"decode x{b}", [(1, context)] * b) for b in sorted({1, 16, max_seqs})]
    kinds.append(("mixed: 8 decodes + a 1000-token chunk", [(1, context)] * 8 + [(1000, 0)]))
    kinds += [(f"prefill {t}", [(t, 0)]) for t in sorted({16, 256, 2048, max_tokens}) if t <= max_tokens]
    return [(label, *step(parts)) for label, parts in kinds]


def resources(cubin: bytes, cuobjdump: pathlib.Path) -> dict:
    """Registers, spill stores and local memory of a cubin's kernel, from cuobjdump (empty if it is not shipped)."""
    if not cuobjdump.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return {"registers": found.get("REG"), "stack_bytes": found.get("STACK"), "local_bytes": found.get("LOCAL")}


def mma(ttgir: str) -> str:
    versions = sorted(set(re.findall(r"nvidia_mma<\{versionMajor = (\d)", ttgir)))
    return "+".join({"3": "wgmma", "2": "mma.sync"}.get(v, f"mma v{v}") for v in versions) or "none (no tensor cores)"


def check(args) -> dict:
    from daskllm.engines import triton_kernels
    from daskllm.engines.llama import LlamaModel

    compiled = []

    def record(*, key, fn, compile, **_):
        compiled.append((fn.jit_function, key, compile))

    driver.set_active(TargetDriver(args.arch))
    knobs.runtime.jit_post_compile_hook = record
    dtype = getattr(torch, args.dtype)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaModel(one_layer_model(args.model, pathlib.Path(tmp)), dtype=dtype, backend="triton")
    block_size = 16
    walked = steps(args.max_seqs, args.max_tokens, block_size, model.config.max_model_len)
    model.allocate_cache(max(blocks for _, _, blocks in walked), block_size)
    backend = model.backend
    # What an engine plans with while it compiles (backends.TritonBackend.prepare), on a GPU of SMS SMs.
    backend.layout = triton_kernels.fast_layout(model.config.num_heads // model.config.num_kv_heads)
    backend.sms = SMS
    with torch.inference_mode(), triton_kernels.compile_only(args.workers):
        for label, step, _ in walked:
            model.run(step.input_ids, step.positions, step.slots, backend.plan(step, block_size),
                      torch.tensor(step.logit_rows))
    seconds = time.perf_counter() - started
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    limit = SHARED_MEMORY.get(args.arch)
    kernels, seen = [], {}
    for fn, key, info in compiled:
        kernel = fn.device_caches[0][0][key]
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        names = [p.name for p in fn.params]
        constants = {names[k[0]] if isinstance(k, tuple) else k: v for k, v in info["constants"].items()}
        shared = kernel.metadata.shared
        record = {"kernel": fn.__name__, "constants": {k: v for k, v in constants.items() if k.isupper()},
                  "num_warps": info["num_warps"], "num_stages": info["num_stages"],
                  "instruction": mma(kernel.asm["ttgir"]), "shared_bytes": shared,
                  "fits": limit is None or shared <= limit, **resources(kernel.asm["cubin"], cuobjdump)}
        # Variants differing only in what Triton specializes on (alignment, sizes divisible by 16): one row.
        same = json.dumps({k: v for k, v in record.items() if k not in ("registers", "stack_bytes", "local_bytes")},
                          sort_keys=True, default=str)
        if same in seen:
            seen[same]["variants"] += 1
        else:
            seen[same] = record | {"variants": 1}
            kernels.append(seen[same])
    return {"model": args.model, "arch": args.arch, "dtype": args.dtype, "seconds": seconds,
            "steps": [label for label, _, _ in walked], "kernels": kernels, "problems": problems(kernels, args)}


def problems(kernels: list[dict], args) -> list[str]:
    out = [f"{k['kernel']} {k['constants']}: needs {k['shared_bytes']} bytes of shared memory" for k in kernels
           if not k["fits"]]
    by_plan = collections.defaultdict(set)  # a plan's configs share block_k and precision
    for k in kernels:
        if k["kernel"] == "_matmul_kernel":
            by_plan[(k["constants"].get("BLOCK_K"), k["constants"].get("PRECISION"))].add(k["instruction"])
    out += [f"matmul configs with block_k {bk} use {sorted(kinds)}: one plan must use one instruction kind"
            for (bk, _), kinds in by_plan.items() if len(kinds) > 1]
    return out


def markdown(report: dict) -> str:
    lines = [f"Triton kernels of {report['model']} ({report['dtype']}) compiled for sm_{report['arch']} "
             f"in {report['seconds']:.0f} s, walking: {', '.join(report['steps'])}\n",
             "| kernel | constants | warps | stages | instruction | shared KB | registers | spilled bytes | variants |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for k in sorted(report["kernels"], key=lambda k: (k["kernel"], str(k["constants"]))):
        constants = ", ".join(f"{name}={value}" for name, value in k["constants"].items() if name != "WIDEN")
        lines.append(f"| {k['kernel']} | {constants} | {k['num_warps']} | {k['num_stages']} | {k['instruction']} | "
                     f"{k['shared_bytes'] / 1024:.1f}{'' if k['fits'] else ' (too much)'} | "
                     f"{k.get('registers', '?')} | {k.get('stack_bytes', '?')} | {k['variants']} |")
    lines.append("")
    lines += [f"- **problem**: {p}" for p in report["problems"]] or ["- no problems"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    report = check(args)
    print(markdown(report))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

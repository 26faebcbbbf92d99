"""Benchmark of the CPU engines side by side on one model, measured directly (no Dask).

    python bench/engine.py --json out.json          # smollm2 on torch, llamacpp, vllm and transformers
    python bench/engine.py --engines torch,llamacpp --batch-sizes 1 8 32 64 --repeats 5
    python bench/engine.py --served                 # also each engine as a server uses it (cache kept)
    python bench/engine.py --quick                  # smoke run: tiny, torch + transformers, B=1 and 8

The engines, all on the same model (``--model``, default ``smollm2``) with ``--threads``
threads each (default: all cores):

* ``torch``: daskllm's embedded engine, ``EngineSpec(model, backend="torch").load(num_threads=T)``
  (float32, paged KV cache, prefix cache, continuous batching).
* ``llamacpp``: daskllm's llama.cpp engine, ``EngineSpec(model, backend="llamacpp").load(...)``.
  It runs the model's GGUF file (``smollm2`` ships one, quantized), so only models with a GGUF
  file have it; it is skipped, with the reason printed, where llama-cpp-python is not installed
  (``make cpu``) or the model has none (``tiny``, ``small``).
* ``vllm``: daskllm's vLLM engine, ``EngineSpec(model, backend="vllm").load(num_threads=T)``
  (on CPU vLLM's CPU build, with 32-token KV blocks, which it requires, and daskllm's CPU
  defaults: float32, eager, no chunked prefill). Skipped, with the reason, where vllm does not
  import (it lives in ``.venv-vllm``: ``make vllm``).
* ``transformers``: plain ``AutoModelForCausalLM.from_pretrained(resolve(model), dtype=float32)``
  and ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`` on a left-padded batch
  (pad token = eos), ``torch.set_num_threads(T)``: the baseline users pick today. It has no
  prefix cache.

What it measures, per engine (every prompt is made of random token ids in [100, vocab) from a
seeded RNG, identical for every engine):

* prefill tokens/s: ``--prefill-batch`` distinct fresh prompts of ``--prompt-tokens`` tokens,
  ``max_tokens=1``; total prompt tokens / wall time. For the daskllm engines the run checks that
  the prefix cache did not help (``num_cached_tokens == 0``).
* decode tokens/s at each of ``--batch-sizes``: B distinct prompts of ``--short-prompt-tokens``
  tokens, ``--decode-tokens`` new tokens each (``ignore_eos``; transformers: ``min_new_tokens``);
  total generated tokens / wall time. The wall time includes the one prefill step of the short
  prompts, so this slightly understates the pure decode rate. The default is 32 tokens, not 64:
  with 64, a 3-repetition run on a busy 2-core machine took over 20 minutes, most of it at B=64.
* time to first token (``max_tokens=1``) of a fresh ``--prefix-tokens`` prefix + a
  ``--suffix-tokens`` suffix: cold, and warm (a second fresh prefix, after
  ``engine.prefill(prefix)``), and their ratio. Transformers has no prefix cache: its warm row
  is its cold (full-prompt) time, marked so in the table.
* batch invariance (daskllm engines; informative, never a failure): 16 chat prompts (the
  model's chat template over 16 short questions), ``--agreement-tokens`` greedy tokens
  (``ignore_eos``), each run alone and then all 16 together: how many of the 16 outputs are
  identical, and the mean length of the common prefix. The torch engine is batch-invariant by
  construction (16/16); llama.cpp's quantized kernels are chosen by batch size, so it may not be.

Every repetition runs every measurement on every engine once, interleaved (the engine order
rotates between repetitions), and the median of ``--repeats`` is reported, because the machine
is shared and noisy; ratios between two numbers are medians of per-repetition ratios. The
daskllm engines' prefix caches are emptied (``reset_prefix_cache()``, untimed) before each
measurement, so every repetition starts from the same state. The markdown table is printed at
the end; ``--json`` keeps every raw number, the engine counters of each measurement and the
machine information.

``--served`` adds a column per daskllm engine measured as a server uses it: after other work,
its prefix cache never reset. Before each repetition's served measurements the engine runs
``--served-history`` distinct prompts (``--short-prompt-tokens`` tokens, ``--decode-tokens``
new tokens each, untimed), and the measurements follow one another with whatever they leave
in the cache. Prompts are still fresh, so the cache can only help where the fresh column's
does (the warm TTFT); what the column shows is what a full cache costs the engine.

Earlier versions also timed 32 requests submitted together against one after another on the
torch engine; the decode rows at B=1 and B=32 now tell the same (and across engines), so that
measurement is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
from machine import log
from machine import machine_info as shared_machine_info

from daskllm import models
from daskllm.engines import EngineSpec, compute
from daskllm.engines.protocol import SamplingParams

ENGINES = ("torch", "llamacpp", "vllm", "transformers")
SERVED = " served"  # the column of an engine measured with its prefix cache kept (--served)
FIRST_TOKEN = 100  # prompt ids start here: clear of every tokenizer's special and byte tokens
QUESTIONS = [
    "What is the capital of France?",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "What does a compiler do?",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level?",
    "Suggest a name for a pet goldfish.",
    "What is a prime number?",
    "How do bees make honey?",
    "Translate 'good morning' into Spanish.",
    "What is the difference between weather and climate?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="recipe name or model directory (default: smollm2)")
    p.add_argument("--engines", default=None,
                   help=f"comma-separated, of {','.join(ENGINES)} (default: all; llamacpp where it can run)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64], help="decode batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every measurement; the median is reported")
    p.add_argument("--prefill-batch", type=int, default=4, help="prompts in the prefill measurement")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length for the prefill measurement")
    p.add_argument("--short-prompt-tokens", type=int, default=16, help="prompt length for the decode measurement")
    p.add_argument("--decode-tokens", type=int, default=32,
                   help="new tokens per prompt in the decode measurement")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix length for the TTFT measurement")
    p.add_argument("--suffix-tokens", type=int, default=16, help="suffix length after the prefix")
    p.add_argument("--agreement-tokens", type=int, default=32, help="greedy tokens in the batch-invariance check")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every engine (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt RNG")
    p.add_argument("--served", action="store_true",
                   help="also measure each daskllm engine as a server uses it: after other work, cache kept")
    p.add_argument("--served-history", type=int, default=64,
                   help="finished requests run (untimed) before each repetition's served measurements")
    p.add_argument("--json", metavar="PATH", help="write all raw numbers and machine info here")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny, torch + transformers, batch sizes 1 and 8, short requests, one repetition")
    args = p.parse_args(argv)
    if args.quick:
        args.model = "tiny"
        args.engines = args.engines or "torch,transformers"
        args.batch_sizes = [1, 8]
        args.repeats = 1
        args.prefill_batch = 2
        args.prompt_tokens = 64
        args.decode_tokens = 8
        args.prefix_tokens = 128
        args.agreement_tokens = 8
    if args.engines is None:
        args.engines = list(ENGINES)
    else:
        args.engines = list(dict.fromkeys(e.strip() for e in args.engines.split(",") if e.strip()))
        unknown = [e for e in args.engines if e not in ENGINES]
        if unknown or not args.engines:
            p.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    for name in ("repeats", "prefill_batch", "prompt_tokens", "short_prompt_tokens", "decode_tokens",
                 "prefix_tokens", "suffix_tokens", "agreement_tokens", "threads", "served_history"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batch_sizes):
        p.error("--batch-sizes must be >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


def machine_info() -> dict:
    import transformers

    extra = {"torch_interop_threads": torch.get_num_interop_threads(), "transformers": transformers.__version__}
    with contextlib.suppress(ImportError):
        import llama_cpp

        extra["llama_cpp_python"] = llama_cpp.__version__
    from daskllm.engines.vllm import unavailable_reason as no_vllm

    if no_vllm() is None:
        import vllm

        extra["vllm"] = vllm.__version__
    return shared_machine_info(**extra)


class Prompts:
    """Fresh random token-id prompts: distinct from their first token, so nothing is cached."""

    def __init__(self, seed: int, vocab_size: int):
        if vocab_size <= FIRST_TOKEN:
            raise ValueError(f"vocabulary of {vocab_size} tokens: too small for prompts of ids >= {FIRST_TOKEN}")
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size

    def make(self, n: int, length: int) -> list[list[int]]:
        return self.rng.integers(FIRST_TOKEN, self.vocab_size, size=(n, length)).tolist()


def stats_delta(before, after) -> dict:
    keys = ("steps", "batched_sequences", "prefill_tokens_computed", "prefill_tokens_cached", "decode_tokens",
            "busy_seconds", "preemptions", "evicted_blocks")
    d = {k: getattr(after, k) - getattr(before, k) for k in keys}
    d["mean_batch_size"] = d["batched_sequences"] / d["steps"] if d["steps"] else 0.0
    return d


def checkpoint_parameters(model_dir) -> int:
    """Parameters stored in a model directory's safetensors files (a tied head counts once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            total += sum(int(np.prod(st.get_slice(k).get_shape())) for k in st.keys())
    return total


class DaskllmRunner:
    """A daskllm engine (the Engine protocol): torch, llama.cpp or vLLM."""

    has_prefix_cache = True

    def __init__(self, backend: str, model: str, threads: int):
        self.name = backend
        options = {"num_threads": threads}
        if backend == "vllm":
            from daskllm.engines.vllm import CPU_BLOCK_MULTIPLE, on_cpu

            if on_cpu():  # vLLM's CPU attention takes blocks of 32 tokens (docs/vllm.md)
                options["block_size"] = CPU_BLOCK_MULTIPLE
        start = time.perf_counter()
        self.engine = EngineSpec(model, backend=backend).load(**options)
        self.load_s = time.perf_counter() - start
        self.vocab_size = self.engine.vocab_size
        self.model_dir = models.resolve(model) if backend == "torch" else None

    def run(self, prompts, max_tokens: int) -> dict:
        """All prompts together (one ``generate``: they join the same engine step)."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        before = self.engine.stats()
        start = time.perf_counter()
        completions = self.engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": [c.token_ids for c in completions],
                "num_cached_tokens": [c.num_cached_tokens for c in completions],
                "stats": stats_delta(before, self.engine.stats())}

    def prefill(self, prompt) -> dict:
        start = time.perf_counter()
        handle = self.engine.prefill(prompt)
        return {"prefill_call_s": time.perf_counter() - start, "prefill_handle_tokens": handle.num_tokens}

    def reset(self) -> None:
        self.engine.reset_prefix_cache()

    def chat_prompt(self, question: str) -> str:
        return self.engine.apply_chat_template([{"role": "user", "content": question}])

    def info(self) -> dict:
        e = self.engine
        scheduler = getattr(e, "_scheduler", None)
        out = {"engine": type(e).__name__, "load_s": self.load_s, "block_size": e.block_size,
               "kv_cache_tokens": e.cache_state().num_blocks * e.block_size,
               "max_num_seqs": getattr(e, "max_num_seqs", None) or getattr(scheduler, "max_num_seqs", None),
               "max_num_batched_tokens": (getattr(e, "max_num_batched_tokens", None)
                                          or getattr(scheduler, "max_num_batched_tokens", None))}
        if getattr(e, "path", None) is not None and e.path.suffix == ".gguf":  # llama.cpp: the file it runs
            out.update(gguf=e.path.name, gguf_bytes=e.path.stat().st_size)
        vllm_config = getattr(getattr(e, "_engine", None), "vllm_config", None)
        if vllm_config is not None:  # the vLLM engine's
            import vllm

            out.update(vllm=vllm.__version__, dtype=str(vllm_config.model_config.dtype).replace("torch.", ""),
                       enforce_eager=vllm_config.model_config.enforce_eager)
        if hasattr(e, "model") and hasattr(e.model, "dtype"):  # the torch engine's own model
            out.update(parameters=checkpoint_parameters(self.model_dir), dtype=str(e.model.dtype).replace("torch.", ""),
                       device=str(e.model.device))
        return out

    def close(self) -> None:
        self.engine.close()


class TransformersRunner:
    """Plain transformers: ``generate`` on a left-padded batch, no prefix cache."""

    has_prefix_cache = False
    name = "transformers"

    def __init__(self, model: str, threads: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # generation-config notes on every call
        compute.set_num_threads(threads)
        start = time.perf_counter()
        path = models.resolve(model)
        # On the thread the engines compute on: a second computing thread would slow both
        # (daskllm/engines/compute.py).
        self.model = compute.run(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.load_s = time.perf_counter() - start
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.vocab_size = self.model.config.vocab_size

    def run(self, prompts, max_tokens: int) -> dict:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eos, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        start = time.perf_counter()
        out = compute.run(self._generate, ids, mask, max_tokens)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": out[:, width:].tolist()}

    def _generate(self, ids, mask, max_tokens: int):
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                       min_new_tokens=max_tokens, pad_token_id=self.eos)

    def info(self) -> dict:
        return {"engine": type(self.model).__name__, "load_s": self.load_s,
                "parameters": sum(p.numel() for p in self.model.parameters()),
                "dtype": str(self.model.dtype).replace("torch.", ""), "device": str(self.model.device),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}

    def close(self) -> None:
        del self.model


def load_engines(args) -> tuple[dict, dict]:
    """The runners that can run here, and why the others were skipped."""
    runners, skipped = {}, {}
    for name in args.engines:
        if name == "llamacpp":
            from daskllm.engines.llamacpp import unavailable_reason

            reason = unavailable_reason()
            if reason is None:
                try:
                    models.resolve_gguf(args.model)
                except (models.ModelNotFoundError, OSError) as exc:
                    reason = f"model {args.model!r} has no GGUF file ({exc})"
            if reason:
                skipped[name] = reason
                log(f"skipping llamacpp: {reason}")
                continue
        if name == "vllm":
            from daskllm.engines.vllm import unavailable_reason

            if reason := unavailable_reason():
                skipped[name] = reason
                log(f"skipping vllm: {reason}")
                continue
        log(f"loading {args.model} on {name} ...")
        runners[name] = TransformersRunner(args.model, args.threads) if name == "transformers" else \
            DaskllmRunner(name, args.model, args.threads)
    torch.set_num_threads(args.threads)  # the torch engine sets it too: the same for every engine
    return runners, skipped


def measure_prefill(runner, prompts: Prompts, batch: int, length: int) -> dict:
    run = runner.run(prompts.make(batch, length), 1)
    cached = sum(run.get("num_cached_tokens", ()))
    if cached:
        raise RuntimeError(f"{runner.name}: prefill prompts were meant to be uncached, but {cached} tokens came "
                           "from the cache")
    tokens = batch * length
    return {"batch": batch, "prompt_tokens": tokens, "seconds": run["seconds"],
            "tokens_per_s": tokens / run["seconds"], "stats": run.get("stats")}


def measure_decode(runner, prompts: Prompts, batch: int, prompt_len: int, max_tokens: int) -> dict:
    run = runner.run(prompts.make(batch, prompt_len), max_tokens)
    generated = sum(len(t) for t in run["tokens"])
    if generated != batch * max_tokens:
        raise RuntimeError(f"{runner.name}: {generated} tokens generated, expected {batch} x {max_tokens}")
    return {"batch": batch, "generated_tokens": generated, "seconds": run["seconds"],
            "tokens_per_s": generated / run["seconds"], "ms_per_step": 1000 * run["seconds"] / max_tokens,
            "stats": run.get("stats")}


def measure_ttft(runner, prompts: Prompts, prefix_len: int, suffix_len: int) -> dict:
    """Cold: a fresh prefix + suffix. Warm: another fresh prefix, prefilled first (daskllm engines)."""
    cold_prompt = prompts.make(1, prefix_len)[0] + prompts.make(1, suffix_len)[0]
    cold = runner.run([cold_prompt], 1)
    out = {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len, "cold_ttft_s": cold["seconds"]}
    if not runner.has_prefix_cache:
        return out
    warm_prefix = prompts.make(1, prefix_len)[0]
    out.update(runner.prefill(warm_prefix))
    warm = runner.run([warm_prefix + prompts.make(1, suffix_len)[0]], 1)
    out.update(warm_ttft_s=warm["seconds"], speedup=cold["seconds"] / warm["seconds"],
               cold_num_cached_tokens=cold["num_cached_tokens"][0], warm_num_cached_tokens=warm["num_cached_tokens"][0])
    return out


def measure_agreement(runner, max_tokens: int) -> dict:
    """Greedy tokens of 16 chat prompts, each alone and then all together: identical?"""
    prompts = [runner.chat_prompt(q) for q in QUESTIONS]
    alone = []
    for p in prompts:
        runner.reset()
        alone.append(runner.run([p], max_tokens)["tokens"][0])
    runner.reset()
    together = runner.run(prompts, max_tokens)["tokens"]
    common = [_common_prefix(a, b) for a, b in zip(alone, together)]
    return {"prompts": len(prompts), "max_tokens": max_tokens,
            "identical": sum(a == b for a, b in zip(alone, together)),
            "mean_common_prefix": statistics.mean(common), "common_prefix": common,
            "alone": alone, "together": together}


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def warm_up(runner, prompts: Prompts, args) -> None:
    """One pass over the shapes the benchmark uses, so first-call costs are not timed."""
    runner.run(prompts.make(args.prefill_batch, args.prompt_tokens), 1)
    runner.run(prompts.make(max(args.batch_sizes), args.short_prompt_tokens), 2)
    runner.run(prompts.make(1, args.prefix_tokens + args.suffix_tokens), 1)


def columns(runners: dict, served: bool) -> list[tuple[str, str, bool]]:
    """The table's columns: (label, engine, served), an engine's served one beside its fresh one."""
    out = []
    for name, runner in runners.items():
        out.append((name, name, False))
        if served and runner.has_prefix_cache:
            out.append((name + SERVED, name, True))
    return out


def bench(runners: dict, args) -> dict:
    vocab = min(r.vocab_size for r in runners.values())
    prompts = Prompts(args.seed, vocab)
    cols = columns(runners, args.served)
    results = {label: {"prefill": [], "decode": [], "ttft": []} for label, _, _ in cols}
    for name, runner in runners.items():
        log(f"warming up {name} ...")
        warm_up(runner, prompts, args)

    def each(rep, key, measure, *a, served=False):
        group = [(label, name) for label, name, s in cols if s == served]
        for label, name in group[rep % len(group):] + group[:rep % len(group)]:  # rotated: none always first
            runner = runners[name]
            if runner.has_prefix_cache and not served:
                runner.reset()
            results[label][key].append({"rep": rep, **measure(runner, prompts, *a)})

    for rep in range(args.repeats):
        t0 = time.perf_counter()
        for served in (False, True) if args.served else (False,):
            if served:  # a server's history: finished requests left in the cache, untimed
                for _, name, s in cols:
                    if s:
                        runners[name].run(prompts.make(args.served_history, args.short_prompt_tokens),
                                          args.decode_tokens)
            each(rep, "prefill", measure_prefill, args.prefill_batch, args.prompt_tokens, served=served)
            for b in args.batch_sizes:
                each(rep, "decode", measure_decode, b, args.short_prompt_tokens, args.decode_tokens, served=served)
            each(rep, "ttft", measure_ttft, args.prefix_tokens, args.suffix_tokens, served=served)
        log(f"  repetition {rep + 1}/{args.repeats} took {time.perf_counter() - t0:.1f}s")
    for name, runner in runners.items():
        if runner.has_prefix_cache:
            log(f"batch invariance of {name} ...")
            results[name]["agreement"] = measure_agreement(runner, args.agreement_tokens)
            results[name]["engine_stats"] = runner.engine.stats().as_dict()
    for label, name, _ in cols:  # a served column's engine is its fresh column's
        results[label]["info"] = runners[name].info() if label == name else results[name]["info"]
    return {"vocab_size_used": vocab, "engines": results}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(r: dict) -> dict:
    s = {"prefill_tokens_per_s": _median(x["tokens_per_s"] for x in r["prefill"]),
         "decode_tokens_per_s": {}, "decode_ms_per_step": {}}
    for b in sorted({x["batch"] for x in r["decode"]}):
        s["decode_tokens_per_s"][b] = _median(x["tokens_per_s"] for x in r["decode"] if x["batch"] == b)
        s["decode_ms_per_step"][b] = _median(x["ms_per_step"] for x in r["decode"] if x["batch"] == b)
    t = r["ttft"]
    s["cold_ttft_s"] = _median(x["cold_ttft_s"] for x in t)
    s["warm_ttft_s"] = _median(x.get("warm_ttft_s") for x in t)
    s["prefix_speedup"] = _median(x.get("speedup") for x in t)
    if "agreement" in r:
        s["cold_num_cached_tokens"] = sorted({x["cold_num_cached_tokens"] for x in t})
        s["warm_num_cached_tokens"] = sorted({x["warm_num_cached_tokens"] for x in t})
        a = r["agreement"]
        s["agreement"] = {k: a[k] for k in ("prompts", "max_tokens", "identical", "mean_common_prefix")}
    return s


def decode_ratio(results: dict, num: tuple[str, int], den: tuple[str, int]) -> float | None:
    """Median over repetitions of decode tokens/s of ``num`` (engine, batch) over ``den``'s."""
    def by_rep(engine, batch):
        if engine not in results:
            return {}
        return {x["rep"]: x["tokens_per_s"] for x in results[engine]["decode"] if x["batch"] == batch}

    a, b = by_rep(*num), by_rep(*den)
    return _median(a[rep] / b[rep] for rep in a if rep in b)


def ratios(results: dict, args) -> list[dict]:
    """The ratios the engines are judged by (issue 22), where both sides were measured."""
    big = 32 if 32 in args.batch_sizes else max(args.batch_sizes)
    out = []

    def add(name, value, target=None):
        if value is not None:
            out.append({"ratio": name, "value": value, "target": target,
                        "met": None if target is None else value >= target})

    add(f"llamacpp decode@{big} / decode@1", decode_ratio(results, ("llamacpp", big), ("llamacpp", 1)), 3.0)
    add(f"torch decode@{big} / decode@1", decode_ratio(results, ("torch", big), ("torch", 1)))
    add(f"vllm decode@{big} / decode@1", decode_ratio(results, ("vllm", big), ("vllm", 1)))
    for engine in ("llamacpp", "vllm", "torch"):
        if engine in results:
            add(f"{engine} TTFT cold / warm prefix", results[engine]["summary"]["prefix_speedup"], 5.0)
    for engine in ("llamacpp", "vllm"):
        for b in (1, big):
            add(f"{engine} / torch decode@{b}", decode_ratio(results, (engine, b), ("torch", b)))
        add(f"{engine} served / fresh decode@1", decode_ratio(results, (engine + SERVED, 1), (engine, 1)))
    for engine in ("torch", "llamacpp"):
        for b in (1, big):
            add(f"{engine} / transformers decode@{b}", decode_ratio(results, (engine, b), ("transformers", b)))
    return out


def markdown(report: dict, args) -> str:
    results = report["engines"]
    names = list(results)
    ms = lambda s: f"{1000 * s:,.1f} ms"  # noqa: E731
    lines = [f"Engines side by side: model {args.model}, {args.threads} threads each, median of "
             f"{_plural(args.repeats, 'repetition')} (interleaved)\n",
             "| measurement | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]

    def row(label, cell, of="summary"):
        lines.append(f"| {label} | " + " | ".join(cell(results[n][of]) for n in names) + " |")

    row(f"prefill tokens/s ({args.prefill_batch} x {args.prompt_tokens}-token prompts)",
        lambda s: f"{s['prefill_tokens_per_s']:,.0f}")
    for b in args.batch_sizes:
        row(f"decode tokens/s, B={b} ({args.decode_tokens} tokens each)",
            lambda s, b=b: f"{s['decode_tokens_per_s'][b]:,.0f}")
    row(f"TTFT cold ({args.prefix_tokens}-token prefix + {args.suffix_tokens})", lambda s: ms(s["cold_ttft_s"]))
    row("TTFT warm (after `prefill(prefix)`)",
        lambda s: ms(s["warm_ttft_s"]) if s["warm_ttft_s"] is not None else f"{ms(s['cold_ttft_s'])} (full prompt: "
                                                                            "no prefix cache)")
    row("TTFT cold / warm", lambda s: f"{s['prefix_speedup']:.1f}x" if s["prefix_speedup"] is not None else "n/a")
    row("num_cached_tokens cold / warm",
        lambda s: f"{_join(s['cold_num_cached_tokens'])} / {_join(s['warm_num_cached_tokens'])}"
        if "agreement" in s else "n/a")
    row(f"batched = alone (16 chat prompts x {args.agreement_tokens} greedy tokens)",
        lambda s: f"{s['agreement']['identical']}/16, common prefix {s['agreement']['mean_common_prefix']:.1f}"
        if "agreement" in s else "n/a")
    row("load time", lambda i: f"{i['load_s']:.1f} s", of="info")
    if report["ratios"]:
        lines += ["", "Ratios (medians of per-repetition ratios)\n", "| ratio | value | wanted |", "|---|---:|---|"]
        for r in report["ratios"]:
            wanted = "" if r["target"] is None else f">= {r['target']:.0f}x ({'met' if r['met'] else 'NOT met'})"
            lines.append(f"| {r['ratio']} | {r['value']:.2f}x | {wanted} |")
    lines.append("")
    if any(n.endswith(SERVED) for n in names):
        lines.append(f"- served: the same engine after {args.served_history} finished requests "
                     f"({args.short_prompt_tokens} + {args.decode_tokens} tokens each) and the measurements "
                     "before, its prefix cache never reset; the other columns reset it before each measurement.")
    for n in names:
        if n.endswith(SERVED):
            continue
        i = results[n]["info"]
        bits = [i["engine"]]
        if "parameters" in i:
            bits.append(f"{i['parameters'] / 1e6:.1f}M parameters, {i['dtype']} on {i['device']}")
        if "gguf" in i:
            bits.append(f"{i['gguf']} ({i['gguf_bytes'] / 2**20:.0f} MiB)")
        if "vllm" in i:
            bits.append(f"vLLM {i['vllm']}, {i['dtype']}, {'eager' if i['enforce_eager'] else 'torch.compile'}")
        if "block_size" in i:
            bits.append(f"block size {i['block_size']}, max-num-batched-tokens {i['max_num_batched_tokens']}, "
                        f"max-num-seqs {i['max_num_seqs']}, KV cache {i['kv_cache_tokens']} tokens")
        if i.get("attn_implementation"):
            bits.append(f"attention {i['attn_implementation']}, left-padded batch, no prefix cache")
        lines.append(f"- {n}: " + "; ".join(bits) + ".")
    for n, reason in report["skipped"].items():
        lines.append(f"- {n}: skipped: {reason}")
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("daskllm").setLevel(logging.WARNING)
    started = time.perf_counter()
    load_before = os.getloadavg()
    runners, skipped = load_engines(args)
    if not runners:
        log("no engine can run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
        return 1
    info = machine_info()
    log(f"torch {info['torch']}, {info['torch_threads']} threads on {info['cpu_count']} CPUs ({info['cpu_model']})")
    try:
        report = bench(runners, args)
    finally:
        for runner in runners.values():
            runner.close()
    for r in report["engines"].values():
        r["summary"] = summarize(r)
    report["skipped"] = skipped
    report["ratios"] = ratios(report["engines"], args)
    total_s = time.perf_counter() - started
    table = markdown(report, args)
    print(table)
    print(f"\ntotal {total_s:.0f}s; torch {info['torch']}, {args.threads} threads, {info['cpu_count']} CPUs; "
          f"load average before/after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}")
    if args.json:
        payload = {"command": " ".join(["python", *sys.argv]), "args": vars(args), "machine": info,
                   "load_average_before": load_before, "load_average_after": os.getloadavg(),
                   "total_seconds": total_s, **report, "markdown": table}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engines' best measured per-token costs, on this worker: what a cost preview's time
estimate and a benchmark's ideal time are computed from.

:func:`calibrate` times the resident engine on fresh random prompts (nothing in the prefix
cache matches) and keeps the result in this process, where :func:`measured` reads it
without touching the engine.
"""

from __future__ import annotations

import os
import random
import time

from daskllm.engines import SamplingParams
from daskllm.worker.host import get_engine

# model -> {"prefill_s_per_token", "decode_s_per_token"}: this worker's best measurement.
MEASURED: dict[str, dict[str, float]] = {}


def calibrate(model: str, prefill_prompts: int = 16, prompt_tokens: int = 256, decode_seqs: int = 64,
              decode_tokens: int = 24, dask_worker=None) -> dict:
    """Seconds per prefill token (a big batch of fresh prompts) and per decode token (a full
    batch of sequences continuing those prompts), on this worker's engine: the best it does."""
    engine = get_engine(model)
    rng = random.Random()  # seeded afresh: a second calibration must not find the first one's prompts cached

    def fresh(n: int) -> list[int]:  # random ids: nothing in the prefix cache matches
        return [0] + [rng.randrange(10, 16000) for _ in range(n - 1)]

    prompts = [fresh(prompt_tokens) for _ in range(prefill_prompts)]
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1))
    prefill = (time.perf_counter() - start) / (prefill_prompts * prompt_tokens)
    # Each decoding sequence is a prompt just computed plus a token of its own: the prompts are
    # read from the prefix cache, so the first step computes about a token per sequence, as a
    # decode step does, at a table job's context length. What an engine computes all the same
    # (no prefix cache) is taken out at the prefill cost.
    continued = [prompts[i % len(prompts)] + [rng.randrange(10, 16000)] for i in range(decode_seqs)]
    start = time.perf_counter()
    done = engine.generate(continued, SamplingParams(max_tokens=decode_tokens, ignore_eos=True))
    computed = sum(c.num_prompt_tokens - c.num_cached_tokens for c in done)
    decode = max(0.0, time.perf_counter() - start - computed * prefill) / (decode_seqs * decode_tokens)
    cost = {"prefill_s_per_token": prefill, "decode_s_per_token": decode}
    best = MEASURED.get(model)
    MEASURED[model] = cost if best is None else {k: min(v, best[k]) for k, v in cost.items()}
    return cost


def measured(dask_worker=None) -> dict[str, dict[str, float]]:
    """What :func:`calibrate` measured in this process, per model (empty: nothing yet)."""
    return dict(MEASURED)

"""Next-token choice: greedy, or temperature / top-p sampling from a per-request generator.

Each request owns its generator, seeded once, so a seeded request draws the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import secrets

import torch

from daskllm.engines.protocol import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           allowed: torch.Tensor | None = None) -> int:
    """One token from one row of logits; ``allowed`` (a bool mask over the vocabulary, from a
    grammar) rules out every other token before the choice."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if params.allowed_token_ids:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        logits = masked
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (always at least the top token).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))

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


def _masked(logits: torch.Tensor, params: SamplingParams, allowed: torch.Tensor | None) -> torch.Tensor:
    """The logits with every token the grammar (``allowed``, a bool mask over the vocabulary) or
    ``params.allowed_token_ids`` rules out set to -inf."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if params.allowed_token_ids:
        ids = torch.tensor(params.allowed_token_ids, dtype=torch.long)
        masked = torch.full_like(logits, float("-inf"))
        masked[ids] = logits[ids]
        logits = masked
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           allowed: torch.Tensor | None = None) -> int:
    """One token from one row of logits; ``allowed`` (a bool mask over the vocabulary, from a
    grammar) rules out every other token before the choice."""
    logits = _masked(logits, params, allowed)
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(_probs(logits, params), 1, generator=generator))


def logprobs(logits: torch.Tensor, params: SamplingParams, token: int,
             allowed: torch.Tensor | None = None) -> tuple[float, dict[int, float]]:
    """The log-probability of ``token`` under the distribution :func:`sample` draws from (for
    greedy decoding, the softmax of the masked logits at temperature 1), and the
    ``params.logprobs`` likeliest tokens' (token id -> log-probability)."""
    logits = _masked(logits, params, allowed)
    if params.greedy:
        logp = torch.log_softmax(logits.double(), dim=-1)
    else:
        probs = _probs(logits, params)
        logp = torch.log(probs / probs.sum())
    top = {}
    if params.logprobs:
        values, ids = torch.topk(logp, min(params.logprobs, logp.numel()))
        top = {int(i): float(v) for v, i in zip(values, ids) if v > float("-inf")}
    return float(logp[token]), top


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling weights (top-p leaves them unnormalized: multinomial draws as it always did)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        # Stable: among tied tokens (common with 16-bit logits) the lowest id comes first, as in argmax.
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        # Keep the smallest set whose mass reaches top_p (always at least the top token).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs

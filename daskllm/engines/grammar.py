"""Grammar-constrained decoding with llguidance (the library behind vLLM's "guidance" backend).

One :class:`Grammars` per engine: it wraps the engine's tokenizer once (about a second) and
compiles each distinct constraint once; every request gets a copy of the compiled matcher,
advanced with each token it accepts. Before a constrained request's next token is chosen,
its logits outside the grammar's allowed set are masked to -inf: the end-of-sequence token
is allowed only where the grammar accepts, so the output always parses unless it is cut
by ``max_tokens``.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Iterable

import llguidance
import numpy as np
import torch

from daskllm.engines.protocol import RequestError, StructuredOutput


class Grammars:
    """Matchers for one tokenizer, compiled once per constraint."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        # What llguidance.hf.from_tokenizer does, without it: importing that module reads
        # transformers' lazy attributes, which races with a worker's other threads importing them.
        rust = copy.copy(hf_tokenizer.backend_tokenizer)
        rust.no_padding()
        rust.no_truncation()
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(rust.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._lock = threading.Lock()  # requests are prepared on many task threads
        self._compiled = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, constraint.grammar())
        if matcher.is_error():
            raise RequestError(f"structured {constraint.kind}: {matcher.get_error()}")
        return matcher

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (a copy of the compiled one)."""
        with self._lock:
            return self._compiled(constraint).deep_copy()


def allowed(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """The tokens the grammar allows next, as a bool mask over the vocabulary."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)  # 32-bit little-endian words: bit i = token i
    return torch.from_numpy(np.unpackbits(words, bitorder="little")[:vocab_size].astype(bool))


def advance(matcher: llguidance.LLMatcher, token: int) -> None:
    """Move the matcher past ``token``; one the grammar forbids is an error (the mask rules it out)."""
    if not matcher.consume_token(token) or matcher.is_error():
        raise RequestError(f"token {token} breaks the grammar: {matcher.get_error()}")

"""Helpers shared by the tests."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import time
from collections.abc import Callable

import torch

from daskllm.placement import set_policy  # noqa: F401 (tests import it from here)
from daskllm.runtime.control import cold_start  # noqa: F401 (tests import it from here)

# The block size of vLLM engines here: vLLM's CPU build keeps blocks of a multiple of 32 tokens.
from daskllm.engines.vllm import CPU_BLOCK_MULTIPLE as VLLM_BLOCK  # noqa: E402


def vllm_unavailable() -> str | None:
    """Why this process cannot run the real-vLLM tests (marker ``vllm``), or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment: make test-vllm runs these tests in .venv-vllm (make vllm)"
    from daskllm.engines.vllm import unavailable_reason

    return unavailable_reason()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], object], timeout: float, *procs: subprocess.Popen, what: str = "the condition",
             interval: float = 0.2):
    """Polls ``condition()`` until it is truthy and returns its value; fails at the deadline, or
    as soon as one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        for proc in procs:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(interval)
    return value


def daskllm_command(*args: str):
    """``daskllm ARGS`` through its entry point in this process, by click's test runner (a program
    per command would spend seconds importing daskllm; test_docs runs the installed program)."""
    from click.testing import CliRunner

    from daskllm.cli import main

    return CliRunner().invoke(main, list(args), prog_name="daskllm")


def scheduler_address(scheduler_file: pathlib.Path, scheduler: subprocess.Popen, timeout: float = 60) -> str:
    """The address a ``dask scheduler --scheduler-file`` wrote, once the file is whole (it exists
    for a moment before its JSON is written); fails at the deadline or if the scheduler exits."""

    def address():
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None

    return wait_for(address, timeout, scheduler, what=f"a scheduler address in {scheduler_file}")


# --- the forward pass, bit for bit -----------------------------------------------------------
#
# Tokens are too coarse to see a last-bit difference (a random model's top logits are rarely
# that close), so the forward pass itself is checked: the logits of one sequence must have
# the same bits alone, batched with other sequences (prefills and decodes of other lengths),
# prefilled in chunks, and on top of K/V cached by an earlier step.

BLOCK = 16


class _Seq:
    def __init__(self, seed: int, length: int, first_block: int, vocab: int):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, vocab, (length,), generator=gen).tolist()
        self.table = list(range(first_block, first_block + -(-(length + 1) // BLOCK)))


def step_lists(parts):
    """The flat lists of one step over ``parts`` = [(seq, first, n)], as TorchEngine._forward builds
    them: token ids, positions, cache slots, per sequence (row, n, first, table), logit rows."""
    ids, positions, slots, seqs, rows = [], [], [], [], []
    for seq, first, n in parts:
        row = len(ids)
        ids += seq.ids[first:first + n]
        positions += range(first, first + n)
        slots += [seq.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + n)]
        seqs.append((row, n, first, seq.table))
        rows.append(row + n - 1)
    return ids, positions, slots, seqs, rows


def forward_step(model, parts):
    """One forward step over ``parts`` = [(seq, first, n)]; returns {seq: logits of its last row}."""
    from daskllm.engines.llama import StepInput

    ids, positions, slots, seqs, rows = step_lists(parts)
    logits = model.forward(StepInput(torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), seqs, rows))
    return {id(seq): logits[i] for i, (seq, _, _) in enumerate(parts)}


def write_micro_llama(path):
    """A two-layer Llama with a 512-token vocabulary in ``path``: Triton's interpreter runs a
    program at a time, so the tiny recipe's 16K-token head alone would take seconds per step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def check_forward_invariance(model) -> None:
    vocab = min(16000, model.config.vocab_size)
    a = _Seq(1, 37, 0, vocab)   # the sequence under test: 37 prompt tokens, then decodes at 37
    b = _Seq(2, 20, 10, vocab)
    c = _Seq(3, 5, 20, vocab)
    d = _Seq(4, 9, 25, vocab)
    e = _Seq(5, 70, 30, vocab)  # a longer context: more key chunks in a batched decode
    a.ids.append(123 % vocab)   # the token decoded at position 37
    _step = forward_step

    def fresh():
        model.allocate_cache(40, BLOCK)

    # prefill of a's prompt: logits of its last prompt token
    fresh()
    alone = _step(model, [(a, 0, 37)])[id(a)]
    fresh()
    batched = _step(model, [(b, 0, 20), (a, 0, 37), (c, 0, 5)])[id(a)]
    fresh()
    _step(model, [(a, 0, 16)])
    _step(model, [(a, 16, 16), (b, 0, 3)])
    chunked = _step(model, [(a, 32, 5)])[id(a)]
    fresh()
    _step(model, [(e, 0, 70), (a, 0, 32)])
    on_cache = _step(model, [(a, 32, 5), (d, 0, 9)])[id(a)]
    assert torch.equal(alone, batched), "prefill logits change when batched with other prompts"
    assert torch.equal(alone, chunked), "prefill logits change when the prompt is prefilled in chunks"
    assert torch.equal(alone, on_cache), "prefill logits change on top of a cached prefix"

    # decode of a's next token, alone and among other decodes and a prefill
    fresh()
    _step(model, [(a, 0, 37)])
    decode_alone = _step(model, [(a, 37, 1)])[id(a)]
    fresh()
    _step(model, [(a, 0, 37), (b, 0, 20), (c, 0, 5), (e, 0, 70)])
    decode_batched = _step(model, [(b, 19, 1), (a, 37, 1), (d, 0, 9), (c, 4, 1), (e, 69, 1)])[id(a)]
    assert torch.equal(decode_alone, decode_batched), "decode logits change when batched"
    # and a decode equals the same position computed as the last token of a prefill
    fresh()
    prefill_38 = _step(model, [(a, 0, 38)])[id(a)]
    assert torch.equal(decode_alone, prefill_38), "a decode step and a prefill disagree on the same position"

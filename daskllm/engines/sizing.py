"""Engine limits that follow the device, as vLLM's do.

``daskllm.engine.max-num-seqs``, ``max-num-batched-tokens`` and ``kv-cache-tokens`` default to
``auto``. On a CPU that is 64 sequences, 2,048 tokens a step and a KV cache of 32,768 tokens:
a CPU step's cost grows with its tokens, and a larger batch only queues. On a CUDA device a
decode step costs about the same from 1 to 64 sequences, so an engine takes 256 sequences and
8,192 tokens a step, and its KV cache fills what ``gpu-memory-utilization`` (0.9, vLLM's
``gpu_memory_utilization``) of the device leaves after the weights and a step's activations.
A number given for any of them is used as is, on either device.
"""

from __future__ import annotations

from dataclasses import dataclass

from daskllm import config

CPU = {"max-num-seqs": 64, "max-num-batched-tokens": 2048, "kv-cache-tokens": 32768}
CUDA = {"max-num-seqs": 256, "max-num-batched-tokens": 8192}
# Memory a step uses outside PyTorch's accounting of tensors (Triton's and cuBLAS's workspaces,
# the allocator's fragmentation), kept free beside the activations.
MARGIN_BYTES = 1 << 30


def limit(value: int | str | None, key: str, on_cpu: bool) -> int | str:
    """A scheduling limit: the argument, else ``daskllm.engine.<key>``; ``auto``: the device's
    default (``"auto"`` still for the KV cache on a GPU, which only memory can size)."""
    if value is None:
        value = config.get(f"engine.{key}", "auto")
    if value != "auto":
        return int(value)
    return (CPU if on_cpu else CUDA).get(key, "auto")


def gpu_memory_utilization(value: float | None = None) -> float:
    """The fraction of a GPU one worker's LLM engines may take: the argument, else
    ``daskllm.engine.gpu-memory-utilization`` (vLLM's ``gpu_memory_utilization``)."""
    return float(value or config.get("engine.gpu-memory-utilization"))


@dataclass(frozen=True)
class DeviceMemory:
    """What the device holds, in bytes, measured after the engine's weights are loaded."""

    total: int
    free: int
    weights: int  # this engine's weights


def step_activation_bytes(hidden: int, intermediate: int, q_width: int, kv_width: int, vocab: int,
                          tokens: int, seqs: int, dtype_bytes: int) -> int:
    """A generous bound on what one step of ``tokens`` tokens and ``seqs`` sequences allocates
    beside the weights and the cache: each token's hidden states, projections and MLP rows,
    and each sequence's float32 logits (with the sampler's copies), twice over."""
    per_token = (4 * hidden + q_width + 2 * kv_width + 3 * intermediate) * dtype_bytes
    return 2 * (tokens * per_token + seqs * vocab * 4 * 3)


def kv_cache_tokens_for(memory: DeviceMemory, *, utilization: float, activations: int, bytes_per_token: int,
                        block_size: int) -> int:
    """KV-cache tokens (whole blocks) that fit this engine's share of the device: ``utilization``
    of its total memory less the weights and a step's activations, and never more than is free."""
    if not 0 < utilization <= 1:
        raise ValueError(f"daskllm.engine.gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = min(int(memory.total * utilization) - memory.weights - activations,
                 memory.free - activations - MARGIN_BYTES)
    return max(0, budget) // bytes_per_token // block_size * block_size


def no_room(name: str, memory: DeviceMemory, utilization: float, activations: int) -> str:
    gib = 1 << 30
    return (f"engine {name!r}: no room for a KV cache: gpu-memory-utilization {utilization} of "
            f"{memory.total / gib:.1f} GiB, less the weights ({memory.weights / gib:.2f} GiB) and a step's "
            f"activations ({activations / gib:.2f} GiB), with {memory.free / gib:.1f} GiB free; raise "
            f"daskllm.engine.gpu-memory-utilization, lower max-num-batched-tokens, or set kv-cache-tokens")

"""Engine limits that follow the device (daskllm/engines/sizing.py): pure arithmetic, no device."""

from __future__ import annotations

import dask
import pytest

from daskllm.engines import sizing

GIB = 1 << 30


def test_auto_limits_follow_the_device_and_numbers_are_used_as_given():
    assert [sizing.limit(None, k, on_cpu=True) for k in ("max-num-seqs", "max-num-batched-tokens", "kv-cache-tokens")] \
        == [64, 2048, 32768]
    assert [sizing.limit(None, k, on_cpu=False) for k in ("max-num-seqs", "max-num-batched-tokens", "kv-cache-tokens")] \
        == [256, 8192, "auto"]
    assert sizing.limit(12, "max-num-seqs", on_cpu=False) == 12
    with dask.config.set({"daskllm.engine.max-num-seqs": 96, "daskllm.engine.kv-cache-tokens": "4096"}):
        assert sizing.limit(None, "max-num-seqs", on_cpu=False) == 96
        assert sizing.limit(None, "kv-cache-tokens", on_cpu=False) == 4096


def test_a_gpu_kv_cache_fills_its_share_after_weights_and_activations():
    memory = sizing.DeviceMemory(total=80 * GIB, free=78 * GIB, weights=2 * GIB)
    per_token, block = 32 * 1024, 16  # llama-1b in bf16: 2 x 16 layers x 8 heads x 64 x 2 bytes
    tokens = sizing.kv_cache_tokens_for(memory, utilization=0.9, activations=GIB, bytes_per_token=per_token,
                                        block_size=block)
    assert tokens % block == 0
    assert tokens * per_token <= 0.9 * 80 * GIB - 3 * GIB < (tokens + block) * per_token
    # Half the share, half the cache (what two workers on one GPU each get).
    half = sizing.kv_cache_tokens_for(memory, utilization=0.45, activations=GIB, bytes_per_token=per_token,
                                      block_size=block)
    assert half < tokens / 2
    # Another process holding most of the device: never more than is free.
    crowded = sizing.DeviceMemory(total=80 * GIB, free=10 * GIB, weights=2 * GIB)
    assert sizing.kv_cache_tokens_for(crowded, utilization=0.9, activations=GIB, bytes_per_token=per_token,
                                      block_size=block) * per_token <= 10 * GIB - GIB - sizing.MARGIN_BYTES
    full = sizing.DeviceMemory(total=80 * GIB, free=GIB, weights=2 * GIB)
    assert sizing.kv_cache_tokens_for(full, utilization=0.9, activations=GIB, bytes_per_token=per_token,
                                      block_size=block) == 0
    assert "gpu-memory-utilization 0.9" in sizing.no_room("llama-1b", full, 0.9, GIB)
    with pytest.raises(ValueError, match="gpu-memory-utilization must be in"):
        sizing.kv_cache_tokens_for(memory, utilization=1.5, activations=0, bytes_per_token=per_token, block_size=block)


def test_step_activations_grow_with_tokens_and_sequences():
    llama_1b = dict(hidden=2048, intermediate=8192, q_width=2048, kv_width=512, vocab=128256, dtype_bytes=2)
    small = sizing.step_activation_bytes(tokens=2048, seqs=64, **llama_1b)
    large = sizing.step_activation_bytes(tokens=8192, seqs=256, **llama_1b)
    assert 0 < small < large < 4 * GIB  # a few GiB at most beside an H100's 80

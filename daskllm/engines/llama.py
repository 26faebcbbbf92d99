"""A Llama-family forward pass over a paged KV cache, batch-invariant by construction.

Greedy decoding must give the same tokens whether a request runs alone, batched with
others, or on top of a cached prefix: the forward pass leaves every reduction (products,
RMSNorm, attention) to a :mod:`~daskllm.engines.backends` backend whose results for a row do
not depend on the other rows; the rest is elementwise.

Any dtype: weights and the KV cache are held in the model's dtype (float32, bfloat16,
float16); RMSNorm and attention accumulate in float32 and rotary embeddings are applied as
transformers applies them, so a 16-bit model computes what transformers' does, up to the
order of additions inside a reduction.

:meth:`LlamaModel.forward` takes a step as Python lists; :meth:`LlamaModel.run` is the pure
tensor computation under it, which a CUDA graph can capture (see ``cuda_graphs``).

Supported checkpoints: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM directories with safetensors (or .bin) weights.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch

from daskllm.engines import backends
from daskllm.engines.backends import Heads, StepInput
from daskllm.models import dummy_weights

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: pathlib.Path) -> LlamaConfig:
        with (model_dir / "config.json").open() as f:
            raw = json.load(f)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"model {model_dir}: architecture {archs or raw.get('model_type')!r} is not supported "
                             f"by the torch engine (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model {model_dir}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        heads = raw["num_attention_heads"]
        max_len = raw.get("max_position_embeddings", 2048)
        if raw.get("sliding_window") and raw.get("use_sliding_window", True):
            max_len = min(max_len, raw["sliding_window"])  # within the window attention is full
        eos = raw.get("eos_token_id")
        gen_file = model_dir / "generation_config.json"
        if gen_file.exists():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_model_len=max_len,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
        )


def load_state_dict(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    if (state := dummy_weights(model_dir)) is not None:
        return state
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if files:
        state = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"model {model_dir}: no *.safetensors or pytorch_model*.bin weights found")


class LlamaModel:
    """Weights of one checkpoint and the forward pass; the KV cache is held here too."""

    def __init__(self, model_dir: pathlib.Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 batch_invariant: bool = True, backend: str | None = None):
        self.config = cfg = LlamaConfig.from_dir(model_dir)
        self.heads = Heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.device, self.dtype = torch.device(device), dtype
        self.backend = backends.select(self.device, self.heads, batch_invariant=batch_invariant, kind=backend)
        linear = self.backend.linear
        state = load_state_dict(model_dir)

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = state.pop(name, None)
            if t is None:
                if required:
                    raise KeyError(f"model {model_dir}: weight {name!r} is missing")
                return None
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
            qkv_bias = None
            if cfg.attention_bias:
                biases = [take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv"]
                if all(b is not None for b in biases):
                    qkv_bias = torch.cat(biases)
            layer = {
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                # One fused projection each for QKV and gate/up: fewer, larger GEMMs.
                "qkv": linear(torch.cat([q, k, v]), qkv_bias),
                "o": linear(take(p + "self_attn.o_proj.weight")),
                "gate_up": linear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                "down": linear(take(p + "mlp.down_proj.weight")),
            }
            if cfg.qk_norm:
                layer["q_norm"] = take(p + "self_attn.q_norm.weight")
                layer["k_norm"] = take(p + "self_attn.k_norm.weight")
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
        # Tied: the embedding table stays for lookups; the head holds its own prepared copy.
        self.lm_head = linear(head if head is not None else self.embed)
        # transformers computes cos/sin in float32 and casts them to the activations' dtype.
        self.cos, self.sin = (t.to(dtype) for t in _rope_tables(model_dir, cfg, self.device))
        self.weight_elements = sum(t.numel() for t in self._weights_read_per_step())
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self._weights_read_per_step())
        self.k_cache = self.v_cache = None
        self.block_size = 0
        self.scratch_block = -1

    def projections(self):
        """Every prepared projection (the backend's linear objects), the head last."""
        for layer in self.layers:
            yield from (layer[name] for name in ("qkv", "o", "gate_up", "down"))
        yield self.lm_head

    def _weights_read_per_step(self):
        """Every weight a step reads whole (the embedding table is only looked up)."""
        for layer in self.layers:
            for w in layer.values():
                yield w if isinstance(w, torch.Tensor) else w.weight
        yield self.norm
        yield self.lm_head.weight

    @property
    def context_cost(self) -> float:
        """The context length at which a token's attention does as many multiply-adds as its
        projections (2 per head dimension and key per layer, against one per weight read)."""
        c = self.config
        return self.weight_elements / (2 * c.num_heads * c.head_dim * c.num_layers)

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """Room for ``num_blocks`` blocks, plus one scratch block that padding rows write to."""
        c = self.config
        # Stored [layer, KV head, block, row in block, d], so one head's gathered blocks are
        # contiguous: its key tiles in the layout the CPU attention matmuls read, gathered by one
        # copy. Seen [layer, block, KV head, row, d] (a view), the layout writes index and the
        # Triton kernel reads through strides.
        shape = (c.num_layers, c.num_kv_heads, num_blocks + 1, block_size, c.head_dim)
        self.scratch_block = num_blocks
        # Zeros, not empty: masked attention weights are exact zeros, and 0 * NaN would not be.
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype).transpose(1, 2)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype).transpose(1, 2)
        self.block_size = block_size

    @torch.inference_mode()
    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` cached K/V rows of block ``src`` into block ``dst``."""
        self.k_cache[:, dst, :, :rows] = self.k_cache[:, src, :, :rows]
        self.v_cache[:, dst, :, :rows] = self.v_cache[:, src, :, :rows]

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Run one step; write new K/V into the cache; return float32 logits for ``step.logit_rows``
        (on the model's device)."""
        plan = self.backend.plan(step, self.block_size)
        rows = step.logit_rows
        if rows != list(range(step.input_ids.shape[0])):
            rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        else:
            rows = slice(None)
        return self.run(step.input_ids, step.positions, step.slots, plan, rows)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, plan,
            logit_rows: torch.Tensor | slice) -> torch.Tensor:
        """The step as tensors only (no host sync, nothing shaped by Python values): capturable.

        Each layer is four products and what the backend fuses between them: the rotary
        embedding with the cache write, attention, each residual add with the norm after it,
        and SiLU x up."""
        c, b = self.config, self.backend
        eps = c.rms_norm_eps
        n = input_ids.shape[0]
        h = self.embed[input_ids]
        tokens = b.tokens(positions, slots, self.cos, self.sin, self.block_size)
        x = b.rms_norm(h, self.layers[0]["in_norm"], eps)
        norms_after = [layer["in_norm"] for layer in self.layers[1:]] + [self.norm]
        for li, (layer, norm_after) in enumerate(zip(self.layers, norms_after)):
            q = b.rope_and_cache(layer["qkv"](x), tokens, self.k_cache[li], self.v_cache[li], self.heads,
                                 layer.get("q_norm"), layer.get("k_norm"), eps)
            attn = b.attend(q, self.k_cache[li], self.v_cache[li], plan)
            h, x = b.add_rms_norm(h, layer["o"](attn.reshape(n, -1)), layer["post_norm"], eps)
            h, x = b.add_rms_norm(h, layer["down"](b.silu_mul(layer["gate_up"](x))), norm_after, eps)
        return self.lm_head(x[logit_rows]).float()


def _rope_tables(model_dir: pathlib.Path, cfg: LlamaConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, using transformers' rope initialisers (all scaling types)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(model_dir)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
        scale = 1.0
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        inv_freq = inv_freq.double()
    pos = torch.arange(cfg.max_model_len, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).float().to(device), (emb.sin() * scale).float().to(device)

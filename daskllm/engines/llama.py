"""A Llama-family forward pass over a paged KV cache, batch-invariant by construction.

Greedy decoding must give the same tokens whether a request runs alone, batched with
others, or on top of a cached prefix. Float arithmetic is only reproducible if every
number is computed by the same sequence of operations, so this module never lets the
batch change a reduction:

* Matrix products get a row count padded to a multiple of 4 (see
  :mod:`daskllm.engines.invariant`), for which the CPU GEMM kernels give every row the
  same bits whatever the row count.
* Attention never reduces over a length that depends on the context: keys are taken in
  fixed chunks of one cache block, each chunk is a fixed-shape matmul, and chunk results
  are combined by a sequential ``cumsum`` over chunks, where chunks past a query's
  position contribute exact zeros. The softmax max is order-free.

Supported checkpoints: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM directories with safetensors (or .bin) weights.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from daskllm.engines.invariant import linear, pad_rows
from daskllm.models import dummy_weights

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
PREFILL_TILE = 128  # query positions per attention tile: bounds memory on long prompts


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


@dataclass(slots=True)
class StepInput:
    """The tokens of one engine step, flattened across sequences.

    ``seqs`` lists, per sequence, (first row in the flat batch, number of new tokens,
    tokens already in the cache before this step, block table).
    """

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slots: torch.Tensor  # [N] long: flat cache slot each new token's K/V goes to
    seqs: list[tuple[int, int, int, list[int]]]
    logit_rows: list[int]  # rows whose next-token logits are wanted


class LlamaModel:
    """Weights of one checkpoint and the forward pass; the KV cache is held here too."""

    def __init__(self, model_dir: pathlib.Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.config = cfg = LlamaConfig.from_dir(model_dir)
        self.device, self.dtype = torch.device(device), dtype
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
            layer = {
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                # One fused projection each for QKV and gate/up: fewer, larger GEMMs.
                "qkv": torch.cat([q, k, v]),
                "qkv_bias": None,
                "o": take(p + "self_attn.o_proj.weight"),
                "gate_up": torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                "down": take(p + "mlp.down_proj.weight"),
            }
            if cfg.attention_bias:
                biases = [take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv"]
                if all(b is not None for b in biases):
                    layer["qkv_bias"] = torch.cat(biases)
            if cfg.qk_norm:
                layer["q_norm"] = take(p + "self_attn.q_norm.weight")
                layer["k_norm"] = take(p + "self_attn.k_norm.weight")
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
        self.lm_head = head if head is not None else self.embed
        self.cos, self.sin = _rope_tables(model_dir, cfg, self.device)
        self.k_cache = self.v_cache = None
        self.block_size = 0

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        shape = (c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        # Zeros, not empty: masked attention weights are exact zeros, and 0 * NaN would not be.
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.block_size = block_size

    @torch.inference_mode()
    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` cached K/V rows of block ``src`` into block ``dst``."""
        self.k_cache[:, dst, :rows] = self.k_cache[:, src, :rows]
        self.v_cache[:, dst, :rows] = self.v_cache[:, src, :rows]

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Run one step; write new K/V into the cache; return logits for ``step.logit_rows``."""
        c = self.config
        n = step.input_ids.shape[0]
        h = self.embed[step.input_ids]
        cos, sin = self.cos[step.positions], self.sin[step.positions]
        for li, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["in_norm"], c.rms_norm_eps)
            qkv = linear(x, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                 c.num_kv_heads * c.head_dim], dim=-1)
            q = q.view(n, c.num_heads, c.head_dim)
            k = k.view(n, c.num_kv_heads, c.head_dim)
            v = v.view(n, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = _rms_norm(q, layer["q_norm"], c.rms_norm_eps)
                k = _rms_norm(k, layer["k_norm"], c.rms_norm_eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.k_cache[li].view(-1, c.num_kv_heads, c.head_dim)[step.slots] = k
            self.v_cache[li].view(-1, c.num_kv_heads, c.head_dim)[step.slots] = v
            attn = self._attention(li, q, step)
            h = h + linear(attn.reshape(n, -1), layer["o"])
            x = _rms_norm(h, layer["post_norm"], c.rms_norm_eps)
            gate, up = linear(x, layer["gate_up"]).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, layer["down"])
        rows = h[step.logit_rows]
        return linear(_rms_norm(rows, self.norm, c.rms_norm_eps), self.lm_head).float()

    def _attention(self, layer: int, q: torch.Tensor, step: StepInput) -> torch.Tensor:
        out = torch.zeros_like(q)
        decodes = [s for s in step.seqs if s[1] == 1]
        if decodes:
            rows = [s[0] for s in decodes]
            positions = torch.tensor([[s[2]] for s in decodes], device=q.device)
            out[rows] = self._attend(layer, q[rows].unsqueeze(1), positions, [s[3] for s in decodes]).squeeze(1)
        for start, count, cached, table in step.seqs:
            if count == 1:
                continue
            for t0 in range(0, count, PREFILL_TILE):
                t1 = min(count, t0 + PREFILL_TILE)
                positions = torch.arange(cached + t0, cached + t1, device=q.device).unsqueeze(0)
                out[start + t0:start + t1] = self._attend(layer, q[start + t0:start + t1].unsqueeze(0),
                                                          positions, [table])[0]
        return out

    def _attend(self, layer: int, q: torch.Tensor, positions: torch.Tensor, tables: list[list[int]]) -> torch.Tensor:
        """Causal attention of queries ``q`` [B, T, H, d] at ``positions`` [B, T] over cached K/V."""
        c = self.config
        bs = self.block_size
        b, t = q.shape[:2]
        g = c.num_heads // c.num_kv_heads
        n_chunks = int(positions.max()) // bs + 1
        table = torch.zeros(b, n_chunks, dtype=torch.long, device=q.device)
        for i, blocks in enumerate(tables):
            blocks = blocks[:n_chunks]
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        # [B, Hkv, chunks, d, bs] and [B, Hkv, chunks, bs, d]
        keys = self.k_cache[layer][table].permute(0, 3, 1, 4, 2)
        values = self.v_cache[layer][table].permute(0, 3, 1, 2, 4)
        # Rows are (query head within its KV group, position): [B, Hkv, g*T -> M, d]
        rows = q.view(b, t, c.num_kv_heads, g, c.head_dim).permute(0, 2, 3, 1, 4).reshape(b, c.num_kv_heads, g * t, -1)
        m = pad_rows(g * t)
        rows = F.pad(rows, (0, 0, 0, m - g * t)) * (1.0 / math.sqrt(c.head_dim))
        rows = rows.unsqueeze(2).expand(b, c.num_kv_heads, n_chunks, m, c.head_dim)
        scores = torch.matmul(rows.contiguous(), keys.contiguous())  # [B, Hkv, chunks, M, bs]
        row_pos = F.pad(positions.repeat(1, g), (0, m - g * t), value=0)  # [B, M]; padding rows see key 0
        key_pos = torch.arange(n_chunks * bs, device=q.device).view(n_chunks, bs)
        masked = key_pos.view(1, 1, n_chunks, 1, bs) > row_pos.view(b, 1, 1, m, 1)
        scores = scores.masked_fill(masked, float("-inf"))
        peak = scores.amax(dim=(2, 4), keepdim=True)
        weights = torch.exp(scores - peak)
        # Per-chunk partials, then a sequential sum over chunks: exact zeros past the position.
        num = torch.matmul(weights, values.contiguous()).cumsum(dim=2)[:, :, -1]  # [B, Hkv, M, d]
        den = weights.sum(dim=-1).cumsum(dim=2)[:, :, -1]  # [B, Hkv, M]
        attn = (num / den.unsqueeze(-1))[:, :, :g * t]
        return attn.view(b, c.num_kv_heads, g, t, c.head_dim).permute(0, 3, 1, 2, 4).reshape(b, t, c.num_heads, -1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


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

"""A Llama-family forward pass over a paged KV cache, batch-invariant by construction.

Greedy decoding must give the same tokens whether a request runs alone, batched with
others, or on top of a cached prefix. Float arithmetic is only reproducible if every
number is computed by the same sequence of operations, so this module never lets the
batch change a reduction:

* Projections are :class:`~daskllm.engines.invariant.Linear`: weights prepared once for
  oneDNN on CPU, whose kernel gives every row the same bits whatever the row count (a lone
  decode row then costs a matrix-vector product); elsewhere the row count is padded to a
  multiple of 4, for which the GEMM kernels give every row the same bits.
* Attention never reduces over a length that depends on the context: keys are taken in
  fixed chunks of one cache block, each chunk is a fixed-shape matmul (score rows padded
  to a multiple of 4), and chunk results are combined by a sequential ``cumsum`` over
  chunks, where chunks past a query's position contribute exact zeros. The softmax max is
  order-free.

Speed: the KV cache is laid out [layer, block, KV head, row, d], so the blocks a step
reads are gathered (``index_select``) straight into the layout its matmuls take; a step's
block tables and causal masks are built once and shared by every layer.

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

from daskllm.engines.invariant import Linear, pad_rows
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
            qkv_bias = None
            if cfg.attention_bias:
                biases = [take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv"]
                if all(b is not None for b in biases):
                    qkv_bias = torch.cat(biases)
            layer = {
                "in_norm": take(p + "input_layernorm.weight"),
                "post_norm": take(p + "post_attention_layernorm.weight"),
                # One fused projection each for QKV and gate/up: fewer, larger GEMMs.
                "qkv": Linear(torch.cat([q, k, v]), qkv_bias),
                "o": Linear(take(p + "self_attn.o_proj.weight")),
                "gate_up": Linear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])),
                "down": Linear(take(p + "mlp.down_proj.weight")),
            }
            if cfg.qk_norm:
                layer["q_norm"] = take(p + "self_attn.q_norm.weight")
                layer["k_norm"] = take(p + "self_attn.k_norm.weight")
            self.layers.append(layer)
        self.norm = take("model.norm.weight")
        head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
        # Tied: the embedding table stays for lookups; the head holds its own prepared copy.
        self.lm_head = Linear(head if head is not None else self.embed)
        self.cos, self.sin = _rope_tables(model_dir, cfg, self.device)
        self.k_cache = self.v_cache = None
        self.block_size = 0

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        # [layer, block, KV head, row in block, d]: a block's rows for one head are contiguous,
        # so gathered blocks are already in the layout the attention matmuls read (no copy).
        shape = (c.num_layers, num_blocks, c.num_kv_heads, block_size, c.head_dim)
        # Zeros, not empty: masked attention weights are exact zeros, and 0 * NaN would not be.
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.block_size = block_size

    @torch.inference_mode()
    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` cached K/V rows of block ``src`` into block ``dst``."""
        self.k_cache[:, dst, :, :rows] = self.k_cache[:, src, :, :rows]
        self.v_cache[:, dst, :, :rows] = self.v_cache[:, src, :, :rows]

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """Run one step; write new K/V into the cache; return logits for ``step.logit_rows``."""
        c = self.config
        n = step.input_ids.shape[0]
        h = self.embed[step.input_ids]
        cos, sin = self.cos[step.positions].unsqueeze(1), self.sin[step.positions].unsqueeze(1)
        # Where each new token's K/V goes: (block, row in block), the same for every layer.
        block, offset = step.slots // self.block_size, step.slots % self.block_size
        groups = self._attention_groups(step)  # tables and masks: built once, used by every layer
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for li, layer in enumerate(self.layers):
            x = _rms_norm(h, layer["in_norm"], c.rms_norm_eps)
            qkv = layer["qkv"](x)
            if c.qk_norm:
                q = _rms_norm(qkv[:, :q_size].view(n, c.num_heads, c.head_dim), layer["q_norm"], c.rms_norm_eps)
                k = _rms_norm(qkv[:, q_size:q_size + kv_size].view(n, c.num_kv_heads, c.head_dim),
                              layer["k_norm"], c.rms_norm_eps)
                q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            else:  # q and k rotated by one call: their heads sit side by side in qkv
                qk = _rope(qkv[:, :q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
                q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_size + kv_size:].view(n, c.num_kv_heads, c.head_dim)
            self.k_cache[li][block, :, offset] = k
            self.v_cache[li][block, :, offset] = v
            attn = self._attention(li, q, groups)
            h = h + layer["o"](attn.reshape(n, -1))
            x = _rms_norm(h, layer["post_norm"], c.rms_norm_eps)
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            h = h + layer["down"](F.silu(gate) * up)
        rows = h[step.logit_rows]
        return self.lm_head(_rms_norm(rows, self.norm, c.rms_norm_eps)).float()

    def _attention_groups(self, step: StepInput) -> list[_Group]:
        """The step's queries as attention calls: all decodes in one, each prefill in tiles."""
        groups = []
        decodes = [s for s in step.seqs if s[1] == 1]
        if decodes:
            rows = [s[0] for s in decodes]
            # A pure decode step (the common case) needs no gather of its query rows.
            index = slice(0, len(rows)) if rows == list(range(step.input_ids.shape[0])) else rows
            groups.append(self._group(index, [[s[2]] for s in decodes], [s[3] for s in decodes]))
        for start, count, cached, table in step.seqs:
            if count == 1:
                continue
            for t0 in range(0, count, PREFILL_TILE):
                t1 = min(count, t0 + PREFILL_TILE)
                groups.append(self._group(slice(start + t0, start + t1), [list(range(cached + t0, cached + t1))],
                                          [table]))
        return groups

    def _group(self, rows, positions: list[list[int]], tables: list[list[int]]) -> _Group:
        """One attention call's block table [B, chunks] and mask, for queries at ``positions`` [B][T]."""
        c = self.config
        bs = self.block_size
        b, t = len(positions), len(positions[0])
        g = c.num_heads // c.num_kv_heads
        m = pad_rows(g * t)
        n_chunks = max(p[-1] for p in positions) // bs + 1
        table = torch.tensor([blocks[:n_chunks] + [0] * (n_chunks - len(blocks[:n_chunks])) for blocks in tables],
                             dtype=torch.long, device=self.device)
        # Rows are (query head within its KV group, position), then padding rows that see key 0.
        row_pos = torch.tensor([p * g + [0] * (m - g * t) for p in positions], device=self.device)  # [B, M]
        key_pos = torch.arange(n_chunks * bs, device=self.device).view(1, n_chunks, 1, 1, bs)
        masked = key_pos > row_pos.view(b, 1, 1, m, 1)  # [B, chunks, 1 (KV heads), M, bs]
        return _Group(rows, b, t, m, table, masked)

    def _attention(self, layer: int, q: torch.Tensor, groups: list[_Group]) -> torch.Tensor:
        if len(groups) == 1 and groups[0].rows == slice(0, q.shape[0]):
            return self._attend(layer, q.view(groups[0].b, groups[0].t, *q.shape[1:]), groups[0]).view_as(q)
        out = torch.empty_like(q)  # the groups cover every row
        for grp in groups:
            out[grp.rows] = self._attend(layer, q[grp.rows].view(grp.b, grp.t, *q.shape[1:]), grp).flatten(0, 1)
        return out

    def _attend(self, layer: int, q: torch.Tensor, grp: _Group) -> torch.Tensor:
        """Causal attention of queries ``q`` [B, T, H, d] over the cached K/V of ``grp``'s blocks."""
        c = self.config
        b, t, m = grp.b, grp.t, grp.m
        g = c.num_heads // c.num_kv_heads
        # index_select: the same gather as k_cache[layer][table], several times faster on CPU.
        blocks = grp.table.view(-1)
        keys = self.k_cache[layer].index_select(0, blocks).view(b, -1, *self.k_cache.shape[2:])  # [B, chunks, Hkv, bs, d]
        values = self.v_cache[layer].index_select(0, blocks).view(b, -1, *self.v_cache.shape[2:])
        # Rows are (query head within its KV group, position): [B, 1, Hkv, g*T -> M, d]
        rows = q.view(b, t, c.num_kv_heads, g, c.head_dim).permute(0, 2, 3, 1, 4).reshape(b, c.num_kv_heads, g * t, -1)
        rows = F.pad(rows, (0, 0, 0, m - g * t)) * (1.0 / math.sqrt(c.head_dim))
        scores = torch.matmul(rows.unsqueeze(1), keys.transpose(-1, -2))  # [B, chunks, Hkv, M, bs]
        scores = scores.masked_fill(grp.masked, float("-inf"))
        peak = scores.amax(dim=(1, 4), keepdim=True)
        weights = torch.exp(scores - peak)
        # Per-chunk partials, then a sequential sum over chunks: exact zeros past the position.
        num = torch.matmul(weights, values).cumsum(dim=1)[:, -1]  # [B, Hkv, M, d]
        den = weights.sum(dim=-1).cumsum(dim=1)[:, -1]  # [B, Hkv, M]
        attn = (num / den.unsqueeze(-1))[:, :, :g * t]
        return attn.view(b, c.num_kv_heads, g, t, c.head_dim).permute(0, 3, 1, 2, 4).reshape(b, t, c.num_heads, -1)


@dataclass(slots=True)
class _Group:
    """One attention call of a step: its query rows in the flat batch and what every layer reuses."""

    rows: slice | list[int]
    b: int  # sequences
    t: int  # query positions per sequence
    m: int  # score rows per KV head: g * t padded (see invariant.pad_rows)
    table: torch.Tensor  # [B, chunks] cache blocks
    masked: torch.Tensor  # [B, chunks, 1, M, bs]: True where a key lies past the row's position


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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

"""A BERT encoder forward pass whose output for a text does not depend on the batch.

Embeddings feed vector search, and search results feed prompts: if a text's embedding
changed in its last bits with the batch it was computed in, a near-tie in the top-k could
flip and an optimized pipeline would no longer return what the naive one returns. So, as
in :mod:`daskllm.engines.llama`, nothing here lets the batch change a reduction:

* Texts are never padded. All tokens of a batch go through the dense layers as one flat
  matrix, by batch-invariant products (:class:`daskllm.engines.invariant.Linear`).
* Attention runs per group of texts of equal length: each text attends over exactly its
  own tokens, in a batched matmul whose per-text shape never changes.

Covers BERT-family checkpoints (``BertModel``, e.g. all-MiniLM-L6-v2) with absolute
position embeddings; other encoders go through transformers (see ``embedder.py``).
"""

from __future__ import annotations

import json
import math
import pathlib
from collections import defaultdict

import torch
import torch.nn.functional as F

from daskllm.engines.invariant import Linear
from daskllm.engines.llama import load_state_dict


def is_supported(model_dir: pathlib.Path) -> bool:
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (raw.get("model_type") == "bert" and raw.get("position_embedding_type", "absolute") == "absolute"
            and raw.get("hidden_act", "gelu") == "gelu")


class BertEncoder:
    def __init__(self, model_dir: pathlib.Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
        raw = json.loads((model_dir / "config.json").read_text())
        self.hidden_size = raw["hidden_size"]
        self.num_heads = raw["num_attention_heads"]
        self.eps = raw.get("layer_norm_eps", 1e-12)
        self.max_positions = raw.get("max_position_embeddings", 512)
        self.device = torch.device(device)
        state = {k.removeprefix("bert."): v for k, v in load_state_dict(model_dir).items()}

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"model {model_dir}: weight {name!r} is missing")
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        e = "embeddings."
        self.word = take(e + "word_embeddings.weight")
        self.position = take(e + "position_embeddings.weight")
        self.token_type = take(e + "token_type_embeddings.weight")[0]
        self.embed_norm = (take(e + "LayerNorm.weight"), take(e + "LayerNorm.bias"))
        self.layers = []
        for i in range(raw["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            a = p + "attention."
            self.layers.append({
                "qkv": Linear(torch.cat([take(a + f"self.{n}.weight") for n in ("query", "key", "value")]),
                              torch.cat([take(a + f"self.{n}.bias") for n in ("query", "key", "value")])),
                "out": Linear(take(a + "output.dense.weight"), take(a + "output.dense.bias")),
                "attn_norm": (take(a + "output.LayerNorm.weight"), take(a + "output.LayerNorm.bias")),
                "up": Linear(take(p + "intermediate.dense.weight"), take(p + "intermediate.dense.bias")),
                "down": Linear(take(p + "output.dense.weight"), take(p + "output.dense.bias")),
                "out_norm": (take(p + "output.LayerNorm.weight"), take(p + "output.LayerNorm.bias")),
            })

    @torch.inference_mode()
    def forward(self, texts: list[list[int]]) -> list[torch.Tensor]:
        """Token states ``[len(ids), hidden]`` for each text's token ids."""
        lengths = [len(ids) for ids in texts]
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        ids = torch.tensor([t for ids in texts for t in ids], device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        h = self.word[ids] + self.position[positions] + self.token_type
        h = F.layer_norm(h, (self.hidden_size,), *self.embed_norm, self.eps)
        groups: dict[int, list[int]] = defaultdict(list)  # length -> texts of that length
        for i, n in enumerate(lengths):
            groups[n].append(i)
        rows = {n: torch.cat([torch.arange(starts[i], starts[i] + n) for i in members])
                for n, members in groups.items()}
        for layer in self.layers:
            qkv = layer["qkv"](h)
            attn = torch.empty_like(h)
            for n, members in groups.items():
                attn[rows[n]] = self._attend(qkv[rows[n]], len(members), n)
            h = F.layer_norm(h + layer["out"](attn), (self.hidden_size,), *layer["attn_norm"], self.eps)
            up = F.gelu(layer["up"](h))
            h = F.layer_norm(h + layer["down"](up), (self.hidden_size,), *layer["out_norm"], self.eps)
        return [h[starts[i]:starts[i + 1]] for i in range(len(texts))]

    def _attend(self, qkv: torch.Tensor, count: int, length: int) -> torch.Tensor:
        d = self.hidden_size // self.num_heads
        q, k, v = qkv.view(count, length, 3, self.num_heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.matmul(q.contiguous(), k.transpose(-1, -2).contiguous()) / math.sqrt(d)
        out = torch.matmul(torch.softmax(scores, dim=-1), v.contiguous())  # [count, heads, length, d]
        return out.permute(0, 2, 1, 3).reshape(count * length, self.hidden_size)

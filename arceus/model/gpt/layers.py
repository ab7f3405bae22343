"""A nanoGPT-style decoder-only transformer, one module per pipeline layer, single-device torch.

Layer 0 embeds tokens and positions, layers 1..n_layer are blocks, the last is LayerNorm + LM head.
Embedding and head weights are not tied: tying would share a parameter between the first and the last
stage. No dropout, so a pipeline and the single-process model compute the same function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.decoding import KVCache, causal_mask
from arceus.model.gpt.spec import GPTSpec

INIT_STD = 0.02


class GPTEmbedding(nn.Module):
    def __init__(self, spec: GPTSpec, generator: torch.Generator) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.block_size, spec.d_model)
        with torch.no_grad():
            nn.init.normal_(self.wte.weight, 0.0, INIT_STD, generator=generator)
            nn.init.normal_(self.wpe.weight, 0.0, INIT_STD, generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.decode(idx, 0, KVCache())

    def decode(self, idx: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        positions = torch.arange(position, position + idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.n_head = spec.n_head
        self.c_attn = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.c_proj = nn.Linear(spec.d_model, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))

    def decode(self, x: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        """`forward` for positions [position, position + t), attending to the cached earlier ones too."""
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        k, v = cache.extend(k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(t, position, x.device))
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.d_model, 4 * spec.d_model)
        self.c_proj = nn.Linear(4 * spec.d_model, spec.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    """Pre-norm residual block. `attn` and `mlp` are whole, or one tensor-parallel rank's part of them
    (`arceus.model.gpt.parallel.ParallelBlock`): either way they return the whole output."""

    def __init__(self, spec: GPTSpec, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.attn = attn
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def decode(self, x: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        x = x + self.attn.decode(self.ln_1(x), position, cache)
        return x + self.mlp(self.ln_2(x))


def gpt_block(spec: GPTSpec, generator: torch.Generator) -> GPTBlock:
    block = GPTBlock(spec, CausalSelfAttention(spec), MLP(spec))
    # nanoGPT's init: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2·n_layer).
    with torch.no_grad():
        for name, param in block.named_parameters():
            if name.startswith("ln_"):
                continue
            if name.endswith("bias"):
                nn.init.zeros_(param)
            else:
                std = INIT_STD / math.sqrt(2 * spec.n_layer) if "c_proj" in name else INIT_STD
                nn.init.normal_(param, 0.0, std, generator=generator)
    return block


class GPTHead(nn.Module):
    def __init__(self, spec: GPTSpec, generator: torch.Generator) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.lm_head.weight, 0.0, INIT_STD, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def decode(self, x: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        return self.forward(x)


def gpt_layer(spec: GPTSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Pipeline layer `index` of the GPT, initialised from `generator` only."""
    if index == 0:
        return GPTEmbedding(spec, generator)
    if index == spec.num_layers - 1:
        return GPTHead(spec, generator)
    return gpt_block(spec, generator)

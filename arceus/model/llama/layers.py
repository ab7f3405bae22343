"""The Llama-family decoder, one module per pipeline layer, single-device torch: RMSNorm, rotary position
embeddings, a SwiGLU MLP and grouped-query attention, computing what Hugging Face's `LlamaForCausalLM`
computes. Each layer's parameter names are `LlamaForCausalLM`'s below its own prefix (`arceus.model.llama.hf`
adds the prefixes), so the whole model's state maps 1:1 onto a `transformers` checkpoint.

No biases, no dropout, embedding and head not tied (a tie would share a parameter between the first and
the last stage).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arceus.model.decoding import KVCache, causal_mask
from arceus.model.llama.spec import LlamaSpec

INIT_STD = 0.02  # LlamaConfig.initializer_range: every linear and embedding weight is N(0, 0.02)


class LlamaEmbedding(nn.Module):
    def __init__(self, spec: LlamaSpec, generator: torch.Generator) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        with torch.no_grad():
            nn.init.normal_(self.embed_tokens.weight, 0.0, INIT_STD, generator=generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(idx)  # positions enter through the rotation of queries and keys

    def decode(self, idx: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        return self.forward(idx)


def rotary(spec: LlamaSpec, position: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [length, head_dim] of positions [position, position + length): each pair (j, j + head_dim/2)
    of a query or key turns by position · rope_theta^(-2j/head_dim), as `LlamaRotaryEmbedding` computes."""
    half = torch.arange(0, spec.head_dim, 2, dtype=torch.int64, device=device).float() / spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta**half)
    positions = torch.arange(position, position + length, device=device).float()
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` [batch, heads, length, head_dim] rotated (the half-split convention of `transformers`)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention over `heads` query heads sharing `kv_heads` key/value heads (all
    of the model's, or one tensor-parallel rank's whole groups of them)."""

    def __init__(self, spec: LlamaSpec, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.spec, self.heads, self.kv_heads = spec, heads, kv_heads
        hd = spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, heads * hd, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(x, 0, None)

    def decode(self, x: torch.Tensor, position: int, cache: KVCache | None) -> torch.Tensor:
        """Positions [position, position + t); with a `cache`, attending to its earlier positions too."""
        b, t, _ = x.shape
        hd = self.spec.head_dim
        q = self.q_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        cos, sin = rotary(self.spec, position, t, x.device)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k, v = cache.extend(k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(t, position, x.device), enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * hd))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)) over `intermediate` units (all, or a rank's slice)."""

    def __init__(self, spec: LlamaSpec, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual layer. `self_attn` and `mlp` are whole, or one tensor-parallel rank's part of them
    (`arceus.model.llama.parallel`): either way they return the whole output."""

    def __init__(self, spec: LlamaSpec, self_attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), position, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def llama_decoder_layer(spec: LlamaSpec, generator: torch.Generator) -> LlamaDecoderLayer:
    layer = LlamaDecoderLayer(
        spec, LlamaAttention(spec, spec.num_attention_heads, spec.num_key_value_heads),
        LlamaMLP(spec, spec.intermediate_size),
    )
    with torch.no_grad():  # `transformers`' init: linear weights N(0, 0.02), norms at one
        for name, param in layer.named_parameters():
            if "layernorm" not in name:
                nn.init.normal_(param, 0.0, INIT_STD, generator=generator)
    return layer


class LlamaHead(nn.Module):
    def __init__(self, spec: LlamaSpec, generator: torch.Generator) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        with torch.no_grad():
            nn.init.normal_(self.lm_head.weight, 0.0, INIT_STD, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def decode(self, x: torch.Tensor, position: int, cache: KVCache) -> torch.Tensor:
        return self.forward(x)


def llama_layer(spec: LlamaSpec, index: int, generator: torch.Generator) -> nn.Module:
    """Pipeline layer `index` of the model, initialised from `generator` only."""
    if index == 0:
        return LlamaEmbedding(spec, generator)
    if index == spec.num_layers - 1:
        return LlamaHead(spec, generator)
    return llama_decoder_layer(spec, generator)

"""The Llama-family decoder's spec: torch-free sizes and costs of each pipeline layer.

Its config keys are Hugging Face `LlamaConfig`'s (`hidden_size`, `intermediate_size`, `num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `rms_norm_eps`, `rope_theta`, `vocab_size`,
`max_position_embeddings`), so a model trained here is a `LlamaForCausalLM`. Every sample is a window of
`max_position_embeddings` tokens (the pipeline's fixed block size). Pipeline layers: 0 is the token
embedding, 1..num_hidden_layers the decoder layers, the last the final RMSNorm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from arceus.errors import SpecError
from arceus.model.layout import TensorLayout
from arceus.model.spec import LayerStash
from arceus.model.spec_fields import known_keys_check, positive_int, text_vocab
from arceus.model.text_layouts import TextDecoderLayouts
from arceus.model.tied import tied_config

LLAMA_DEFAULTS = {
    "hidden_size": 256,
    "intermediate_size": 688,  # Llama's ratio (11008 / 4096) at 256
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "max_position_embeddings": 128,
}
_LIMITS = {
    "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 256, "num_attention_heads": 1024,
    "num_key_value_heads": 1024, "max_position_embeddings": 65536, "vocab_size": 1_000_000,
}
_FLOATS = {"rms_norm_eps": (1e-6, 0.0, 1.0), "rope_theta": (10000.0, 1.0, 1e9)}  # default, exclusive low, high
_KEYS = frozenset(
    {"type", "vocab", "vocab_size", "num_key_value_heads", "tie_word_embeddings", *LLAMA_DEFAULTS, *_FLOATS}
)


@dataclass(frozen=True)
class LlamaSpec(TextDecoderLayouts):
    type: ClassVar[str] = "llama"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab: str = "char"  # the tokenizer: "char" (the text's distinct characters) or "bpe"
    tie_word_embeddings: bool = False  # the LM head's weight is embed_tokens' (arceus.model.tied)
    embedding_weight: ClassVar[str] = "embed_tokens.weight"

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers + 2

    @property
    def block_size(self) -> int:
        """Tokens per sample: the model's whole context."""
        return self.max_position_embeddings

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of the keys (and of the values): the key/value heads' dims together."""
        return self.num_key_value_heads * self.head_dim

    def layer_params(self) -> list[int]:
        d, v, i = self.hidden_size, self.vocab_size, self.intermediate_size
        # two RMSNorms + q and o (d² each) + k and v (d·kv each) + gate, up and down (d·i each); no biases
        block = 2 * d + 2 * d * d + 2 * d * self.kv_size + 3 * d * i
        return [v * d, *[block] * self.num_hidden_layers, d + d * v]

    def layer_parameters(self, layer: int) -> dict[str, list[int]]:
        """Each parameter's shape in `layer`, by its name in the layer (`arceus.model.llama.layers`)."""
        d, v, i = self.hidden_size, self.vocab_size, self.intermediate_size
        if layer == 0:
            return {"embed_tokens.weight": [v, d]}
        if layer == self.num_layers - 1:
            return {"norm.weight": [d], "lm_head.weight": [v, d]}
        q = self.num_attention_heads * self.head_dim
        return {
            "self_attn.q_proj.weight": [q, d], "self_attn.k_proj.weight": [self.kv_size, d],
            "self_attn.v_proj.weight": [self.kv_size, d], "self_attn.o_proj.weight": [d, q],
            "mlp.gate_proj.weight": [i, d], "mlp.up_proj.weight": [i, d], "mlp.down_proj.weight": [d, i],
            "input_layernorm.weight": [d], "post_attention_layernorm.weight": [d],
        }

    def layer_buffers(self, layer: int) -> dict[str, tuple[str, list[int]]]:
        """None: its layers hold no persistent buffer."""
        return {}

    def layer_flops_per_sample(self) -> list[int]:
        """Forward FLOPs per sample (block_size tokens): 2 per multiply-add of each matmul, plus the attention
        scores and their weighted sum (2·T²·d each). Lookups, norms, rotations and softmax are ignored."""
        d, v, t = self.hidden_size, self.vocab_size, self.block_size
        matmuls = 2 * d * d + 2 * d * self.kv_size + 3 * d * self.intermediate_size
        return [t * d, *[2 * t * matmuls + 4 * t * t * d] * self.num_hidden_layers, 2 * t * d * v]

    def layer_stash(self) -> list[LayerStash]:
        """Besides its input a decoder layer keeps, per token, 7 vectors of hidden_size floats, 2 of the key/value
        width and 4 of intermediate_size, as measured under saved-tensor hooks with torch 2.13 on CPU
        (tests/arceus/placement/test_placement_stash.py); the head its normalised input and the log-softmax
        of the logits its loss keeps."""
        d, v, t, i = self.hidden_size, self.vocab_size, self.block_size, self.intermediate_size
        block = 4 * t * (LLAMA_STASH_HIDDEN * d + LLAMA_STASH_KV * self.kv_size + LLAMA_STASH_MLP * i)
        return [LayerStash(0), *[LayerStash(block)] * self.num_hidden_layers, LayerStash(4 * t * (2 * d + v))]

    @property
    def width(self) -> int:
        return self.hidden_size


# Vectors per token a decoder layer's training forward keeps (see `LlamaSpec.layer_stash`).
LLAMA_STASH_HIDDEN, LLAMA_STASH_KV, LLAMA_STASH_MLP = 7, 2, 4


def llama_from_config(config: dict[str, Any]) -> LlamaSpec:
    known_keys_check(config, _KEYS, "a llama")
    sizes = {key: positive_int(config, key, default, _LIMITS[key]) for key, default in LLAMA_DEFAULTS.items()}
    heads = sizes["num_attention_heads"]
    if sizes["hidden_size"] % heads or (sizes["hidden_size"] // heads) % 2:
        raise SpecError(
            "model_config.hidden_size",
            f"must be num_attention_heads ({heads}) times an even head size (rotary embeddings rotate pairs), "
            f"got {sizes['hidden_size']}",
        )
    kv_heads = positive_int(config, "num_key_value_heads", heads, _LIMITS["num_key_value_heads"])
    if heads % kv_heads:
        raise SpecError(
            "model_config.num_key_value_heads",
            f"must divide num_attention_heads ({heads}): each key/value head serves a whole group of query heads, "
            f"got {kv_heads}",
        )
    vocab = text_vocab(config)
    vocab_size = positive_int(config, "vocab_size", None, _LIMITS["vocab_size"])
    return LlamaSpec(
        **sizes, num_key_value_heads=kv_heads, vocab_size=vocab_size,
        **{key: _float(config, key) for key in _FLOATS}, vocab=vocab,
        tie_word_embeddings=tied_config(config.get("tie_word_embeddings", False), "model_config.tie_word_embeddings"),
    )


def _float(config: dict[str, Any], key: str) -> float:
    default, low, high = _FLOATS[key]
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
        raise SpecError(f"model_config.{key}", f"must be a number above {low:g} and at most {high:g}, got {value!r}")
    return float(value)


def tensor_parallel_reduced_layout(spec: LlamaSpec) -> TensorLayout:
    """What the ranks all-reduce: a layer's [block_size, hidden_size] hidden states."""
    return spec.output_layout(1)


def tensor_parallel_check_size(spec: LlamaSpec, size: int) -> None:
    """Whole key/value groups and an equal share of the MLP's units per rank."""
    kv = spec.num_key_value_heads
    if size < 1 or kv % size or spec.intermediate_size % size:
        fits = [d for d in range(2, kv + 1) if kv % d == 0 and spec.intermediate_size % d == 0]
        raise SpecError(
            "tensor_parallel.size",
            f"must divide the model's num_key_value_heads ({kv}) and intermediate_size ({spec.intermediate_size}) "
            "so each node takes whole key/value head groups and an equal share of the MLP; "
            + (f"use one of {', '.join(map(str, fits))}" if fits else "this model's layers cannot be split"),
        )

"""The GPT (decoder-only transformer) spec: torch-free sizes and costs of each pipeline layer.

Pipeline layers: 0 is the token + position embedding, 1..n_layer are the transformer blocks, and the
last is the final LayerNorm + LM head. So the layer-range partitioning that splits an MLP splits a GPT.
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

GPT_DEFAULTS = {"n_layer": 6, "n_head": 8, "d_model": 256, "block_size": 128}
_LIMITS = {"n_layer": 256, "n_head": 1024, "d_model": 65536, "block_size": 65536, "vocab_size": 1_000_000}
_GPT_KEYS = frozenset({"type", "vocab", "vocab_size", "tie_word_embeddings", *GPT_DEFAULTS})


@dataclass(frozen=True)
class GPTSpec(TextDecoderLayouts):
    type: ClassVar[str] = "transformer"
    n_layer: int
    n_head: int
    d_model: int
    block_size: int
    vocab_size: int
    vocab: str = "char"  # "char": the dataset's distinct characters, sorted; "bpe": byte-level BPE
    tie_word_embeddings: bool = False  # the LM head's weight is wte's (arceus.model.tied)
    embedding_weight: ClassVar[str] = "wte.weight"

    @property
    def num_layers(self) -> int:
        return self.n_layer + 2

    @property
    def num_classes(self) -> int:
        return self.vocab_size

    def layer_params(self) -> list[int]:
        d, v, t = self.d_model, self.vocab_size, self.block_size
        # LN (2d) + qkv (3d² + 3d) + proj (d² + d) + LN (2d) + MLP (4d² + 4d + 4d² + d)
        block = 12 * d * d + 13 * d
        return [v * d + t * d, *[block] * self.n_layer, 2 * d + d * v]  # the head has no bias

    def layer_parameters(self, layer: int) -> dict[str, list[int]]:
        """Each parameter's shape in `layer`, by its name in the layer (`arceus.model.gpt.layers`)."""
        d, v = self.d_model, self.vocab_size
        if layer == 0:
            return {"wte.weight": [v, d], "wpe.weight": [self.block_size, d]}
        if layer == self.num_layers - 1:
            return {"ln_f.weight": [d], "ln_f.bias": [d], "lm_head.weight": [v, d]}
        return {
            "ln_1.weight": [d], "ln_1.bias": [d],
            "attn.c_attn.weight": [3 * d, d], "attn.c_attn.bias": [3 * d],
            "attn.c_proj.weight": [d, d], "attn.c_proj.bias": [d],
            "ln_2.weight": [d], "ln_2.bias": [d],
            "mlp.c_fc.weight": [4 * d, d], "mlp.c_fc.bias": [4 * d],
            "mlp.c_proj.weight": [d, 4 * d], "mlp.c_proj.bias": [d],
        }

    def layer_buffers(self, layer: int) -> dict[str, tuple[str, list[int]]]:
        """None: its layers hold no persistent buffer."""
        return {}

    def layer_flops_per_sample(self) -> list[int]:
        """Forward FLOPs per sample (block_size tokens): 2 per multiply-add of each matmul, plus the
        attention scores and their weighted sum (2·T²·d each). Lookups, norms and softmax are ignored."""
        d, v, t = self.d_model, self.vocab_size, self.block_size
        block = 24 * t * d * d + 4 * t * t * d
        return [t * d, *[block] * self.n_layer, 2 * t * d * v]

    def layer_stash(self) -> list[LayerStash]:
        """Besides its input a block keeps 15 tensors of T·d floats (norms, q/k/v, the attention output, the
        MLP's 4·d hidden units before and after GELU; CPU attention keeps no T×T scores), as measured with
        torch 2.13 on CPU; the head its normalised input and the log-softmax of the logits its loss keeps."""
        d, v, t = self.d_model, self.vocab_size, self.block_size
        return [LayerStash(0), *[LayerStash(4 * 15 * t * d)] * self.n_layer, LayerStash(4 * t * (d + v))]

    @property
    def width(self) -> int:
        return self.d_model


def gpt_from_config(config: dict[str, Any]) -> GPTSpec:
    known_keys_check(config, _GPT_KEYS, "a transformer")
    sizes = {key: positive_int(config, key, default, _LIMITS[key]) for key, default in GPT_DEFAULTS.items()}
    if sizes["d_model"] % sizes["n_head"]:
        raise SpecError(
            "model_config.d_model",
            f"must be divisible by n_head ({sizes['n_head']}), got {sizes['d_model']}",
        )
    vocab = text_vocab(config)
    return GPTSpec(
        **sizes, vocab_size=positive_int(config, "vocab_size", None, _LIMITS["vocab_size"]), vocab=vocab,
        tie_word_embeddings=tied_config(config.get("tie_word_embeddings", False), "model_config.tie_word_embeddings"),
    )


def tensor_parallel_reduced_layout(spec: GPTSpec) -> TensorLayout:
    """What the ranks all-reduce: a block's [block_size, d_model] hidden states."""
    return spec.output_layout(1)


def tensor_parallel_check_size(spec: GPTSpec, size: int) -> None:
    """Whole heads per rank (its MLP then splits too: 4·d_model hidden units, and n_head divides d_model)."""
    if spec.n_head % size:
        divisors = [d for d in range(2, spec.n_head + 1) if spec.n_head % d == 0]
        raise SpecError(
            "tensor_parallel.size",
            f"must divide the model's n_head ({spec.n_head}) so each node takes whole attention heads; "
            + (f"use one of {', '.join(map(str, divisors))}" if divisors else "a single head cannot be split"),
        )

"""A GPT in Hugging Face's terms: its `config.json` and each parameter's `GPT2LMHeadModel` name, so the trained
weights load with `transformers.GPT2LMHeadModel.from_pretrained` (and such weights load here).

The blocks are GPT-2's (pre-LayerNorm, fused query/key/value, a 4x MLP) with the exact GELU (`activation_function`
"gelu"; GPT-2's own checkpoints use its tanh approximation, "gelu_new", which this model does not compute) and an
LM head of its own, or with `tie_word_embeddings` the head's weight is `transformer.wte.weight` (the folder stores
that one tensor; arceus.model.tied keeps the two pipeline copies equal). Pipeline names are "layers.<i>.<name in
layer i>": layer 0 holds `transformer.wte` and `transformer.wpe`, layer i in 1..n_layer is `transformer.h.<i-1>`,
and the head holds `transformer.ln_f` and `lm_head`. GPT-2's Conv1D stores its weights as [in, out]: those are
transposed.
"""

from __future__ import annotations

from typing import Any

from arceus.model.gpt.spec import GPTSpec
from arceus.model.spec import split_global_param_name

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# `HuggingFaceFormat.computes`: GPT2Config's defaults of the keys that change the function but no shape.
HF_COMPUTES = {
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
}


def hf_config(spec: GPTSpec) -> dict[str, Any]:
    """`config.json` of the model as `GPT2Config` reads it."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": spec.vocab_size,
        "n_positions": spec.block_size,
        "n_embd": spec.d_model,
        "n_layer": spec.n_layer,
        "n_head": spec.n_head,
        "n_inner": 4 * spec.d_model,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "float32",
    }


def hf_name(spec: GPTSpec, name: str) -> str:
    """The `GPT2LMHeadModel` name of the pipeline parameter `name`; ValueError for a name the model lacks."""
    index, rest = split_global_param_name(name)
    if index == 0 and rest in ("wte.weight", "wpe.weight"):
        return f"transformer.{rest}"
    if index == spec.num_layers - 1 and rest == "lm_head.weight" and spec.tie_word_embeddings:
        return "transformer.wte.weight"
    if index == spec.num_layers - 1 and rest in ("ln_f.weight", "ln_f.bias", "lm_head.weight"):
        return rest if rest.startswith("lm_head") else f"transformer.{rest}"
    if 1 <= index <= spec.n_layer:
        return f"transformer.h.{index - 1}.{rest}"
    raise ValueError(f"{name!r} is no parameter of this model's layer {index}")


def hf_transposed(spec: GPTSpec, name: str) -> bool:
    """Whether `GPT2LMHeadModel` stores the pipeline parameter `name` transposed (a Conv1D weight)."""
    return name.endswith(_CONV1D)

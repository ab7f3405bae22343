"""A Llama model in Hugging Face's terms: its `config.json` and each parameter's `LlamaForCausalLM` name, so
the trained weights load with `transformers.LlamaForCausalLM.from_pretrained` (and such weights load here).

Pipeline names are "layers.<i>.<name in layer i>"; layer 0 is `model.embed_tokens`, layer i in
1..num_hidden_layers is `model.layers.<i-1>`, and the head holds `model.norm` and `lm_head` (with
`tie_word_embeddings`, `lm_head.weight` is `model.embed_tokens.weight`: one tensor in the folder).
"""

from __future__ import annotations

from typing import Any

from arceus.model.llama.spec import LlamaSpec
from arceus.model.spec import split_global_param_name

# `HuggingFaceFormat.computes`: LlamaConfig's defaults of the keys that change the function but no shape.
HF_COMPUTES = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False,
}


def hf_config(spec: LlamaSpec) -> dict[str, Any]:
    """`config.json` of the model as `LlamaConfig` reads it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": "float32",
    }


def hf_name(spec: LlamaSpec, name: str) -> str:
    """The `LlamaForCausalLM` name of the pipeline parameter `name`; ValueError for a name the model lacks."""
    index, rest = split_global_param_name(name)
    if index == 0 and rest == "embed_tokens.weight":
        return f"model.{rest}"
    if index == spec.num_layers - 1 and rest == "lm_head.weight" and spec.tie_word_embeddings:
        return "model.embed_tokens.weight"
    if index == spec.num_layers - 1 and rest in ("norm.weight", "lm_head.weight"):
        return rest if rest.startswith("lm_head") else f"model.{rest}"
    if 1 <= index <= spec.num_hidden_layers:
        return f"model.layers.{index - 1}.{rest}"
    raise ValueError(f"{name!r} is no parameter of this model's layer {index}")

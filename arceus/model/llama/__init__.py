"""The Llama-family decoder (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) with Hugging Face
`LlamaConfig` keys: `{"type": "llama", "hidden_size", "intermediate_size", "num_hidden_layers",
"num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta",
"vocab", "vocab_size"}`; its decoder layers split over tensor-parallel groups, and its weights export as a
`transformers` `LlamaForCausalLM` folder."""

from functools import partial

from arceus.model.architecture import Architecture, HuggingFaceFormat, TensorParallelSplit
from arceus.model.llama.hf import HF_COMPUTES, hf_config, hf_name
from arceus.model.llama.spec import llama_from_config, tensor_parallel_check_size, tensor_parallel_reduced_layout
from arceus.model.text_fit import fit_text_model

ARCHITECTURE = Architecture(
    type="llama",
    from_config=llama_from_config,
    fit_dataset=partial(fit_text_model, from_config=llama_from_config, block_key="max_position_embeddings"),
    tensor_parallel=TensorParallelSplit(
        reduced_layout=tensor_parallel_reduced_layout, check_size=tensor_parallel_check_size
    ),
    writes_text=True,
    hugging_face=HuggingFaceFormat(config=hf_config, name=hf_name, computes=HF_COMPUTES),
)

"""The GPT (nanoGPT-style decoder): `{"type": "transformer", "n_layer", "n_head", "d_model", "block_size",
"vocab", "vocab_size"}`; its blocks split over tensor-parallel groups, and its weights export as a `transformers`
`GPT2LMHeadModel` folder."""

from functools import partial

from arceus.model.architecture import Architecture, HuggingFaceFormat, TensorParallelSplit
from arceus.model.gpt.hf import HF_COMPUTES, hf_config, hf_name, hf_transposed
from arceus.model.gpt.spec import gpt_from_config, tensor_parallel_check_size, tensor_parallel_reduced_layout
from arceus.model.text_fit import fit_text_model

ARCHITECTURE = Architecture(
    type="transformer",
    from_config=gpt_from_config,
    fit_dataset=partial(fit_text_model, from_config=gpt_from_config, block_key="block_size"),
    tensor_parallel=TensorParallelSplit(
        reduced_layout=tensor_parallel_reduced_layout, check_size=tensor_parallel_check_size
    ),
    writes_text=True,
    hugging_face=HuggingFaceFormat(config=hf_config, name=hf_name, transposed=hf_transposed, computes=HF_COMPUTES),
)

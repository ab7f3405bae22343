"""The GPT (nanoGPT-style decoder): `{"type": "transformer", "n_layer", "n_head", "d_model", "block_size",
"vocab", "vocab_size"}`; its blocks split over tensor-parallel groups."""

from functools import partial

from arceus.model.architecture import Architecture, TensorParallelLayers
from arceus.model.gpt import parallel
from arceus.model.gpt.layers import gpt_layer
from arceus.model.gpt.spec import gpt_from_config
from arceus.model.text_fit import fit_text_model

ARCHITECTURE = Architecture(
    type="transformer",
    from_config=gpt_from_config,
    build_layer=gpt_layer,
    fit_dataset=partial(fit_text_model, from_config=gpt_from_config, block_key="block_size"),
    tensor_parallel=TensorParallelLayers(
        build_layer=parallel.parallel_layer,
        shard_rows=parallel.shard_rows,
        reduced_layout=parallel.reduced_layout,
        check_size=parallel.check_size,
    ),
    writes_text=True,
)

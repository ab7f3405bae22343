"""The multi-layer perceptron: `{"type": "mlp", "layer_sizes": [...], "activation": "relu"}`."""

from arceus.model.architecture import Architecture
from arceus.model.mlp.fit import fit_mlp_to_dataset
from arceus.model.mlp.spec import mlp_from_config

ARCHITECTURE = Architecture(type="mlp", from_config=mlp_from_config, fit_dataset=fit_mlp_to_dataset)

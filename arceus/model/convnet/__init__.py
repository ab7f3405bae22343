"""The small CNN for the image datasets: `{"type": "convnet", "channels": [8, 16], "kernel_size": 3,
"activation": "relu"}`; job submission fills in `input_shape` and `classes` from the dataset."""

from arceus.model.architecture import Architecture
from arceus.model.convnet.fit import fit_convnet_to_dataset
from arceus.model.convnet.spec import convnet_from_config

ARCHITECTURE = Architecture(type="convnet", from_config=convnet_from_config, fit_dataset=fit_convnet_to_dataset)

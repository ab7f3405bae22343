"""Any PyTorch model, captured: a developer's `nn.Module` exported to ATen graphs cut into pipeline layers
(`capture`), shipped to agents as data (schema-based JSON and safetensors) and rebuilt there only from operators
an allow-list names. `{"type": "exported", ...}` is what `capture` writes (`arceus.model.exported.spec`)."""

from arceus.model.architecture import Architecture
from arceus.model.exported.fit import fit_exported_to_dataset
from arceus.model.exported.spec import SPEC_TYPE, exported_from_config

ARCHITECTURE = Architecture(
    type=SPEC_TYPE,
    from_config=exported_from_config,
    fit_dataset=fit_exported_to_dataset,
    ships_program=True,
)

"""What a hostile developer could upload as an exported model: a captured program with one node's operator
replaced and every hash (the layer's, the program's) made to match, so only the operator check can refuse it."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from arceus.model.exported.capture import CapturedModel
from arceus.model.exported.program import program_document


def forged_program(captured: CapturedModel, layer: int, target: str) -> tuple[dict[str, Any], list[str], bytes]:
    """(model config, layer documents, program) of `captured` with layer `layer`'s first node calling `target`
    (a serialized operator name, "torch.ops.aten.from_file.default")."""
    layers = json.loads(captured.program)["layers"]
    document = json.loads(layers[layer])
    document["graph"]["graph_module"]["graph"]["nodes"][0]["target"] = target
    layers[layer] = json.dumps(document, sort_keys=True)
    program = program_document(layers)
    config = copy.deepcopy(captured.model_config)
    config["layers"][layer]["sha256"] = hashlib.sha256(layers[layer].encode()).hexdigest()
    config["program_sha256"] = hashlib.sha256(program).hexdigest()
    return config, layers, program

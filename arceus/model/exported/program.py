"""An exported model's program as it is uploaded, stored and fetched: a JSON document holding one document per
pipeline layer, each a string whose SHA-256 the job's `model_config` names (so an agent checks the layers it
fetched against the job it was assigned, whoever served them). A layer's document is its graph (torch's
schema-based serialized `ExportedProgram`, never a pickle) and its buffers and constants (safetensors, base64);
its parameters travel in the job's initial weights. Torch-free: the control plane checks uploads with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from arceus.errors import SpecError
from arceus.json_input import json_depth_check
from arceus.model.exported.operators import graph_check

FORMAT = "arceus.exported-program/1"
MAX_PROGRAM_BYTES = 64 * 1024 * 1024  # the whole uploaded document (graphs and small tensors, no weights)


def program_document(layers: list[str]) -> bytes:
    return json.dumps({"format": FORMAT, "layers": layers}).encode()


def layer_document(graph: dict[str, Any], tensors: bytes) -> str:
    """One layer's document: its serialized graph and its buffers/constants (a safetensors file's bytes)."""
    return json.dumps({"graph": graph, "tensors": base64.b64encode(tensors).decode()}, sort_keys=True)


def program_layers(data: bytes, hashes: list[str]) -> list[str]:
    """The layer documents of an uploaded program, each checked against its hash in `hashes` (the model
    config's) and its graph against the operator allow-list; SpecError("program...") naming what is wrong."""
    try:
        json_depth_check(data.decode(), where="program")
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError("program", f"is not JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SpecError("program", f"must be a JSON object with format {FORMAT!r} (what arceus capture() writes)")
    layers = document.get("layers")
    if not isinstance(layers, list) or len(layers) != len(hashes):
        raise SpecError("program.layers", f"must list the model's {len(hashes)} layers' documents")
    for index, layer in enumerate(layers):
        layer_parsed(layer, hashes[index], f"program.layers[{index}]")
    return layers


def layer_parsed(layer: Any, sha256: str, where: str) -> tuple[dict[str, Any], bytes]:
    """(serialized graph, safetensors bytes of its buffers and constants) of one layer's document, once it
    matches `sha256` and its graph passes the operator allow-list; SpecError(`where`, why) otherwise."""
    if not isinstance(layer, str) or hashlib.sha256(layer.encode()).hexdigest() != sha256:
        raise SpecError(where, "does not match the SHA-256 the model config names for it; capture the model again")
    json_depth_check(layer, where=where)
    parsed = json.loads(layer)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("tensors"), str):
        raise SpecError(where, "must be an object with a graph and its tensors")
    graph_check(parsed.get("graph"), where)
    try:
        tensors = base64.b64decode(parsed["tensors"], validate=True)
    except binascii.Error as exc:
        raise SpecError(where, f"tensors are not base64: {exc}") from exc
    return parsed["graph"], tensors

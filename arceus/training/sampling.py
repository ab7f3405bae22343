"""Sampling text through a pipeline's agents: the tokens go to the first stage, each stage's output to the
next, and the last stage's logits come back; every stage keeps its own layers' key/value cache, so a new
token costs one position on each stage and no process, this one included, holds the model."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import torch

from arceus.data.tokenizer import TextTokenizer
from arceus.model.generate import Decoder, generate, prompt_ids, text_spec
from arceus.training.plan import StageEndpoint
from arceus.training.stage_client import StageClient


class SamplingError(RuntimeError):
    """A stage could not decode; `stage_index` and `code` (a grpc.StatusCode name) say which and how."""

    def __init__(self, message: str, *, stage_index: int, code: str) -> None:
        super().__init__(message)
        self.stage_index = stage_index
        self.code = code


def pipeline_decoder(clients: list[StageClient]) -> Decoder:
    """A Decoder over the stages' agents, with a session of its own on each."""
    session = uuid.uuid4().hex

    def decoder(ids: torch.Tensor, start: int) -> torch.Tensor:
        x = ids
        for client in clients:
            try:
                x = client.infer(session, start, x)
            except grpc.RpcError as exc:
                code = exc.code()
                raise SamplingError(
                    f"{client.describe()} could not decode: {code.name if code else 'UNKNOWN'}: {exc.details()}",
                    stage_index=client.endpoint.index,
                    code=code.name if code else "UNKNOWN",
                ) from exc
        return x

    return decoder


def sample_through_pipeline(
    stages: tuple[StageEndpoint, ...],
    *,
    job_id: str,
    generation: int,
    credential: str,
    model_config: dict[str, Any],
    tokenizer: TextTokenizer,
    prompt: str,
    length: int,
    temperature: float,
    seed: int,
    timeout: float,
) -> str:
    """`prompt` followed by `length` tokens sampled from the model its stages' agents hold now (temperature 0:
    always the likeliest), calling them as the job's driver (`credential`). ValueError if the model is no text
    model of this tokenizer, or the prompt is empty; SamplingError if a stage fails."""
    spec = text_spec(model_config, tokenizer)
    ids = prompt_ids(tokenizer, prompt)
    clients = [
        StageClient(s, job_id=job_id, generation=generation, credential=credential, timeout=timeout) for s in stages
    ]
    try:
        out = generate(
            pipeline_decoder(clients), spec.block_size, ids, length, temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
        )
    finally:
        for client in clients:
            client.close()
    return tokenizer.decode(out[0].tolist())

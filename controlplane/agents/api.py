"""Agent endpoints for a job's files: a stage checkpoint to resume from, layers of uploaded initial weights and of an
exported model's program, and a stage's checkpoint upload. Each authenticates the node's token
(`controlplane.nodes.api.AgentApi`) and serves only what the node's assignments name."""

from __future__ import annotations

from django.conf import settings
from django.http import FileResponse, StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.common.body_limit import declared_length
from controlplane.common.schema import ErrorOutput
from controlplane.jobs.checkpoints import (
    checkpoint_upload_receive,
    job_initial_weights_slice_for_node,
    stage_checkpoint_for_node,
)
from controlplane.jobs.models import checkpoint_storage
from controlplane.jobs.programs import job_program_layers_for_node
from controlplane.nodes.api import AgentApi


class AgentCheckpointApi(AgentApi):
    """A stage checkpoint named in one of this node's assignments (safetensors bytes)."""

    @extend_schema(responses={(200, "application/octet-stream"): bytes})
    def get(self, request: Request, checkpoint_id: str) -> FileResponse:
        sc = stage_checkpoint_for_node(node_id=request.auth.id, stage_checkpoint_id=checkpoint_id)
        response = FileResponse(checkpoint_storage().open(sc.file.name, "rb"), content_type="application/octet-stream")
        response["X-Checkpoint-SHA256"] = sc.sha256
        return response


# The layers an agent asks for (its stage's): initial weights and an exported model's program.
LAYER_RANGE = [
    OpenApiParameter("start", int, OpenApiParameter.QUERY, description="First layer"),
    OpenApiParameter("end", int, OpenApiParameter.QUERY, description="One past the last layer"),
]


class AgentInitialWeightsApi(AgentApi):
    """Layers [start, end) of the uploaded initial weights of a job, for a node hosting a stage that holds them:
    a safetensors file of those layers' weights under the pipeline's names, cut from the upload as it streams;
    the agent checks each layer against the digest its assignment carries."""

    @extend_schema(
        parameters=LAYER_RANGE,
        responses={(200, "application/octet-stream"): bytes, 409: ErrorOutput},
    )
    def get(self, request: Request, job_id: str) -> StreamingHttpResponse:
        weights = job_initial_weights_slice_for_node(
            node_id=request.auth.id,
            job_id=job_id,
            start=request.query_params.get("start"),
            end=request.query_params.get("end"),
        )
        response = StreamingHttpResponse(weights.chunks, content_type="application/octet-stream")
        response["Content-Length"] = str(weights.size_bytes)
        return response


class AgentProgramApi(AgentApi):
    """Layers [start, end) of an exported model's program, for a node hosting a stage that holds them: `{"layers":
    [document, ...]}`; the agent checks each against the hash its assignment's model config names."""

    @extend_schema(
        parameters=LAYER_RANGE,
        responses={200: dict},
    )
    def get(self, request: Request, job_id: str) -> Response:
        layers = job_program_layers_for_node(
            node_id=request.auth.id,
            job_id=job_id,
            start=request.query_params.get("start"),
            end=request.query_params.get("end"),
        )
        return Response({"layers": layers})


class AgentCheckpointUploadApi(AgentApi):
    """An agent uploads its stage's state file for a checkpoint the driver opened (safetensors bytes with a
    Content-Length), streamed into the checkpoint storage."""

    parser_classes: list = []  # the body is read as a stream, never parsed or held whole

    @staticmethod
    def max_request_bytes() -> int:  # not the JSON API's bound (controlplane.common.body_limit)
        return settings.ARCEUS_MAX_CHECKPOINT_UPLOAD_BYTES

    @extend_schema(request={"application/octet-stream": bytes}, responses={201: dict, 409: ErrorOutput})
    def put(self, request: Request, upload_id: str) -> Response:
        upload = checkpoint_upload_receive(
            node_id=request.auth.id,
            upload_id=upload_id,
            body=request._request,
            length=declared_length(request),
        )
        return Response({"sha256": upload.sha256, "size_bytes": upload.size_bytes}, status=201)

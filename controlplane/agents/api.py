"""The node agents' endpoints: registration (and its challenge), heartbeats, leaving, the link probe, and a job's
files (a stage checkpoint to resume from, layers of uploaded initial weights and of an exported model's program, a
stage's checkpoint upload, byte ranges of the uploaded dataset a first or last stage reads). Each authenticates the
node's token; the file endpoints serve only what the node's assignments name."""

from __future__ import annotations

from django.conf import settings
from django.http import FileResponse, HttpResponse, StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from controlplane.agents.heartbeat import heartbeat_body
from controlplane.agents.services import node_heartbeat, node_leave, node_register
from controlplane.common.body_limit import declared_length
from controlplane.common.client_ip import client_ip
from controlplane.common.schema import ErrorOutput
from controlplane.jobs.checkpoints import (
    checkpoint_upload_direct_abort,
    checkpoint_upload_direct_complete,
    checkpoint_upload_direct_start,
    checkpoint_upload_receive,
    job_initial_weights_slice_for_node,
    stage_checkpoint_for_node,
    stage_checkpoint_open,
    stage_checkpoint_url,
)
from controlplane.jobs.dataset_reads import job_dataset_read_for_node
from controlplane.jobs.programs import job_program_layers_for_node
from controlplane.nodes import schema
from controlplane.nodes.authentication import IsNodeAgent, NodeTokenAuthentication
from controlplane.nodes.models import Node
from controlplane.nodes.possession import CHALLENGE_SECONDS, registration_challenge_new, registration_possession_check
from controlplane.nodes.serializers import (
    AgentChallengeOutput,
    AgentHeartbeatOutput,
    AgentLeftOutput,
    AgentRegisteredOutput,
    AgentRegisterInput,
    CheckpointPartsCompleteInput,
    CheckpointPartsStartInput,
)


class AgentApi(APIView):
    """An endpoint a node's agent calls with its token (also the market's earnings for the agent)."""

    authentication_classes = [NodeTokenAuthentication]
    permission_classes = [IsNodeAgent]


class _RegistrationThrottle(SimpleRateThrottle):
    def get_cache_key(self, request: Request, view: APIView) -> str | None:
        ident = self.ident(request)
        return None if ident is None else self.cache_format % {"scope": self.scope, "ident": ident}

    def ident(self, request: Request) -> str | None:
        raise NotImplementedError


class RegistrationOwnerThrottle(_RegistrationThrottle):
    """Registrations of one owner's nodes (ARCEUS_THROTTLE_AGENT_REGISTER_OWNER)."""

    scope = "agent_register_owner"

    def ident(self, request: Request) -> str | None:
        return str(request.auth.owner_id) if isinstance(request.auth, Node) else None


class RegistrationAddressThrottle(_RegistrationThrottle):
    """Registrations from one client address, any owner's (ARCEUS_THROTTLE_AGENT_REGISTER_ADDRESS)."""

    scope = "agent_register_address"

    def ident(self, request: Request) -> str | None:
        return client_ip(request)


class AgentChallengeApi(AgentApi):
    """What the agent signs with its TLS key to register its certificate (arceus/contracts/possession.py)."""

    @extend_schema(request=None, responses=AgentChallengeOutput)
    def post(self, request: Request) -> Response:
        challenge = registration_challenge_new(node=request.auth, now=timezone.now())
        return Response({"challenge": challenge, "expires_in_seconds": CHALLENGE_SECONDS})


class AgentRegisterApi(AgentApi):
    throttle_classes = [RegistrationOwnerThrottle, RegistrationAddressThrottle]

    @extend_schema(request=AgentRegisterInput, responses={200: AgentRegisteredOutput, 409: ErrorOutput})
    def post(self, request: Request) -> Response:
        data = AgentRegisterInput(data=request.data)
        data.is_valid(raise_exception=True)
        now = timezone.now()
        registration_possession_check(
            node=request.auth, challenge=data.validated_data["challenge"],
            certificate=data.validated_data["tls_certificate"], proof=data.validated_data["tls_proof"], now=now,
        )
        node = node_register(
            node=request.auth,
            grpc_address=data.validated_data["grpc_address"],
            metrics_port=data.validated_data["metrics_port"],
            public_key=data.validated_data["public_key"],
            tls_certificate=data.validated_data["tls_certificate"],
            lan_address=data.validated_data["lan_address"],
            exchange_port=data.validated_data["exchange_port"],
            exchange_address=data.validated_data["exchange_address"],
            data_plane=data.validated_data["data_plane"],
            public_ip=client_ip(request),
            **data.validated_data["capabilities"],
            now=now,
        )
        return Response(
            {
                "node_id": str(node.id),
                "heartbeat_interval_seconds": settings.ARCEUS_HEARTBEAT_INTERVAL_SECONDS,
            }
        )


class AgentHeartbeatApi(AgentApi):
    @extend_schema(
        request={"application/json": schema.OPENAPI}, responses={200: AgentHeartbeatOutput, 409: ErrorOutput}
    )
    def post(self, request: Request) -> Response:
        try:
            beat = schema.heartbeat_parse(request.data)
        except schema.HeartbeatInvalid as exc:
            raise ValidationError(exc.errors) from None
        answer = node_heartbeat(
            node=request.auth,
            observed=beat.observed,
            now=timezone.now(),
            host_busy_fraction=beat.host_busy_fraction,
            link=beat.link,
            neighbour_links=beat.neighbour_links,
            assignments_version=beat.assignments_version,
        )
        body = heartbeat_body(
            node_id=str(request.auth.id), version=answer.assignments_version, max_threads=request.auth.max_threads,
            max_memory_bytes=request.auth.max_memory_bytes, reachability=request.auth.reachability,
            relay=beat.relay, step_grants=answer.step_grants,
        )
        if answer.assignments is not None:  # else unchanged from the version the agent sent
            body["assignments"] = answer.assignments
        return Response(body)


class AgentLeaveApi(AgentApi):
    """The agent is shutting down: its node drains like a paused one until the agent registers again."""

    @extend_schema(request=None, responses=AgentLeftOutput)
    def post(self, request: Request) -> Response:
        stages = node_leave(node=request.auth, now=timezone.now())
        return Response({"node_id": str(request.auth.id), "stages": stages})


class AgentProbeApi(AgentApi):
    """The agent times uploads to this to measure its round trip and bandwidth to the control plane."""

    max_bytes = 1024 * 1024  # below Django's DATA_UPLOAD_MAX_MEMORY_SIZE

    @extend_schema(request={"application/octet-stream": bytes}, responses={200: dict, 413: ErrorOutput})
    def post(self, request: Request) -> Response:
        size = len(request.body)
        if size > self.max_bytes:
            return Response({"detail": f"a probe carries at most {self.max_bytes} bytes"}, status=413)
        return Response({"bytes": size})


class AgentCheckpointApi(AgentApi):
    """A stage checkpoint named in one of this node's assignments (safetensors bytes); from an S3 bucket, a 307
    to a presigned URL of it instead: the agent GETs it from the bucket (without its node token)."""

    @extend_schema(responses={(200, "application/octet-stream"): bytes, 307: None})
    def get(self, request: Request, checkpoint_id: str) -> HttpResponse:
        sc = stage_checkpoint_for_node(node_id=request.auth.id, stage_checkpoint_id=checkpoint_id)
        url = stage_checkpoint_url(sc)
        if url is None:
            response: HttpResponse = FileResponse(stage_checkpoint_open(sc), content_type="application/octet-stream")
        else:
            response = HttpResponse(status=307)
            response["Location"] = url
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


class AgentDatasetReadApi(AgentApi):
    """Byte ranges of a job's uploaded tensor dataset, for a node hosting its first stage (the inputs' rows) or its
    last (the labels'): `{"ranges": [[start, stop], ...]}` answered with their bytes in order, or, from an S3 bucket,
    `{"urls": [...]}`, a presigned GET per range that the agent fetches itself (with the range as its Range header).
    The agent checks what comes back against the layout its RunStep carries."""

    @extend_schema(
        request=dict,
        responses={(200, "application/octet-stream"): bytes, (200, "application/json"): dict, 400: ErrorOutput,
                   404: ErrorOutput, 409: ErrorOutput},
    )
    def post(self, request: Request, job_id: str) -> HttpResponse:
        body = request.data if isinstance(request.data, dict) else {}
        read = job_dataset_read_for_node(node_id=request.auth.id, job_id=job_id, ranges=body.get("ranges"))
        if read.urls is not None:
            return Response({"urls": read.urls})
        response = StreamingHttpResponse(read.chunks, content_type="application/octet-stream")
        response["Content-Length"] = str(read.size_bytes)
        return response


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


class AgentCheckpointPartsApi(AgentApi):
    """An agent's state file for a checkpoint upload, straight into the S3 bucket: POST `{"size_bytes"}` answers
    `{"multipart_id", "part_bytes", "part_urls", "stored_parts"}` (PUT part i+1 to part_urls[i]; `stored_parts`:
    `[{"number", "size_bytes", "etag"}]`, what the bucket holds of an upload resumed (200) rather than started
    (201): the agent sends only the other parts), or `{"multipart_id": null}` when the storage is no S3 bucket (PUT
    the file to the upload itself); DELETE `?multipart_id=` aborts one."""

    @extend_schema(request=CheckpointPartsStartInput, responses={201: dict, 200: dict, 409: ErrorOutput})
    def post(self, request: Request, upload_id: str) -> Response:
        data = CheckpointPartsStartInput(data=request.data)
        data.is_valid(raise_exception=True)
        started = checkpoint_upload_direct_start(
            node_id=request.auth.id, upload_id=upload_id, size_bytes=data.validated_data["size_bytes"]
        )
        if started is None:
            return Response({"multipart_id": None})
        body = {
            "multipart_id": started.upload_id, "part_bytes": started.part_bytes, "part_urls": started.part_urls,
            "stored_parts": [{"number": p.number, "size_bytes": p.size_bytes, "etag": p.etag} for p in started.stored],
        }
        return Response(body, status=200 if started.resumed else 201)

    @extend_schema(parameters=[OpenApiParameter("multipart_id", str, OpenApiParameter.QUERY)], responses={204: None})
    def delete(self, request: Request, upload_id: str) -> Response:
        checkpoint_upload_direct_abort(
            node_id=request.auth.id, upload_id=upload_id, multipart_id=request.query_params.get("multipart_id", "")
        )
        return Response(status=204)


class AgentCheckpointPartsCompleteApi(AgentApi):
    """The agent has sent every part: `{"multipart_id", "sha256", "size_bytes"}`; the control plane completes the
    multipart upload and checks the object (its size, its header) before it takes it as the stage's state."""

    @extend_schema(request=CheckpointPartsCompleteInput, responses={201: dict, 400: ErrorOutput, 409: ErrorOutput})
    def post(self, request: Request, upload_id: str) -> Response:
        data = CheckpointPartsCompleteInput(data=request.data)
        data.is_valid(raise_exception=True)
        upload = checkpoint_upload_direct_complete(node_id=request.auth.id, upload_id=upload_id, **data.validated_data)
        return Response({"sha256": upload.sha256, "size_bytes": upload.size_bytes}, status=201)

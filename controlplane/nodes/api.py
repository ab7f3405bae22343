"""Node endpoints for people (mint, list) and for node agents (register, heartbeat)."""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle, ScopedRateThrottle, SimpleRateThrottle
from rest_framework.views import APIView

from controlplane.common.client_ip import client_ip
from controlplane.common.schema import ErrorOutput
from controlplane.nodes import schema
from controlplane.nodes.authentication import IsNodeAgent, NodeTokenAuthentication
from controlplane.nodes.heartbeat import heartbeat_body
from controlplane.nodes.models import Node
from controlplane.nodes.possession import CHALLENGE_SECONDS, registration_challenge_new, registration_possession_check
from controlplane.nodes.selectors import node_get_for_user, node_list_for_user
from controlplane.nodes.serializers import (
    AgentChallengeOutput,
    AgentHeartbeatOutput,
    AgentLeftOutput,
    AgentRegisteredOutput,
    AgentRegisterInput,
    NodeControlsInput,
    NodeCreatedOutput,
    NodeCreateInput,
    NodeOutput,
)
from controlplane.nodes.services import (
    node_create,
    node_heartbeat,
    node_leave,
    node_register,
    node_set_controls,
    node_set_paused,
    node_token_rotate,
)

NODE_ID = OpenApiParameter("node_id", str, OpenApiParameter.PATH, description="Node UUID")


class NodeListCreateApi(APIView):
    throttle_scope = "node_create"

    def get_throttles(self) -> list[BaseThrottle]:
        """Minting node tokens is throttled; listing one's nodes is not."""
        return [ScopedRateThrottle()] if self.request.method == "POST" else []

    @extend_schema(responses=NodeOutput(many=True))
    def get(self, request: Request) -> Response:
        return Response(NodeOutput(node_list_for_user(user=request.user), many=True).data)

    @extend_schema(request=NodeCreateInput, responses={201: NodeCreatedOutput})
    def post(self, request: Request) -> Response:
        data = NodeCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        node, token = node_create(owner=request.user, **data.validated_data)
        return Response({"id": node.id, "name": node.name, "token": token}, status=status.HTTP_201_CREATED)


class NodeDetailApi(APIView):
    @extend_schema(
        parameters=[NODE_ID],
        responses=NodeOutput,
    )
    def get(self, request: Request, node_id: str) -> Response:
        return Response(NodeOutput(node_get_for_user(user=request.user, node_id=node_id)).data)


class NodePauseApi(APIView):
    """Drain the node: it takes no new stage, and its stages move elsewhere without losing work."""

    paused = True

    @extend_schema(parameters=[NODE_ID], request=None, responses=NodeOutput)
    def post(self, request: Request, node_id: str) -> Response:
        node = node_get_for_user(user=request.user, node_id=node_id)
        node_set_paused(node=node, user=request.user, paused=self.paused, now=timezone.now())
        return Response(NodeOutput(node_get_for_user(user=request.user, node_id=node_id)).data)


class NodeTokenRotateApi(APIView):
    """A new agent token for the node, shown once; the old one stops working at once (restart the agent with
    the new one: `--token`)."""

    @extend_schema(parameters=[NODE_ID], request=None, responses=NodeCreatedOutput)
    def post(self, request: Request, node_id: str) -> Response:
        node = node_get_for_user(user=request.user, node_id=node_id)
        token = node_token_rotate(node=node, user=request.user)
        return Response({"id": node.id, "name": node.name, "token": token})


class NodeControlsApi(APIView):
    """The owner's controls: when the node may work (UTC windows, idle-only) and how much it offers."""

    @extend_schema(parameters=[NODE_ID], request=NodeControlsInput, responses=NodeOutput)
    def put(self, request: Request, node_id: str) -> Response:
        data = NodeControlsInput(data=request.data)
        data.is_valid(raise_exception=True)
        node = node_get_for_user(user=request.user, node_id=node_id)
        node_set_controls(node=node, user=request.user, controls=dict(data.validated_data))
        return Response(NodeOutput(node_get_for_user(user=request.user, node_id=node_id)).data)


class NodeResumeApi(NodePauseApi):
    """Offer the node again."""

    paused = False


class AgentApi(APIView):
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
            relay=beat.relay,
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

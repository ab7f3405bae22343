"""Node endpoints for people: mint, list, pause and resume, controls, token rotation. The agents' own endpoints
(register, heartbeat, leave, files) are controlplane/agents/api.py."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import BaseThrottle, ScopedRateThrottle
from rest_framework.views import APIView

from controlplane.nodes.selectors import node_get_for_user, node_list_for_user
from controlplane.nodes.serializers import (
    NodeControlsInput,
    NodeCreatedOutput,
    NodeCreateInput,
    NodeOutput,
)
from controlplane.nodes.services import (
    node_create,
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

"""Market endpoints: posted prices (anyone signed in) and a node's earnings (its owner, or its own agent)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.agents.api import AgentApi
from controlplane.market.selectors import node_earnings, prices_current
from controlplane.market.serializers import EarningsOutput, PriceOutput
from controlplane.nodes.selectors import node_get_for_user


class PriceListApi(APIView):
    @extend_schema(responses=PriceOutput(many=True))
    def get(self, request: Request) -> Response:
        return Response(PriceOutput(prices_current(), many=True).data)


class NodeEarningsApi(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("node_id", str, OpenApiParameter.PATH, description="Node UUID")],
        responses=EarningsOutput,
    )
    def get(self, request: Request, node_id: str) -> Response:
        node = node_get_for_user(user=request.user, node_id=node_id)
        return Response(EarningsOutput(node_earnings(node=node)).data)


class AgentEarningsApi(AgentApi):
    """What the calling node has earned (its agent's `arceus-agent status`): the same as its owner sees."""

    @extend_schema(responses=EarningsOutput)
    def get(self, request: Request) -> Response:
        return Response(EarningsOutput(node_earnings(node=request.auth)).data)

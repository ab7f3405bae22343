"""Market routes under /api/ (each with or without a trailing slash)."""

from django.urls import re_path

from controlplane.market.api import AgentEarningsApi, NodeEarningsApi, PriceListApi

urlpatterns = [
    re_path(r"^market/prices/?$", PriceListApi.as_view(), name="market-prices"),
    re_path(r"^nodes/(?P<node_id>[^/]+)/earnings/?$", NodeEarningsApi.as_view(), name="node-earnings"),
    re_path(r"^agent/earnings/?$", AgentEarningsApi.as_view(), name="agent-earnings"),
]

"""`Authorization: Node <token>`: how node agents authenticate (the token from POST /api/nodes)."""

from __future__ import annotations

from django.utils.functional import SimpleLazyObject
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.views import APIView

from controlplane.nodes.models import Node
from controlplane.nodes.selectors import node_by_token_hash
from controlplane.nodes.services import node_token_hash

KEYWORD = "Node"
HOW_TO = f"send `Authorization: {KEYWORD} <token>` with the token shown once by POST /api/nodes"


class NodeTokenAuthentication(BaseAuthentication):
    """Authenticates as the node's owner; `request.auth` is the Node."""

    def authenticate(self, request: Request) -> tuple[object, Node] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].decode(errors="replace").lower() != KEYWORD.lower():
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed(f"malformed node credentials; {HOW_TO}")
        try:
            token = parts[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed(f"the node token is not valid text; {HOW_TO}") from None
        node = node_by_token_hash(token_hash=node_token_hash(token))
        if node is None:
            raise exceptions.AuthenticationFailed(
                "invalid node token: no node has it (was the node deleted, or the token mistyped?); " + HOW_TO
            )
        if not node.owner_is_active:
            raise exceptions.AuthenticationFailed("the owner of this node is disabled")
        # The owner is loaded only if a view asks for it: a heartbeat never does.
        return SimpleLazyObject(lambda: node.owner), node

    def authenticate_header(self, request: Request) -> str:
        return KEYWORD


class IsNodeAgent(BasePermission):
    def has_permission(self, request: Request, view: APIView) -> bool:
        if not isinstance(request.auth, Node):
            raise exceptions.NotAuthenticated(f"node agent endpoint: {HOW_TO}")
        return True


class NodeTokenScheme(OpenApiAuthenticationExtension):
    """The node-token scheme in the OpenAPI schema, registered when this module loads: with the agents' API views
    (controlplane/agents/api.py), which the schema is generated from. Not at every process's start-up: drf-spectacular
    loads DRF's and Django's test clients, ~25 MiB in each Celery process, which serves no API."""

    target_class = "controlplane.nodes.authentication.NodeTokenAuthentication"
    name = "nodeToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": 'Node agents send "Node <token>" (the token minted by POST /api/nodes).',
        }

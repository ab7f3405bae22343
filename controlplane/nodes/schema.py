"""Describes the node-token scheme in the OpenAPI schema."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class NodeTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.nodes.authentication.NodeTokenAuthentication"
    name = "nodeToken"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": 'Node agents send "Node <token>" (the token minted by POST /api/nodes).',
        }

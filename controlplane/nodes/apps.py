from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "controlplane.nodes"
    label = "nodes"
    verbose_name = "Nodes"

    def ready(self) -> None:
        from controlplane.nodes import schema  # noqa: F401  registers the OpenAPI auth extension

from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "controlplane.nodes"
    label = "nodes"
    verbose_name = "Nodes"

    def ready(self) -> None:
        from django.conf import settings

        from arceus.relay.dialer import use_relays
        from controlplane.nodes import schema  # noqa: F401  registers the OpenAPI auth extension
        from controlplane.nodes.relays import relay_certificate

        # The driver and samplers reach relayed agents through these.
        use_relays(settings.ARCEUS_RELAYS, relay_certificate())

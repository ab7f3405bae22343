from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "controlplane.nodes"
    label = "nodes"
    verbose_name = "Nodes"

    def ready(self) -> None:
        from django.db import transaction
        from django.db.models.signals import post_delete

        from controlplane.nodes.liveness import leases_forget
        from controlplane.nodes.models import Node
        from controlplane.nodes.relays import relay_certificate

        # A misconfigured relay certificate stops every process at start-up; the training worker, which dials
        # agents (the driver, samplers), reaches relayed ones through the relays (tasks/training.py).
        relay_certificate()

        # A node goes by the admin or with its owner (a cascade no service sees): its lease goes once that commits.
        def forget_lease(instance: Node, **_: object) -> None:
            node_id = instance.pk  # read now: the deletion sets it to None before the commit
            transaction.on_commit(lambda: leases_forget([node_id]))

        post_delete.connect(forget_lease, sender=Node, weak=False, dispatch_uid="nodes-forget-lease")

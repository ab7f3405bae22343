from django.apps import AppConfig


class CommonConfig(AppConfig):
    name = "controlplane.common"
    label = "common"
    verbose_name = "Common"

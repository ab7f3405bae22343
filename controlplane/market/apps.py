from django.apps import AppConfig


class MarketConfig(AppConfig):
    name = "controlplane.market"
    label = "market"
    verbose_name = "Market"

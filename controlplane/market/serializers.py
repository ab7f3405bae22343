"""Response shapes of the market endpoints. Money is a decimal string of US dollars."""

from __future__ import annotations

from rest_framework import serializers

MONEY = {"max_digits": 18, "decimal_places": 6}


class PriceOutput(serializers.Serializer):
    device_class = serializers.CharField(help_text='"<compute tier>-<memory tier>", e.g. "standard-medium"')
    price_per_hour = serializers.FloatField(help_text="US dollars per hour, in force now")
    base_price_per_hour = serializers.FloatField(help_text="the price when demand and supply balance")
    demand = serializers.FloatField(allow_null=True)
    supply = serializers.FloatField(allow_null=True)
    ready_nodes = serializers.IntegerField(help_text="devices of this class that could take work now")
    updated_at = serializers.DateTimeField(allow_null=True)


class EarningsDayOutput(serializers.Serializer):
    day = serializers.DateField()
    credit_usd = serializers.DecimalField(**MONEY)
    samples = serializers.IntegerField()
    compute_seconds = serializers.FloatField()
    held_seconds = serializers.FloatField(help_text="seconds jobs held the node: what its credit pays for")


class EarningsJobOutput(serializers.Serializer):
    job_id = serializers.UUIDField()
    job_name = serializers.CharField()
    credit_usd = serializers.DecimalField(**MONEY)
    samples = serializers.IntegerField()
    compute_seconds = serializers.FloatField()
    held_seconds = serializers.FloatField(help_text="seconds jobs held the node: what its credit pays for")


class EarningsOutput(serializers.Serializer):
    node_id = serializers.UUIDField()
    device_class = serializers.CharField()
    credit_usd = serializers.DecimalField(**MONEY)
    withheld_usd = serializers.DecimalField(**MONEY, help_text="credit withheld: a spot check caught the work wrong")
    samples = serializers.IntegerField()
    compute_seconds = serializers.FloatField()
    held_seconds = serializers.FloatField(help_text="seconds jobs held the node: what its credit pays for")
    per_day = EarningsDayOutput(many=True)
    per_job = EarningsJobOutput(many=True)


class JobCostOutput(serializers.Serializer):
    charged_usd = serializers.DecimalField(**MONEY)
    platform_fee_usd = serializers.DecimalField(**MONEY)
    withheld_usd = serializers.DecimalField(
        **MONEY, help_text="credit not paid to nodes caught wrong by spot checks: credits + fee + withheld = charged"
    )
    budget_usd = serializers.DecimalField(
        **MONEY, allow_null=True, help_text="the job's max_total_usd: it stops, checkpointed, before passing it"
    )
    budget_remaining_usd = serializers.DecimalField(
        **MONEY, allow_null=True, help_text="max_total_usd less what was charged; null without a max_total_usd"
    )
    remaining_seconds = serializers.FloatField(allow_null=True, help_text="at the current speed; null unless running")
    estimate_to_finish_usd = serializers.DecimalField(
        **MONEY, allow_null=True, help_text="the rest of the training at the posted prices of the devices it holds, "
        "per second held (the basis of its charges); null unless running"
    )

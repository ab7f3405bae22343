"""What one scrape of the control plane's /metrics answers: every process's recorded metrics (summed from
PROMETHEUS_MULTIPROC_DIR, or this process's own without it), the reconcile lag derived from them, and gauges
read from the database now. Only aggregates: no tenant, job or node is named in a label."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from controlplane.common.metrics import MULTIPROCESS, RECONCILE_COMPLETED_NAME
from controlplane.jobs.selectors import job_counts_by_status
from controlplane.market.selectors import ledger_totals
from controlplane.nodes.selectors import node_counts


def scrape_registry() -> CollectorRegistry:
    """A registry for one scrape (multiprocess mode wants a fresh one each time)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RecordedCollector(MultiProcessCollector(None) if MULTIPROCESS else REGISTRY))
    registry.register(DatabaseCollector())
    return registry


class RecordedCollector(Collector):
    """What the processes recorded, plus `arceus_reconcile_lag_seconds`: seconds since the newest completed
    reconcile pass (absent before the first)."""

    def __init__(self, source: Collector | CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            yield family
            if family.name == RECONCILE_COMPLETED_NAME and family.samples:
                lag = GaugeMetricFamily(
                    "arceus_reconcile_lag_seconds", "Seconds since the newest reconcile pass completed."
                )
                lag.add_metric([], max(0.0, time.time() - max(s.value for s in family.samples)))
                yield lag


class DatabaseCollector(Collector):
    """Jobs by status, nodes by Ready state and by what holds them back, and the ledger's totals, read at scrape
    time (a few aggregate queries)."""

    def collect(self) -> Iterable[Metric]:
        jobs = GaugeMetricFamily("arceus_jobs", "Jobs in each status.", labels=["status"])
        for status, count in job_counts_by_status().items():
            jobs.add_metric([status], count)
        counts = node_counts()
        nodes = GaugeMetricFamily(
            "arceus_nodes", "Nodes in each Ready state (NotRegistered: the agent never registered).", labels=["ready"]
        )
        for ready, count in counts["ready"].items():
            nodes.add_metric([ready], count)
        held = GaugeMetricFamily(
            "arceus_nodes_held_back", "Nodes that take no new work, by reason (a node may have several).",
            labels=["reason"],
        )
        for reason, count in counts["held_back"].items():
            held.add_metric([reason], count)
        ledger = GaugeMetricFamily(
            "arceus_ledger_dollars",
            "The ledger's totals in US dollars: charged to jobs' owners, platform fees, credit paid to nodes' "
            "owners, credit withheld (refunds of rolled-back work count negatively).",
            labels=["kind"],
        )
        for kind, amount in ledger_totals().items():
            ledger.add_metric([kind], float(amount))
        return [jobs, nodes, held, ledger]

"""Market tasks (control queue): repricing and the ledger's hourly rollup. Both recompute from the
database, so running one twice, or late, is harmless."""

from __future__ import annotations

import logging

from django.utils import timezone

from controlplane.celery import REPRICE_TASK, ROLLUP_LEDGER_TASK, app
from controlplane.market.services import ROLLUP_WINDOW, ledger_rollup, prices_reprice

log = logging.getLogger(__name__)


@app.task(name=REPRICE_TASK, ignore_result=True)
def reprice() -> None:
    for change in prices_reprice():
        log.info("price of %s now $%.4f/h (demand %g, supply %g)", change.device_class, change.price_per_hour,
                 change.demand, change.supply)


@app.task(name=ROLLUP_LEDGER_TASK, ignore_result=True)
def rollup_ledger() -> None:
    ledger_rollup(since=timezone.now() - ROLLUP_WINDOW)

"""One database's stages of an inbox, built one way for the inbox's own database and each tenant's.

A plain inbox has one pipeline; an inbox serving tenants has one more per
tenant (``_tenants.Place``), on the tenant's engine, with the tenant's
metrics and alert label. Both are built here, so a stage added to one is in
the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import tenacity

from ._admin import ParkedAdmin
from ._alerting import Alerter
from ._calls import TopicHandlers
from ._gaps import GapSweeper
from ._outage import OutageLog
from ._sessions import Sessions
from ._settings import InboxSettings
from ._settle import Settler
from ._transaction import TransactionStep
from .storage import InboxStorage


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The stages of one database, each handed what it needs: one storage owns every statement."""

    storage: InboxStorage
    step: TransactionStep
    settler: Settler
    admin: ParkedAdmin
    gaps: GapSweeper


def build_pipeline(sessions: Sessions, storage: InboxStorage, handlers: Mapping[str, TopicHandlers],
                   settings: InboxSettings, alerter: Alerter, outages: OutageLog,
                   run_over: Callable[[], Callable[[], bool]] | None = None) -> Pipeline:
    """The stages of the inbox of ``settings`` on ``sessions``, alerting and counting through ``alerter``;
    ``run_over``: whether the inbox's run is stopping or over, for a read beginning now: its sweep's watch
    then tells nothing (``GapSweeper``)."""
    step = TransactionStep(sessions, storage, handlers, alerter.metrics, settings.start,
                           settings.dedup_window, settings.batch_budget)
    settler = Settler(step, alerter, outages, max_attempts=settings.max_attempts,
                      wait=tenacity.wait_exponential_jitter(multiplier=settings.retry_backoff,
                                                            max=settings.retry_backoff_max,
                                                            jitter=settings.retry_backoff))
    gaps = GapSweeper(sessions, storage, alerter, settings.gap_timeout,
                      settings.gap_alert_after or settings.gap_timeout / 2, outages, run_over)
    return Pipeline(storage, step, settler, ParkedAdmin(sessions, storage, step), gaps)

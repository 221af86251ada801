"""The periodic resync: every `sweep_interval_s` each service's records are driven again and a
pass runs, so whatever should be in motion and is not (a task died, an event was lost) gets
going; the store's heartbeat goes through the writer, so a store that stopped taking writes
shows in health."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from services.common import errors
from services.controller import writer

if TYPE_CHECKING:
    from services.controller.reconciler import ServiceReconciler

log = logging.getLogger(__name__)


async def run(
    *,
    interval_s: float,
    services: Callable[[], dict[str, ServiceReconciler]],
    db_writer: writer.Writer,
    before: Callable[[], Awaitable[None]],
) -> None:
    """Resync for ever; `before` runs first each round (the zones, if still unknown)."""
    while True:
        await asyncio.sleep(interval_s)
        await before()
        try:
            await db_writer.submit(lambda db: db.check_writable(), transaction=False)
        except errors.UnavailableError:
            pass
        for rec in list(services().values()):
            try:
                resync(rec)
            except Exception:
                log.exception("resync of service %s failed", rec.name)
            await asyncio.sleep(0)  # one service per step: the loop answers calls in between


def resync(rec: ServiceReconciler) -> None:
    """One service: drive every record as if resumed (no drain), then plan again."""
    if rec.gone or rec.stopping or not rec.started:
        return
    rec.drive(rec.replicas, resumed=True)
    rec.show()

"""Leader election among controllers that share one store: a lease with an epoch in the database.

Every controller competes for the lease row (store.acquire_lease) every third of the lease
duration. The one that holds it leads: it fences the store to its epoch (every write first
checks the lease row, store.FencedError otherwise) and renews the lease from a thread of its own,
so a busy event loop cannot lose it. A leader that finds the lease taken, or cannot renew it for
a whole lease duration, is deposed: it stops at once (the controller then exits with code 3).
A lapsed lease is taken by the next standby that polls, with the epoch bumped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time

from services.common import errors
from services.controller import store

log = logging.getLogger(__name__)


def new_holder() -> str:
    """A name for this process, unique among every controller that will ever share the store."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Leadership:
    """This controller's side of the election."""

    def __init__(self, db: store.Store, *, address: str, duration_s: float, holder: str = "") -> None:
        """Prepare to compete; nothing is written until `wait_to_lead`.

        Args:
            db: the controller's store; fenced to the epoch once this controller leads.
            address: host:port where this controller serves, kept in the lease for standbys.
            duration_s: how long the lease lasts unless renewed (renewed every third of it).
            holder: this process's name in the lease (default: host, pid and a random part).
        """
        self.holder = holder or new_holder()
        self.address = address
        self.duration_s = duration_s
        self.epoch = 0
        self.leading = False
        self.lease: store.Lease | None = None
        """The lease as last seen: who leads, and where."""
        self.deposed = asyncio.Event()
        self.reason = ""
        self._db = db
        self._keeper = db.reopen(fenced=False)  # lease calls: their own connection, never fenced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_error = ""
        self.closed = False

    @property
    def poll_s(self) -> float:
        """How often a standby tries for the lease and a leader renews it."""
        return self.duration_s / 3

    def leader_address(self) -> str:
        """Where the current leader serves ("" when none is known or the lease lapsed)."""
        lease = self.lease
        if lease is None or lease.holder == self.holder or lease.lapsed or not lease.address:
            return ""
        return lease.address

    async def wait_to_lead(self) -> int:
        """Try for the lease until this controller holds it (see `try_lead`).

        Returns:
            The epoch this controller leads at.
        """
        waiting_logged = False
        while not await self.try_lead():
            lease = self.lease
            if lease is not None and not waiting_logged:
                log.info("standing by: %s leads (epoch %d) at %s", lease.holder, lease.epoch, lease.address)
                waiting_logged = True
            await asyncio.sleep(self.poll_s)
        return self.epoch

    async def try_lead(self) -> bool:
        """Try for the lease once; on success fence the store to the epoch and start renewing.

        Returns:
            True if this controller leads now.
        """
        if self.leading:
            return True
        self._loop = asyncio.get_running_loop()
        lease = await asyncio.to_thread(self._try)
        if lease is None:
            return False
        self.lease = lease
        if lease.holder != self.holder:
            return False
        self.epoch = lease.epoch
        self._db.fence(self.holder, self.epoch, on_lost=lambda: self._lost("a write found another leader"))
        self.leading = True
        log.info("leading at epoch %d as %s (%s)", self.epoch, self.holder, self.address)
        self._thread = threading.Thread(target=self._renew, name="lease renewal", daemon=True)
        self._thread.start()
        return True

    def _try(self) -> store.Lease | None:
        try:
            return self._keeper.acquire_lease(self.holder, self.address, self.duration_s)
        except errors.UnavailableError as exc:
            if exc.message != self._last_error:
                log.warning("cannot compete for the lease: %s", exc.message)
                self._last_error = exc.message
            return None

    def _renew(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.poll_s):
            try:
                ok: bool | None = self._keeper.renew_lease(self.holder, self.epoch, self.duration_s)
            except errors.UnavailableError:
                ok = None
            now = time.monotonic()
            if ok:
                last_ok = now
            elif ok is False:
                self._lost(f"the lease was taken (this controller led at epoch {self.epoch})")
                return
            elif now - last_ok >= self.duration_s:
                # Unrenewed for a whole lease: a standby may lead by now. Stop acting.
                self._lost(f"the lease could not be renewed for {self.duration_s:g} s")
                return

    def step_down(self, reason: str) -> None:
        """Stop leading (or competing) for `reason`: the controller then exits with code 3."""
        self._loop = self._loop or asyncio.get_running_loop()
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        """Deposed (from any thread): stop leading."""
        loop = self._loop
        if loop is None or self.deposed.is_set():
            return
        self.leading = False
        self.reason = self.reason or reason

        def mark() -> None:
            if not self.deposed.is_set():
                log.error("stepping down: %s", self.reason)
                self.deposed.set()

        try:
            loop.call_soon_threadsafe(mark)
        except RuntimeError:  # the loop is closed: the process is on its way out anyway
            pass

    def close(self, *, release: bool) -> None:
        """Stop renewing; with `release`, let the lease lapse now so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.duration_s)
        if release and self.leading and not self.deposed.is_set():
            try:
                self._keeper.release_lease(self.holder, self.epoch)
                log.info("released the lease (epoch %d)", self.epoch)
            except errors.UnavailableError as exc:
                log.warning("could not release the lease: %s", exc.message)
        self.leading = False
        self.closed = True
        self._keeper.close()

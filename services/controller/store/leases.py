"""The lease row and epoch fencing: which of the controllers sharing a store leads, and what a
deposed leader's writes do (nothing). `LeaseTables` is mixed into `Store`; `Store.transaction`
checks the fence inside every write transaction."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from services.common import errors

log = logging.getLogger("services.controller.store")

LEASE = "controller"
"""The name of the lease the controllers sharing a store compete for."""


class FencedError(errors.UnavailableError):
    """A write of a controller that no longer leads: another took the lease (a newer epoch)."""

    def __init__(self) -> None:
        super().__init__(
            "this controller no longer leads (another controller took over); nothing was changed, try again",
            reason="NOT_LEADER",
        )


@dataclasses.dataclass(frozen=True)
class Lease:
    """The lease row: who leads, since which epoch, where it is reached, until when.

    Attributes:
        holder: the leading process's unique name (not the controller id, which they share).
        epoch: bumped each time the lease changes hands; every write of the leader checks it.
        address: host:port where the leader serves the API (standbys forward to it).
        expires: the database's clock, seconds since the epoch, when the lease lapses unless
            renewed.
        now: the database's clock when the row was read.
    """

    holder: str
    epoch: int
    address: str
    expires: float
    now: float

    @property
    def lapsed(self) -> bool:
        """True once nobody renewed it in time."""
        return self.now >= self.expires


@dataclasses.dataclass
class Fence:
    """What the leader's writes must find in the lease row; shared by a store and its reopen()s."""

    holder: str
    epoch: int
    on_lost: Callable[[], None] | None = None
    lost: bool = False


class LeaseTables:
    """The lease methods of the store."""

    _db: Any  # the store's connection
    _fence: Fence | None
    _leases_ready: bool
    leases_ddl: str

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        """The store's transaction (see `store.Store.transaction`)."""
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def _db_now(self) -> float:
        raise NotImplementedError

    def fence(self, holder: str, epoch: int, *, on_lost: Callable[[], None] | None = None) -> None:
        """From now on every write first checks that `holder` still holds the lease at `epoch`.

        A write that finds another holder or epoch raises FencedError and changes nothing; so
        does every write after it, and `on_lost` is called once (from the writing thread).
        """
        self._ensure_leases()
        self._fence = Fence(holder, epoch, on_lost)

    @property
    def fenced_out(self) -> bool:
        """True once a write found that this store's leader was deposed."""
        return self._fence is not None and self._fence.lost

    def _check_fence(self, fence: Fence) -> None:
        # Inside the write transaction, after the writer lock: a takeover (a write itself) is
        # either wholly before this check or wholly after this transaction.
        row = self._db.execute("SELECT holder, epoch FROM leases WHERE name = ?", (LEASE,)).fetchone()
        if row is not None and (str(row[0]), int(row[1])) == (fence.holder, fence.epoch):
            return
        first = not fence.lost
        fence.lost = True
        if first:
            log.error(
                "deposed: the lease is no longer %s's at epoch %d; nothing more is written", fence.holder, fence.epoch
            )
            if fence.on_lost is not None:
                fence.on_lost()
        raise FencedError()

    def _ensure_leases(self) -> None:
        if self._leases_ready:
            return
        with self.transaction():  # the writer lock keeps two controllers from creating it at once
            self._db.execute(self.leases_ddl)
        self._leases_ready = True

    def read_lease(self) -> Lease | None:
        """The lease row, or None before anyone took it."""
        self._ensure_leases()
        with self._read():
            now = self._db_now()
            row = self._db.execute(
                "SELECT holder, epoch, address, expires FROM leases WHERE name = ?", (LEASE,)
            ).fetchone()
        return None if row is None else Lease(str(row[0]), int(row[1]), str(row[2]), float(row[3]), now)

    def acquire_lease(self, holder: str, address: str, duration_s: float) -> Lease:
        """Take the lease if it is free, lapsed or already `holder`'s; renew it if it is ours.

        Returns:
            The lease after the attempt: `holder` leads if `lease.holder == holder`. Taking it
            from someone else (or for the first time) bumps the epoch.
        """
        self._ensure_leases()
        with self.transaction():
            now = self._db_now()
            row = self._db.execute("SELECT holder, epoch, expires FROM leases WHERE name = ?", (LEASE,)).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO leases (name, holder, epoch, address, expires) VALUES (?, ?, 1, ?, ?)",
                    (LEASE, holder, address, now + duration_s),
                )
            elif str(row[0]) == holder or float(row[2]) <= now:
                epoch = int(row[1]) + (str(row[0]) != holder)
                self._db.execute(
                    "UPDATE leases SET holder = ?, epoch = ?, address = ?, expires = ? WHERE name = ?",
                    (holder, epoch, address, now + duration_s, LEASE),
                )
            found = self._db.execute(
                "SELECT holder, epoch, address, expires FROM leases WHERE name = ?", (LEASE,)
            ).fetchone()
        return Lease(str(found[0]), int(found[1]), str(found[2]), float(found[3]), now)

    def renew_lease(self, holder: str, epoch: int, duration_s: float) -> bool:
        """Extend `holder`'s lease at `epoch`; False if it is no longer theirs (deposed)."""
        with self.transaction():
            cur = self._db.execute(
                "UPDATE leases SET expires = ? WHERE name = ? AND holder = ? AND epoch = ?",
                (self._db_now() + duration_s, LEASE, holder, epoch),
            )
            return bool(cur.rowcount)

    def release_lease(self, holder: str, epoch: int) -> None:
        """Let the lease lapse now, if it is still `holder`'s at `epoch` (a clean shutdown)."""
        with self.transaction():
            self._db.execute(
                "UPDATE leases SET expires = 0 WHERE name = ? AND holder = ? AND epoch = ?", (LEASE, holder, epoch)
            )

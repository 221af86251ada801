"""The store's jobs table: every job of every pool, as protobuf rows.

Schema migration 5 adds it (`migrate_jobs` on SQLite, `migrate_jobs_postgres`; store/schema.py).
`JobTables` is mixed into `store.Store`: its methods join the store's transactions like every
other store call, on either backend (the SQL is portable). A pool's jobs go with the pool (the
rows reference the service row, ON DELETE CASCADE).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable
from typing import Any

from replicaplane.controller.v1 import resources_pb2 as res
from services.common import errors


def migrate_jobs(db: sqlite3.Connection) -> None:
    """The jobs of pools: one row per job, keyed by pool and job id, with its state indexed.

    Idempotent (IF NOT EXISTS): the rollouts migration and this one were written at the same
    time, so a development database may have met them in either order.
    """
    db.execute(
        """CREATE TABLE IF NOT EXISTS jobs (
            pool TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            job_id INTEGER NOT NULL,
            state INTEGER NOT NULL,
            data BLOB NOT NULL,
            PRIMARY KEY (pool, job_id)
        ) STRICT"""
    )
    db.execute("CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (pool, state)")


def migrate_jobs_postgres(db: Any) -> None:
    """`migrate_jobs` on PostgreSQL (idempotent too, as the two stay in step)."""
    db.execute(
        """CREATE TABLE IF NOT EXISTS jobs (
            pool TEXT NOT NULL REFERENCES services(name) ON DELETE CASCADE,
            job_id BIGINT NOT NULL,
            state INTEGER NOT NULL,
            data BYTEA NOT NULL,
            PRIMARY KEY (pool, job_id)
        )"""
    )
    db.execute("CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (pool, state)")


class JobTables:
    """Job methods of the store."""

    _db: Any
    integrity_errors: tuple[type[BaseException], ...]

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        """The store's transaction (see `store.Store.transaction`)."""
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def add_job(self, job: res.Job) -> res.Job:
        """Store a new job under the pool's next job id.

        Ids start at 1 and only grow while the pool exists.

        Args:
            job: the job; its `job_id` is ignored.

        Returns:
            The stored job, with its id.

        Raises:
            errors.NotFoundError: no such pool.
        """
        with self.transaction():
            if self._db.execute("SELECT 1 FROM services WHERE name = ?", (job.pool,)).fetchone() is None:
                raise errors.NotFoundError(f"pool {job.pool!r} not found", reason="POOL_NOT_FOUND", pool=job.pool)
            row = self._db.execute(
                "SELECT COALESCE(MAX(job_id), 0) + 1 FROM jobs WHERE pool = ?", (job.pool,)
            ).fetchone()
            stored = res.Job()
            stored.CopyFrom(job)
            stored.job_id = int(row[0])
            self._put(stored)
            return stored

    def put_jobs(self, jobs: Iterable[res.Job]) -> None:
        """Replace several job rows in one transaction.

        Raises:
            errors.NotFoundError: a job's pool does not exist (nothing is written).
        """
        with self.transaction():
            for job in jobs:
                self._put(job)

    def list_jobs(self, pool: str) -> list[res.Job]:
        """Every job of a pool, in id order."""
        with self._read() as db:
            rows = db.execute("SELECT data FROM jobs WHERE pool = ? ORDER BY job_id", (pool,)).fetchall()
        out = []
        for (data,) in rows:
            job = res.Job()
            job.ParseFromString(bytes(data))
            out.append(job)
        return out

    def _put(self, job: res.Job) -> None:
        if job.job_id < 1:
            raise ValueError(f"job_id must be >= 1, got {job.job_id}")
        try:
            self._db.execute(
                "INSERT INTO jobs (pool, job_id, state, data) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (pool, job_id) DO UPDATE SET state = excluded.state, data = excluded.data",
                (job.pool, job.job_id, int(job.state), job.SerializeToString()),
            )
        except self.integrity_errors:
            raise errors.NotFoundError(f"pool {job.pool!r} not found", reason="POOL_NOT_FOUND", pool=job.pool) from None
